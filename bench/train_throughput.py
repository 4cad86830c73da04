"""Training throughput: Draftsmith's EAGLE-3 trainer against speculators 0.9's, same draft, same data.

Both train the same draft shape (default: an 8B-class target, hidden 4096, target vocab 128256,
draft vocab 32000) on the same synthetic packed batches (several documents per batch, ~70% loss
tokens) with the same TTT steps, bf16 autocast, AdamW and gradient clipping, in one process, one
after the other. Printed: tokens/s, the ratio, loss at the start and end (both should fall on the
repeated batches), peak memory, and achieved FLOP/s against the bf16 dense peak.

    python bench/train_throughput.py                 # H200, 8B-class shapes
    python bench/train_throughput.py --tiny          # CPU smoke test, seconds
    python bench/train_throughput.py --profile DIR   # then each trainer's kernels, GPU time by kind of work, where the GPU waits
    python bench/train_throughput.py --speculators-default   # also speculators' own default recipe (Muon)

speculators runs its own ``Eagle3DraftModel.forward`` (torch.compile'd on CUDA, flex attention)
with the eager KL loss (``--loss-implementation eager``; its fused loss trips a Dynamo bug on
torch 2.11). Draftsmith runs its production ``train_step`` as ``train_draft`` sets it up (the TTT steps
compiled as one graph, compiled loss kernels, fused AdamW), with the exact acceptance statistics on every
``--log-every``-th step, as ``train.log_every`` does. FLOPs count the matmuls both trainers must do
(draft forward and backward per TTT step, the fc, attention scores within documents, the
draft-vocab teacher), over all positions; Draftsmith's full-vocabulary argmax on logging steps is
work speculators skips, not counted as useful FLOPs. Batches sit on the GPU for both trainers
(training copies the next batch on a side stream while a step computes).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_idle import idle_report, load_trace  # noqa: E402
from trainer_quality import SPECULATORS_DEFAULT_OPTIMIZER  # noqa: E402  (one definition of speculators' defaults)

from draftsmith.draft.config import Eagle3DraftConfig  # noqa: E402
from draftsmith.draft.model import Eagle3Draft, num_flops_per_token  # noqa: E402
from draftsmith.train import (  # noqa: E402
    PAD_MULTIPLE,
    TTTObjective,
    init_distributed,
    scored_positions,
    train_step,
)

H200_BF16_DENSE = 989.5e12


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="small shapes that run on a CPU in seconds")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per packed batch")
    p.add_argument("--doc-len", type=int, default=2048, help="mean document length inside a batch")
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (compilation)")
    p.add_argument("--batches", type=int, default=4, help="distinct synthetic batches, cycled")
    p.add_argument("--log-every", type=int, default=10,
                   help="Draftsmith computes the exact acceptance statistics every this many steps (train.log_every)")
    p.add_argument("--loss-mask", choices=["answers", "random"], default="answers",
                   help="answers: each document a prompt block without loss, then its answer (chat data); "
                        "random: each token in the loss with probability 0.7")
    p.add_argument("--micro-per-step", type=int, default=1,
                   help="micro-batches per optimizer step over all processes (the global batch); under torchrun "
                        "each of W processes runs micro-per-step / W of them")
    p.add_argument("--only", choices=["draftsmith", "speculators"], default=None)
    p.add_argument("--speculators-default", action="store_true",
                   help="also speculators' default recipe (Muon beside AdamW, TTT decay 1.0, its EAGLE-3 norms), "
                        "as bench/trainer_quality.py's speculators-default; the ratio column stays against the "
                        "matched trainer")
    p.add_argument("--no-compile", action="store_true", help="Draftsmith without torch.compile (draft step, loss kernels)")
    p.add_argument("--attention", choices=["auto", "flex", "sdpa"], default="auto")
    p.add_argument("--peak-flops", type=float, default=H200_BF16_DENSE)
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="after the timed steps, run --profile-steps more under torch.profiler: each trainer's "
                        "kernels (DIR/TRAINER-kernels.txt), its ops by input shape (DIR/TRAINER-ops-by-shape.txt) "
                        "and its GPU time by kind of work, printed")
    p.add_argument("--profile-steps", type=int, default=5)
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate = 64, 2, 1, 32, 128
        args.vocab, args.draft_vocab, args.seq_len, args.doc_len = 512, 128, 256, 64
        args.steps, args.warmup, args.batches = 6, 2, 2
    return args


def document_lengths(tokens: int, mean: int, generator: torch.Generator) -> list[int]:
    """The lengths of the documents packed into one micro-batch of ``tokens``: exponential around
    ``mean``, at least 16, the last cut to fit."""
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(max(16, int(torch.empty(1).exponential_(1 / mean, generator=generator))),
                           tokens - sum(lengths)))
    return lengths


def synthetic(args, device, dtype):
    """Packed batches shared by both trainers, plus the target's embeddings and lm_head."""
    g = torch.Generator().manual_seed(0)
    h, t = args.hidden, args.seq_len
    embed = (torch.randn(args.vocab, h, generator=g) * 0.02).to(dtype)
    lm_head = (torch.randn(args.vocab, h, generator=g) * 0.02).to(dtype)
    rows = torch.sort(torch.randperm(args.vocab, generator=g)[:args.draft_vocab]).values
    final_norm = 1 + 0.1 * torch.randn(h, generator=g)
    batches = []
    for _ in range(args.batches):
        lengths = document_lengths(t, args.doc_len, g)
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        pos = torch.cat([torch.arange(1, n + 1) for n in lengths])
        tokens = torch.randint(0, args.vocab, (t,), generator=g)
        if args.loss_mask == "random":
            loss = torch.rand(t, generator=g) < 0.7
        else:  # a prompt of 10-50% of the document, then the answer: ~70% loss tokens
            loss = torch.cat([torch.arange(n) >= int(n * (0.1 + 0.4 * torch.rand(1, generator=g).item()))
                              for n in lengths])
        aux = torch.randn(t, 3 * h, generator=g)
        prenorm = torch.randn(t, h, generator=g) * 2
        final = prenorm * torch.rsqrt(prenorm.pow(2).mean(-1, keepdim=True) + 1e-5) * final_norm
        valid = torch.zeros(args.ttt_steps, t, dtype=torch.bool)
        starts = torch.cumsum(torch.tensor([0] + lengths), 0)
        for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
            m = b - a
            for j in range(min(args.ttt_steps, m)):
                valid[j, a:a + m - j] = loss[a + j:b]
        batches.append({
            "aux": aux.to(device, dtype), "final": final.to(device, dtype), "prenorm": prenorm.to(device, dtype),
            "valid": valid.to(device), "pos": pos.to(device), "doc": doc.to(device, torch.int32),
            "tokens": tokens.to(device), "loss_mask": loss.to(device), "lengths": lengths,
        })
    return embed, lm_head, rows, final_norm, batches


