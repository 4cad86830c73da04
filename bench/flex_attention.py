"""The draft's attention alone: flex attention's forward and backward on one packed training
micro-batch, for each of several kernel options, side by side, and what Inductor's max-autotune picks.

Training runs the draft's causal attention within documents through flex attention (compiled, the
log-sum-exp returned for the merge with the same-position keys of later TTT steps, so the backward
takes a gradient through it too); at TTT 3 it is about 8.5 ms of an 80-ms step on an H200
(`bench/train_throughput.py --profile`). This measures that attention alone, with the same block
mask (``TTTAttention``) on documents of the same length distribution as the training bench, for the
kernel options Inductor picks by default and for others (``FlexKernelOptions``: block sizes,
warps, stages, TMA; ``CANDIDATES``), so that a faster choice shows with its ratio.

    python bench/flex_attention.py                  # H200, the 8B-class draft's shapes
    python bench/flex_attention.py --try max-autotune   # Inductor's own search instead
    python bench/flex_attention.py --tiny           # CPU smoke check
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train_throughput import document_lengths, mean_ms  # noqa: E402  (the training bench's documents)

from draftsmith.train import PAD_MULTIPLE  # noqa: E402
from draftsmith.train.attention import TTTAttention  # noqa: E402

# Kernel options tried beside the default (Inductor's for bf16, head_dim 128 on sm90: forward
# 128x64 blocks, 3 stages, 8 warps; backward 64/128/128/64, 3 stages, 8 warps).
CANDIDATES = {
    "fwd-128x128": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 3, "fwd_num_warps": 8},
    "fwd-4-stages": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 4, "fwd_num_warps": 8},
    "tma": {"USE_TMA": True},
    "bwd-64-4-warps": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                       "bwd_num_stages": 3, "bwd_num_warps": 4},
    "bwd-32-128": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                   "bwd_num_stages": 3, "bwd_num_warps": 4},
    "bwd-2-stages": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                     "bwd_num_stages": 2, "bwd_num_warps": 8},
}
AUTOTUNE = "max-autotune"  # Inductor's own search over its list of configs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU, the default options only")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--doc-len", type=int, default=2048, help="mean document length (exponential, as the training bench)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--try", dest="tries", nargs="*", choices=[*CANDIDATES, AUTOTUNE], default=list(CANDIDATES),
                   help="options to time beside the default (CANDIDATES; max-autotune: mode='max-autotune-no-cudagraphs')")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_len, args.heads, args.kv_heads, args.head_dim, args.doc_len, args.iters = 256, 4, 2, 32, 64, 2
    return args


def documents(args) -> tuple[torch.Tensor, list[int]]:
    """Document ids of one packed micro-batch, padded to the block size with a document of its own,
    and the documents' lengths."""
    lengths = document_lengths(args.seq_len, args.doc_len, torch.Generator().manual_seed(0))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    extra = -(-args.seq_len // PAD_MULTIPLE) * PAD_MULTIPLE - args.seq_len
    return torch.nn.functional.pad(doc, (0, extra), value=len(lengths)).int(), lengths


def run(fn, block_mask, q, k, v, grads, iters, device) -> tuple[float, float]:
    """(forward ms, forward + backward ms), each the mean of ``iters`` after three warm-ups; without
    ``grads`` (the CPU: flex has no backward there) the forward alone."""
    from torch.nn.attention.flex_attention import AuxRequest

    scale = q.shape[-1] ** -0.5

    def forward():
        out, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    def both():
        out, lse = forward()
        torch.autograd.backward((out, lse), grads)

    return mean_ms(forward, iters, device), mean_ms(both, iters, device) if grads is not None else float("nan")


def main(argv=None) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    doc, lengths = documents(args)
    t = doc.shape[0]
    block_mask = TTTAttention(doc.to(device), "flex").block_mask
    g = torch.Generator(device).manual_seed(0)

    def tensor(heads, grad=True):
        x = torch.randn(1, heads, t, args.head_dim, generator=g, device=device, dtype=dtype)
        return x.requires_grad_(grad)

    q, k, v = tensor(args.heads, cuda), tensor(args.kv_heads, cuda), tensor(args.kv_heads, cuda)
    grads = None
    if cuda:  # into the output and its log-sum-exp, as the merge with later TTT steps' keys sends them
        grads = (tensor(args.heads, False), torch.randn(1, args.heads, t, generator=g, device=device))
    # forward FLOPs: QK^T and PV over each document's causal pairs (the padding row attends to itself)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    fwd_flops = 4 * pairs * args.head_dim * args.heads
    print(f"device {device}, torch {torch.__version__}; {t} tokens in {len(lengths)} documents (mean {args.doc_len}), "
          f"heads {args.heads}/{args.kv_heads} x {args.head_dim}, {dtype}; block sparsity "
          f"{block_mask.sparsity():.1f}%; forward {fwd_flops / 1e9:.0f} GFLOP, backward counted as 2.5x")

    configs = {"default": {}} | ({name: CANDIDATES[name] for name in args.tries if name in CANDIDATES} if cuda else {})
    rows = {}
    for name, options in configs.items():
        def fn(*a, _options=options, **kw):
            return flex_attention(*a, kernel_options=_options or None, **kw)

        if cuda:  # as training compiles it
            fn = torch.compile(fn, dynamic=False)
        try:
            rows[name] = run(fn, block_mask, q, k, v, grads, args.iters, device)
        except Exception as error:  # an option the kernel cannot take on this GPU: say so, go on
            print(f"{name}: failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
        torch._dynamo.reset()
    if AUTOTUNE in args.tries and cuda:
        fn = torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")
        start = time.perf_counter()
        rows[AUTOTUNE] = run(fn, block_mask, q, k, v, grads, args.iters, device)
        print(f"{AUTOTUNE}: compiled and tuned in {time.perf_counter() - start:.0f} s")

    base_both = rows.get("default", (float("nan"),) * 2)[1]
    print(f"\n{'options':<40} {'fwd ms':>8} {'bwd ms':>8} {'fwd+bwd':>8} {'vs default':>10} {'fwd TFLOP/s':>12} {'bwd TFLOP/s':>12}")
    for name, (fwd, both) in rows.items():
        bwd = both - fwd
        print(f"{name:<40} {fwd:>8.3f} {bwd:>8.3f} {both:>8.3f} {base_both / both:>9.2f}x "
              f"{fwd_flops / fwd / 1e9:>12.0f} {2.5 * fwd_flops / bwd / 1e9:>12.0f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": {n: {"fwd_ms": f, "fwd_bwd_ms": b} for n, (f, b) in rows.items()},
                                         "options": {n: configs.get(n, AUTOTUNE) for n in rows}}, indent=1))


if __name__ == "__main__":
    main()
