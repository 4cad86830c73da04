"""The loss's row kernels alone, against the bytes they must move: the teacher's per-row values, the
loss with the draft's logsumexp and argmax, and the loss's gradient, as training compiles them
(``LossKernels.compiled``), at one TTT step's shapes of the training bench.

Each kernel must read its logits at least once (the loss: the draft's rows and the teacher's rows
they are scored against; the gradient: both, and it writes the gradient), so bytes / time is the
bandwidth it reaches, printed against ``--peak-gbs`` (the H200's HBM3e: 4,800 GB/s). A kernel far
below it reads its rows more than once; ``TORCH_LOGS=output_code`` beside the command shows
Inductor's code for each.

    python bench/loss_kernels.py                 # H200, 32,000-token draft vocabulary
    python bench/loss_kernels.py --tiny          # CPU smoke check (the eager kernels)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train_throughput import mean_ms  # noqa: E402

from draftsmith.train.objective import LossKernels  # noqa: E402
from draftsmith.train.settings import TrainSettings  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--rows", type=int, default=7000, help="scored rows of one TTT step (the training bench: 5,500-7,000)")
    p.add_argument("--teacher-rows", type=int, default=7000)
    p.add_argument("--vocab", type=int, default=32000, help="draft vocabulary")
    p.add_argument("--hard", type=float, default=TrainSettings().hard_label_weight, help="train.hard_label_weight")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--peak-gbs", type=float, default=4800.0)
    args = p.parse_args(argv)
    if args.tiny:
        args.rows, args.teacher_rows, args.vocab, args.iters = 64, 64, 512, 2
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device).manual_seed(0)
    n, n0, v = args.rows, args.teacher_rows, args.vocab
    z = torch.randn(n, v, generator=g, device=device, dtype=dtype)
    tz = torch.randn(n0, v, generator=g, device=device, dtype=dtype)
    teach = torch.randint(0, n0, (n,), generator=g, device=device)
    kernels = LossKernels.compiled() if cuda else LossKernels()
    tlse, negent, _, top = kernels.rows(kernels.teacher, n0, tz)
    _, lse, _ = kernels.rows(kernels.loss, n, z, tz, tlse, negent, teach, top, args.hard, rowwise=(0, 4))
    grad = torch.ones(n, device=device)
    logits = z.element_size() * v  # bytes of one row of logits
    rows = {
        "teacher (per row: logsumexp, entropy, top)": (
            lambda: kernels.rows(kernels.teacher, n0, tz), n0 * logits),
        "loss (draft rows against their teacher's)": (
            lambda: kernels.rows(kernels.loss, n, z, tz, tlse, negent, teach, top, args.hard, rowwise=(0, 4)),
            2 * n * logits),
        "loss gradient (writes the gradient)": (
            lambda: kernels.rows(kernels.loss_grad, n, z, lse, tz, tlse, teach, top, args.hard, grad,
                                 rowwise=(0, 1, 4, 7)),
            3 * n * logits),
    }
    print(f"device {device}, torch {torch.__version__}; {n} rows against {n0} teacher rows, vocabulary {v}, "
          f"{dtype}, hard_label_weight {args.hard}")
    print(f"{'kernel':<45} {'ms':>8} {'GB moved at least':>18} {'GB/s':>8} {'of peak':>8}")
    for name, (fn, nbytes) in rows.items():
        ms = mean_ms(fn, args.iters, device)
        rate = nbytes / ms / 1e6
        print(f"{name:<45} {ms:>8.3f} {nbytes / 1e9:>18.3f} {rate:>8.0f} {rate / args.peak_gbs:>8.0%}")


if __name__ == "__main__":
    main()
