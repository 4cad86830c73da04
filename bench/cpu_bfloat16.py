"""bfloat16 against float32 for the target's forwards on the CPU, side by side in one process.

What ``target.dtype: auto`` chooses on the CPU (engines.hf_model.model_dtype_name): the batched
forwards of regeneration (HF ``generate``) and extraction (a forward over full batches) in bfloat16
where the CPU has bfloat16 matrix instructions, evaluation's loop (one token at a time) in float32.
This bench times the three kinds of work in both dtypes on a run's target (by default the demo's,
after `make demo`), with the threads Snakemake gives a job on this machine:

    python bench/cpu_bfloat16.py --target results/demo/target
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith.engines.cpu_bfloat16 import cpu_multiplies_bfloat16  # noqa: E402
from draftsmith.engines.hf_model import load_target_model  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, default=ROOT / "results/demo/target", help="a model folder")
    p.add_argument("--threads", type=int, default=2, help="torch threads (a job's on the 2-core machine)")
    p.add_argument("--batch", type=int, default=128, help="prompts per generate call (the demo's batch)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens per answer (the demo's max_new_tokens)")
    return p.parse_args(argv)


def _seconds(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


@torch.inference_mode()
def measure(model, tokenizer, args: argparse.Namespace) -> dict:
    prompts = [f"Question {i}: tell me about the number {i} and why it matters." for i in range(args.batch)]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    model.generate(**batch, max_new_tokens=2, do_sample=False)  # first-call costs out of the timings
    tokens = torch.randint(100, model.config.vocab_size - 1, (8, 1024), generator=torch.Generator().manual_seed(0))
    one = batch["input_ids"][:1, batch["attention_mask"][0].bool()]

    def decode_one_at_a_time():
        out = model(one, use_cache=True)
        for _ in range(args.new_tokens):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)

    return {
        "generate_s": _seconds(lambda: model.generate(**batch, max_new_tokens=args.new_tokens,
                                                      min_new_tokens=args.new_tokens, do_sample=False)),
        "forward_8x1024_s": _seconds(lambda: model(tokens)),
        "decode_batch1_s": _seconds(decode_one_at_a_time),
    }


def main(argv=None) -> None:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    tokenizer.padding_side = "left"
    results = {}
    for dtype in ("float32", "bfloat16"):
        model = load_target_model(args.target, dtype=dtype, device="cpu")
        results[dtype] = measure(model, tokenizer, args)
        del model
    ratios = {k: results["float32"][k] / results["bfloat16"][k] for k in results["float32"]}
    print(json.dumps({"cpu_multiplies_bfloat16": cpu_multiplies_bfloat16(), "threads": args.threads,
                      **results, "bfloat16_speedup": {k: round(v, 2) for k, v in ratios.items()}}, indent=1))


if __name__ == "__main__":
    main()