def draft_config(args) -> Eagle3DraftConfig:
    return Eagle3DraftConfig(
        hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, intermediate_size=args.intermediate, target_vocab_size=args.vocab,
        draft_vocab_size=args.draft_vocab, aux_layer_ids=[1, 2, 3], rms_norm_eps=1e-5,
        max_position_embeddings=max(8192, args.seq_len + 16),
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, norm_before_residual=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def mean_ms(fn, iters: int, device) -> float:
    """Milliseconds per call of ``fn``, the mean of ``iters`` after three warm-ups (compiles among them)."""
    for _ in range(3):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters * 1e3


# What a kernel's name says it does, first match wins: how a step's GPU time splits by kind of work.
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "flex")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "gemv", "aten::mm", "aten::bmm", "aten::addmm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("Inductor's fused kernels", ("triton_poi", "triton_red", "triton_per")),
    ("copies", ("memcpy", "memset", "copy", "cat", "index", "gather")),
)


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in lower for k in keys)), "other")


def profiled(run_step, args, device, name, timed_step_s):
    """``--profile-steps`` more steps under torch.profiler: the kernel table and the ops by input shape
    to files, and the GPU time per step by kind of work (``KERNEL_KINDS``), printed against the timed
    step (a profiled step is longer by the profiler's own cost)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    kernel_device = "CUDA" if cuda else "CPU"  # on the CPU, the ops are the work
    self_ms = (lambda e: e.self_device_time_total / 1e3) if cuda else (lambda e: e.self_cpu_time_total / 1e3)
    sync(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), record_shapes=True) as prof:
        for _ in range(args.profile_steps):
            run_step()
        sync(device)
    profiled_step_s = (time.perf_counter() - start) / args.profile_steps
    averages = prof.key_averages()
    args.profile.mkdir(parents=True, exist_ok=True)
    (args.profile / f"{name}-kernels.txt").write_text(averages.table(sort_by=sort_by, row_limit=60, max_name_column_width=90))
    (args.profile / f"{name}-ops-by-shape.txt").write_text(  # which matmul a kernel's time belongs to
        # more rows than the kernels': each TTT step's skipped rows give Draftsmith's matmuls shapes of their own
        prof.key_averages(group_by_input_shape=True).table(sort_by=sort_by, row_limit=250))
    kinds: dict[str, float] = {}
    for e in averages:
        # Annotated ranges (Inductor's "## Call CompiledFxGraph", the optimizer's step) span kernels
        # counted on their own; torch 2.14 lists them on the device too.
        if e.device_type.name == kernel_device and not e.is_user_annotation:
            kind = kernel_kind(e.key)
            kinds[kind] = kinds.get(kind, 0.0) + self_ms(e)
    kernels_ms = sum(kinds.values()) / args.profile_steps
    print(f"{name}: {timed_step_s * 1e3:.1f} ms a timed step ({profiled_step_s * 1e3:.1f} profiled), {kernels_ms:.1f} ms "
          f"of kernels ({kernels_ms / (timed_step_s * 1e3):.0%} of the timed step): "
          + ", ".join(f"{k} {v / args.profile_steps:.1f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    if cuda:  # the trace (for Perfetto), and where in it the GPU waited (bench/gpu_idle.py)
        trace = args.profile / f"{name}-trace.json.gz"
        prof.export_chrome_trace(str(trace))  # gzipped by the profiler for the .gz name
        idle_ms, report = idle_report(load_trace(trace), args.profile_steps)
        (args.profile / f"{name}-idle.txt").write_text(report)
        print(f"{name}: the GPU idle {idle_ms:.1f} ms a profiled step ({name}-idle.txt says where)")


def timed(run_step, args, device, name):
    losses = []
    for _ in range(args.warmup):
        losses.append(run_step())
    sync(device)
    if torch.distributed.is_initialized():  # every process starts and stops the clock together
        torch.distributed.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        losses.append(run_step())
    sync(device)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    losses = [float(x) for x in losses]
    print(f"{name}: {args.steps} timed steps in {elapsed:.3f} s")  # kept should the profile below fail
    if args.profile is not None:
        profiled(run_step, args, device, name, elapsed / args.steps)
    return elapsed, losses, peak


def bench_draftsmith(args, device, data, ddp):
    embed, lm_head, rows, _, batches = data
    cuda = device.type == "cuda"
    frozen = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_config(args))
    d2t = rows - torch.arange(len(rows))
    t2d = torch.zeros(args.vocab, dtype=torch.bool)
    t2d[rows] = True
    draft.load_target_weights(embed.to(frozen), lm_head, d2t, t2d)
    draft.lm_head.weight.requires_grad_(False)
    draft.lm_head.weight.data = draft.lm_head.weight.data.to(frozen)
    attention = args.attention if args.attention != "auto" else ("flex" if cuda else "sdpa")
    flex_fn = None
    if attention == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        flex_fn = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention
    objective = TTTObjective(draft, lm_head.to(frozen), rows, ttt_steps=args.ttt_steps, ttt_decay=0.8,
                             attention=attention, flex_fn=flex_fn)
    draft.to(device)
    objective.to_device(device, frozen)
    if cuda and not args.no_compile:
        objective.compile_steps()
    model = objective
    if ddp.world > 1:  # as train_draft wraps it under torchrun
        model = torch.nn.parallel.DistributedDataParallel(objective, device_ids=[device.index] if cuda else None,
                                                          broadcast_buffers=False)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.01, fused=cuda)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    decay = torch.tensor([0.8 ** j for j in range(args.ttt_steps)])
    pad = PAD_MULTIPLE if attention == "flex" else 1
    prepared = []
    for b in batches:
        counts = b["valid"].sum(1).cpu().double()
        t = b["aux"].shape[0]
        t_pad = -(-t // pad) * pad
        extra = t_pad - t
        padded = {k: torch.nn.functional.pad(b[k], (0, 0, 0, extra)) for k in ("aux", "final")}
        padded["ids"] = torch.nn.functional.pad(b["tokens"], (0, extra))
        padded["valid"] = torch.nn.functional.pad(b["valid"], (0, extra))
        padded["pos"] = torch.nn.functional.pad(b["pos"], (0, extra))
        padded["doc"] = torch.nn.functional.pad(b["doc"], (0, extra), value=int(b["doc"].max()) + 1)
        padded.update({k: v.to(device) if isinstance(v, torch.Tensor) else v
                       for k, v in scored_positions(padded["valid"]).items()})
        prepared.append((padded, counts))
    # Step s runs the global micro-batches s*N .. s*N+N-1 (cycling over the prepared ones), this
    # process its share of them; the loss is normalised over the whole global batch, as in training.
    n, per = args.micro_per_step, args.micro_per_step // ddp.world
    plans = []
    for s in range(len(prepared)):
        chosen = [(s * n + i) % len(prepared) for i in range(n)]
        counts = sum(prepared[c][1] for c in chosen)
        mine = [prepared[c][0] for c in chosen[ddp.rank * per:(ddp.rank + 1) * per]]
        plans.append((mine, (decay / counts * ddp.world).float().to(device)))
    state = {"i": 0}

    def run_step():
        i = state["i"]
        micro, weights = plans[i % len(plans)]
        state["i"] += 1
        exact = i == 0 or (i + 1) % args.log_every == 0  # the first warms the exact path up
        loss, _, _ = train_step(model, optimizer, trainable, micro, per, weights, max_grad_norm=1.0,
                                autocast=autocast, world=ddp.world, exact=exact)
        return loss.detach()

    result = timed(run_step, args, device, "draftsmith")
    model = objective = draft = optimizer = prepared = plans = None  # frees the memory before the next run
    return result


def bench_speculators(args, device, data, recipe: str = "matched"):
    """speculators' draft and loss; ``recipe`` matched (AdamW, TTT decay 0.8, as Draftsmith here) or
    default (bench/trainer_quality.py's speculators-default: Muon beside AdamW, TTT decay 1.0, and
    for EAGLE-3 the norms before fc and on the output)."""
    from types import SimpleNamespace

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.optimizers import build_optimizers
    from transformers import LlamaConfig

    embed, lm_head, rows, final_norm, batches = data
    cuda = device.type == "cuda"
    layer = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                        num_hidden_layers=1, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                        head_dim=args.head_dim, rms_norm_eps=1e-5, max_position_embeddings=max(8192, args.seq_len + 16),
                        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    layer._attn_implementation = "simple_flex_attention" if cuda else "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=args.draft_vocab, norm_before_residual=True,
        norm_before_fc=recipe == "default", norm_output=recipe == "default",
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=args.ttt_steps)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])))
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    t2d = torch.zeros(args.vocab, dtype=torch.bool)
    t2d[rows] = True
    model.load_vocab_mappings(t2d, rows - torch.arange(len(rows)))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed.float())
        model.lm_head.weight.copy_(lm_head[rows].float())
        model.verifier_lm_head.weight.copy_(lm_head[rows].float())
        model.verifier_norm.weight.copy_(final_norm)
    model.to(device)
    model.train()
    if recipe == "default":
        optimizers = build_optimizers(model, SimpleNamespace(**SPECULATORS_DEFAULT_OPTIMIZER, lr=1e-4, muon_lr=1e-4))
        decay = 1.0
    else:
        optimizers, decay = [torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)], 0.8
    loss_config = resolve_loss_config("kl_div", "eager")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    prepared = [{
        "hidden_states": b["aux"][None], "input_ids": b["tokens"][None],
        "document_ids": b["doc"].long()[None], "loss_mask": b["loss_mask"][None], "position_ids": b["pos"][None],
        "verifier_last_hidden_states": b["prenorm"][None],
    } for b in batches]
    state = {"i": 0}

    def run_step():  # speculators/train/trainer.py train_epoch, minus logging
        batch = prepared[state["i"] % len(prepared)]
        state["i"] += 1
        with autocast:
            _, loss, _ = model(**batch, ttt_steps=args.ttt_steps, ttt_step_loss_decay=decay, loss_config=loss_config)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for optimizer in optimizers:
            optimizer.step()
        return loss.detach()

    result = timed(run_step, args, device, "speculators" if recipe == "matched" else "speculators-default")
    model = optimizers = prepared = None  # frees the memory before the next run
    return result


def useful_flops_per_token(args, batches) -> float:
    config = draft_config(args)
    dense = num_flops_per_token(config, args.ttt_steps)
    lengths = [n for b in batches for n in b["lengths"]]
    mean_context = sum(n * (n + 1) / 2 for n in lengths) / sum(lengths)  # keys a query sees at step 0
    q = config.num_attention_heads * config.head_dim
    # QK^T and PV, forward (2 matmuls x 2 flops) + backward (x2), per TTT step
    attention = 3 * 4 * q * mean_context * args.ttt_steps
    teacher = 2 * config.hidden_size * config.draft_vocab_size
    return dense + attention + teacher


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    ddp = init_distributed(cuda)  # torchrun: one process per GPU
    if args.micro_per_step % ddp.world:
        raise SystemExit(f"--micro-per-step {args.micro_per_step} does not split over {ddp.world} processes")
    if args.profile is not None and ddp.world > 1:
        raise SystemExit("--profile profiles one process: run it without torchrun")
    device = torch.device(f"cuda:{ddp.local_rank}" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    data = synthetic(args, device, dtype)
    flops = useful_flops_per_token(args, data[4])
    tokens = args.seq_len * args.steps * args.micro_per_step
    say = print if ddp.main else (lambda *a, **k: None)
    say(f"device {device} ({torch.cuda.get_device_name() if cuda else 'cpu'}) x {ddp.world} processes, torch "
        f"{torch.__version__}; hidden {args.hidden}, heads {args.heads}/{args.kv_heads}x{args.head_dim}, "
        f"intermediate {args.intermediate}, vocab {args.vocab} -> draft {args.draft_vocab}; {args.seq_len} "
        f"tokens/micro-batch, {args.micro_per_step} per step, mean document {args.doc_len}, loss mask "
        f"{args.loss_mask}, TTT steps {args.ttt_steps}, {args.steps} timed steps after {args.warmup}")
    results = {}
    trainers = [("draftsmith", bench_draftsmith)]
    if ddp.world == 1 and args.micro_per_step == 1:  # speculators' trainer: one micro-batch, one process
        trainers.append(("speculators", lambda a, d, x, _: bench_speculators(a, d, x)))
        if args.speculators_default:
            trainers.append(("speculators-default", lambda a, d, x, _: bench_speculators(a, d, x, "default")))
    for name, fn in trainers:
        if args.only and args.only != name.split("-")[0]:
            continue
        try:
            results[name] = fn(args, device, data, ddp)
        except Exception as e:  # report the other trainer even if one fails
            say(f"{name}: failed: {type(e).__name__}: {e}")
            if ddp.world > 1:
                raise
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    say()
    header = f"{'trainer':<19} {'GPUs':>4} {'tokens/s':>12} {'per GPU':>10} {'ratio':>7} {'loss first->last':>20} " \
             f"{'peak GiB':>9} {'TFLOP/s':>9} {'MFU':>6}"
    say(header)
    say("-" * len(header))
    base = results.get("speculators", (None,))[0]
    for name, (elapsed, losses, peak) in results.items():
        rate = tokens / elapsed
        ratio = (base / elapsed) if base else math.nan
        achieved = rate * flops / ddp.world
        say(f"{name:<19} {ddp.world:>4} {rate:>12,.0f} {rate / ddp.world:>10,.0f} {ratio:>7.2f} {losses[0]:>9.4f} -> "
            f"{losses[-1]:<8.4f} {peak:>9.1f} {achieved / 1e12:>9.1f} {achieved / args.peak_flops:>6.1%}")
    if "draftsmith" in results and "speculators-default" in results:
        say(f"draftsmith / speculators' default recipe: "
            f"{results['speculators-default'][0] / results['draftsmith'][0]:.2f}x the tokens/s")
    say(f"\nuseful FLOPs/token {flops / 1e9:.2f} GFLOP (draft fwd+bwd x {args.ttt_steps} TTT steps, fc, attention "
        f"within documents, draft-vocab teacher, over every position); ratio = speculators time / Draftsmith time; "
        f"TFLOP/s and MFU per GPU, against {args.peak_flops / 1e12:.0f} TFLOP/s")
    if ddp.owns_group:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
