"""Throughput of hidden-state extraction with the HF backend against plain forward passes.

A random-init model of a real shape (default: Llama-3-8B, bf16, CUDA) runs the same padded
batches (same lengths, same order) three ways:

  forward          model(input_ids, attention_mask): the full model, logits included
  decoder          the inner decoder only (what extraction must compute at least)
  extraction       HfBackend hooks + the shard store + the writer thread (the real write path:
                   append per batch, checksum, fsync, atomic rename), through ``extract_shards``;
                   with ``--storage fp8`` the backend quantises on the device, as the workflow's does

and prints tokens/s for each and the ratio extraction/forward (goal: at least 0.95).

    python bench/extraction.py                    # 8B shape on cuda (needs ~20 GB of GPU memory)
    python bench/extraction.py --tiny             # a small shape on CPU, float32
    python bench/extraction.py --storage fp8 --out /local/nvme/bench
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.extract.capture import extract_shards, plan_batches  # noqa: E402
from draftsmith.extract.hf_backend import HfBackend  # noqa: E402
from draftsmith.extract.shard_writer import PartStore  # noqa: E402

SHAPES = {
    # Llama-3-8B
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    # SmolLM2-135M, the demo's target
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shape on CPU in float32 (a smoke run)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None)
    p.add_argument("--device", default=None, help="cuda (default) or cpu (default with --tiny)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="model dtype (bfloat16; float32 with --tiny)")
    p.add_argument("--storage", default="bfloat16", choices=["bfloat16", "float16", "float32", "fp8"])
    p.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per forward (16384; 2048 with --tiny)")
    p.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (65536; 2048 with --tiny)")
    p.add_argument("--tokens", type=int, default=None, help="total real tokens (524288; 16384 with --tiny)")
    p.add_argument("--min-len", type=int, default=None, help="shortest sample (256; 16 with --tiny)")
    p.add_argument("--max-len", type=int, default=None, help="longest sample (4096; 512 with --tiny)")
    p.add_argument("--aux-layers", default=None, help="comma-separated aux layer ids (default [2, L//2, L-3])")
    p.add_argument("--out", default=None, help="folder for the shard store (default: a temporary folder)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 with --tiny)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each mode, interleaved; the best counts")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tiny = args.tiny
    defaults = dict(shape="tiny" if tiny else "8b", device="cpu" if tiny else "cuda",
                    dtype="float32" if tiny else "bfloat16", batch_tokens=2048 if tiny else 16384,
                    shard_tokens=2048 if tiny else 65536, tokens=16384 if tiny else 524288,
                    min_len=16 if tiny else 256, max_len=512 if tiny else 4096, threads=1 if tiny else None)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def build_model(shape: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A random-init Llama of the given shape, built directly on the device in its dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def make_samples(tokens: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[dict]:
    """Samples of random lengths, sorted longest first as the driver sorts a part."""
    rng = random.Random(seed)
    samples, total = [], 0
    while total < tokens:
        n = min(rng.randint(min_len, max_len), tokens - total)
        samples.append({"id": f"s{len(samples)}", "input_ids": [rng.randrange(vocab) for _ in range(n)],
                        "loss_mask": [1] * n})
        total += n
    samples.sort(key=lambda s: -len(s["input_ids"]))
    return samples


def shards_of(samples: list[dict], shard_tokens: int) -> list[list[dict]]:
    shards, current, count = [], [], 0
    for s in samples:
        if current and count + len(s["input_ids"]) > shard_tokens:
            shards.append(current)
            current, count = [], 0
        current.append(s)
        count += len(s["input_ids"])
    return shards + ([current] if current else [])


def padded(batch: list[dict], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s["input_ids"]) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(batch):
        ids[row, :len(s["input_ids"])] = torch.tensor(s["input_ids"])
        mask[row, :len(s["input_ids"])] = 1
    if device == "cuda":
        return ids.pin_memory().to(device, non_blocking=True), mask.pin_memory().to(device, non_blocking=True)
    return ids.to(device), mask.to(device)


def filesystem(path: Path) -> str:
    """The mount point and type holding ``path`` (tmpfs would make the write path look free)."""
    path = path.resolve()
    best = ("?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, kind, *_ = line.split()
            if (path == Path(mount) or Path(mount) in path.parents) and len(mount) >= len(best[0]):
                best = (mount, kind)
    except OSError:
        pass
    return f"{best[0]} ({best[1]})"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def time_forward(module, batches: list[list[dict]], device: str) -> float:
    sync(device)
    started = time.perf_counter()
    for batch in batches:
        ids, mask = padded(batch, device)
        module(input_ids=ids, attention_mask=mask, use_cache=False)
    sync(device)
    return time.perf_counter() - started


def time_extraction(model, shards, layer_ids, args, out: Path) -> tuple[float, int]:
    num_layers = model.config.num_hidden_layers
    backend = HfBackend(model, layers_path="model.layers", capture_layer_ids=layer_ids,
                        final_layer_id=num_layers, lm_head_path="lm_head", fp8=args.storage == "fp8")
    if out.exists():
        shutil.rmtree(out)
    store = PartStore(out, 0, fingerprint="bench", dtype=args.storage, hidden_size=model.config.hidden_size,
                      layer_ids=layer_ids)
    todo = list(enumerate(shards))
    sync(args.device)
    started = time.perf_counter()
    infos = extract_shards(backend, store, todo, batch_tokens=args.batch_tokens)
    sync(args.device)
    seconds = time.perf_counter() - started
    written = sum((out / info.path / name).stat().st_size for info in infos for name in info.checksums)
    backend.close()
    return seconds, written


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    print(f"building a random-init {args.shape} Llama ({args.dtype}) on {args.device} ...", flush=True)
    model = build_model(args.shape, dtype, args.device)
    num_layers = model.config.num_hidden_layers
    aux = [int(x) for x in args.aux_layers.split(",")] if args.aux_layers else \
        sorted({2, num_layers // 2, num_layers - 3})
    layer_ids = [*aux, num_layers]
    samples = make_samples(args.tokens, args.min_len, args.max_len, model.config.vocab_size, args.seed)
    shards = shards_of(samples, args.shard_tokens)
    batches = [b for shard in shards for b in plan_batches(shard, args.batch_tokens)]
    tokens = sum(len(s["input_ids"]) for s in samples)
    padded_tokens = sum(len(b) * max(len(s["input_ids"]) for s in b) for b in batches)
    print(f"{len(samples)} samples, {tokens} tokens ({padded_tokens} padded) in {len(batches)} batches of "
          f"<= {args.batch_tokens} padded tokens, {len(shards)} shards; layers {layer_ids}; storage {args.storage}",
          flush=True)

    warm = batches[:2]
    time_forward(model, warm, args.device)
    time_forward(model.model, warm, args.device)

    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="draftsmith-bench-"))
    best = {"forward (logits)": float("inf"), "decoder only (no head)": float("inf"),
            "extraction (hooks+store)": float("inf")}
    try:
        # Warm the extraction path too (pinned buffers, copy streams), on a shard of its own.
        time_extraction(model, [shards[-1]], layer_ids, args, root / "warmup")
        for _ in range(args.repeats):  # interleaved, best of: drift and noise hit every mode alike
            best["forward (logits)"] = min(best["forward (logits)"], time_forward(model, batches, args.device))
            best["decoder only (no head)"] = min(best["decoder only (no head)"],
                                                 time_forward(model.model, batches, args.device))
            seconds, written = time_extraction(model, shards, layer_ids, args, root / "store")
            best["extraction (hooks+store)"] = min(best["extraction (hooks+store)"], seconds)
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)

    forward, decoder, extraction = best.values()
    print()
    print(f"{'mode (best of ' + str(args.repeats) + ')':<28}{'seconds':>10}{'tokens/s':>12}{'vs forward':>12}"
          f"{'vs decoder':>12}")
    for name, seconds in best.items():
        print(f"{name:<28}{seconds:>10.2f}{tokens / seconds:>12.0f}{forward / seconds:>11.3f}x"
              f"{decoder / seconds:>11.3f}x")
    ratio = forward / extraction
    print()
    print(f"extraction wrote {written / 2**20:.1f} MiB per run ({written / extraction / 2**20:.1f} MiB/s) "
          f"to {root} on {filesystem(root)}")
    print(f"extraction / plain forward = {ratio:.3f}x (goal >= 0.95x): {'OK' if ratio >= 0.95 else 'BELOW GOAL'}")
    print(f"extraction / decoder only  = {decoder / extraction:.3f}x")

if __name__ == "__main__":
    main()
