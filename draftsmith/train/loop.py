"""The training run: build the draft and its objective, resume or start, then the step loop.

``train_draft`` is what every training process runs. ``_prepare`` builds everything the loop
needs (model, plan, optimizer, resume point); ``_loop`` is the step loop itself, readable on one
screen: set the learning rate, run a step on the prefetched micro-batches, log, checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from draftsmith.draft.config import Eagle3DraftConfig
from draftsmith.draft.model import Eagle3Draft, draft_rows
from draftsmith.draft.speculators_format import save_speculators
from draftsmith.errors import TrainingError, out_of_memory_as
from draftsmith.extract.hidden_states import HiddenStateIndex
from draftsmith.fits import StepShape, attention_span, check_step_fits, check_warmup, process_memory
from draftsmith.io import atomic_write_json, check_not_superseded, lock_beside, publishing, read_json
from draftsmith.train.batches import (
    BatchFeed,
    ShardMeta,
    ShardVerifier,
    StateSource,
    Step,
    batch_positions,
    plan_run,
    plan_summary,
    step_group,
)
from draftsmith.train.checkpoints import (
    CHECKPOINT_FORMAT,
    checkpoint_key,
    clear_stale_state,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from draftsmith.train.distributed import Dist, init_distributed, use_cuda
from draftsmith.train.metrics import RunLog, summarize
from draftsmith.train.objective import TTTObjective
from draftsmith.train.settings import TrainSettings

log = logging.getLogger(__name__)

# What to change when a step runs out of memory: the batch, and on the CPU the dense attention
# whose scores grow with its square (draftsmith.fits estimates both at preflight).
_OOM_FIX = {
    "sdpa": "lower train.batch_tokens (the dense attention's memory grows with its square; keep it >= "
            "data.max_seq_len, lowering that too if needed), or train on a GPU (device: cuda: flex attention)",
    "flex": "lower train.batch_tokens (keep it >= data.max_seq_len, lowering that too if needed), or lower "
            "vocab.draft_vocab_size (each TTT step keeps its logits)",
}
DRAFT_SUMMARY = "training_summary.json"  # beside the draft: how it was trained


def train_draft(index_path: str | Path | None, mapping_path: str | Path, target_json: str | Path,
                out_dir: str | Path, work_dir: str | Path, settings: TrainSettings = TrainSettings(),
                source: StateSource | None = None) -> dict:
    """Train an EAGLE-3 draft and write it to ``out_dir`` in the speculators format; returns a summary.

    Resumable: checkpoints under ``work_dir`` (never the rule's output) are picked up when they
    were made by the same code from the same data and settings, and the run that wrote them has not
    delivered its draft (``run_training`` marks that); the log says why a checkpoint is or is not
    resumed. Under torchrun every process calls this function. With a ``source`` (online training)
    the shards arrive while training runs and ``index_path`` is None.
    """
    settings.check()
    mapping_path, out_dir, work_dir = map(Path, (mapping_path, out_dir, work_dir))
    index_path = Path(index_path) if index_path is not None else None
    ddp = init_distributed(use_cuda(settings))
    try:
        return _train(index_path, mapping_path, Path(target_json), out_dir, work_dir, settings, ddp, source)
    finally:
        if ddp.owns_group:
            dist.destroy_process_group()


@dataclass
class _Run:
    """What the step loop works with (``_prepare`` builds it)."""

    settings: TrainSettings
    ddp: Dist
    device: torch.device
    dtype: torch.dtype  # autocast and batch dtype: bfloat16 or float32
    attention: str
    index: HiddenStateIndex
    config: Eagle3DraftConfig
    draft: Eagle3Draft
    model: nn.Module  # the objective, wrapped in DDP under torchrun
    trainable: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    metas: list[ShardMeta]
    steps: list[Step]
    key: dict[str, str]  # what checkpoints are keyed by (checkpoint_key)
    start: int  # the step resumed at
    resume: str  # why a checkpoint is or is not resumed, for the log and the summary
    checkpoint: Path | None
    checkpoint_state: dict | None
    source: StateSource | None


def _train(index_path: Path | None, mapping_path: Path, target_json: Path, out_dir: Path, work_dir: Path,
           settings: TrainSettings, ddp: Dist, source: StateSource | None) -> dict:
    run = _prepare(index_path, mapping_path, target_json, work_dir, settings, ddp, source)
    if source is not None:
        source.start(run.steps, run.start, ddp.main)
    feed = BatchFeed(run.index, run.metas, run.steps[run.start:], settings, rank=ddp.rank, device=run.device,
                     attention=run.attention, dtype=run.dtype, positions=batch_positions(run.steps, run.device),
                     source=source)
    verifier = None
    if settings.verify_shards and source is None:  # online shards are checked as they arrive
        verifier = ShardVerifier(run.index, [s for i, s in enumerate(run.index.shards) if i % ddp.world == ddp.rank])
        verifier.start()
    run_log = RunLog(work_dir, run.start, [s.tokens for s in run.steps], main=ddp.main, progress=settings.progress)
    started = time.perf_counter()
    try:
        tokens, last_log, last_good = _loop(run, feed, verifier, run_log, work_dir)
        if verifier is not None:  # a draft is never written from data that fails its checksums
            _wait_for_verification(verifier, ddp, run.device, index_path)
    finally:
        feed.close()
        run_log.close()

    result = {
        "steps": len(run.steps), "tokens": tokens, "resumed_from_step": run.start, "resume": run.resume,
        "seconds": round(time.perf_counter() - started, 3), "world_size": ddp.world,
        "final": last_log or (run.checkpoint_state or {}).get("metrics", {}),
        "draft_vocab_size": run.config.draft_vocab_size, "aux_layer_ids": run.config.aux_layer_ids,
        "checkpoint": last_good, "settings": dataclasses.asdict(settings),
    }
    if ddp.main:
        # the last checkpoint is kept: a rerun refused while this process ran on resumes from it
        save_dtype = "bfloat16" if run.dtype == torch.bfloat16 else "float32"
        with publishing(lock_beside(work_dir), f"training in {work_dir}", TrainingError,
                        [out_dir / name for name in ("config.json", "model.safetensors", DRAFT_SUMMARY)]):
            save_speculators(run.draft, out_dir, dtype=save_dtype, extra_files={DRAFT_SUMMARY: result})
        atomic_write_json(work_dir / "summary.json", result)
        log.info("draft written to %s: %d steps, %d tokens, step-0 accuracy %s, simulated tau %s", out_dir,
                 len(run.steps), tokens, result["final"].get("acc", ["?"])[0], result["final"].get("tau"))
    if ddp.world > 1:
        dist.barrier()
    return result


def _loop(run: _Run, feed: BatchFeed, verifier: ShardVerifier | None, run_log: RunLog,
          work_dir: Path) -> tuple[int, dict, str | None]:
    """The step loop, from the resume point to the last step; returns the tokens trained on (all
    steps), the last logged metrics and the last checkpoint written."""
    settings, ddp, device, steps, total = run.settings, run.ddp, run.device, run.steps, len(run.steps)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if run.dtype == torch.bfloat16
                else contextlib.nullcontext())
    decay = torch.tensor([settings.ttt_decay ** j for j in range(settings.ttt_steps)], dtype=torch.float64)
    acc_stats = torch.zeros(settings.ttt_steps, 6, device=device, dtype=torch.float64)
    bad_step = torch.full((), -1, device=device, dtype=torch.long)  # the first step with a NaN loss
    last_good = str(run.checkpoint) if run.checkpoint is not None else None
    tokens_done, last_log = sum(s.tokens for s in steps[:run.start]), {}
    window_tokens, window_start = 0, time.perf_counter()

    upcoming = feed.fetch() if run.start < total else []
    run.model.train()
    for s in range(run.start, total):
        step, done = steps[s], s + 1
        checkpoint_now = done % settings.checkpoint_every == 0 or done == total
        log_now = done % settings.log_every == 0 or checkpoint_now
        lr = _lr_at(s, settings, total)
        for g in run.optimizer.param_groups:
            g["lr"] = lr
        # loss = sum_j decay^j * (KL summed over the global batch's step-j positions) / their number;
        # DDP averages gradients over ranks, hence the factor world.
        weights = (decay / torch.from_numpy(np.maximum(step.counts, 1)) * ddp.world).to(torch.float32)
        weights = weights.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else weights
        micro = feed.ready(upcoming)
        # the exact (whole-vocabulary) acceptance statistics only on the steps that log them
        with out_of_memory_as(TrainingError, f"training step {done} of {total}",
                              where=f"micro-batches of up to train.batch_tokens={settings.batch_tokens} positions "
                                    f"on {device} ({run.attention} attention, ttt_steps {settings.ttt_steps})",
                              fix=_OOM_FIX[run.attention]):
            step_loss, stats, grad_norm = train_step(run.model, run.optimizer, run.trainable, micro,
                                                     settings.grad_accum_steps, weights,
                                                     max_grad_norm=settings.max_grad_norm, autocast=autocast,
                                                     world=ddp.world, exact=log_now)
        del micro
        if run.source is not None:  # before the next fetch: it may wait for room this frees
            run.source.step_done(done)
        upcoming = feed.fetch() if done < total else []  # copies while this step computes
        acc_stats += stats
        bad = ~torch.isfinite(step_loss) | ~torch.isfinite(grad_norm)
        bad_step = torch.where((bad_step < 0) & bad, torch.full_like(bad_step, s + 1), bad_step)
        tokens_done += step.tokens
        window_tokens += step.tokens
        run_log.advance(step.tokens)
        if log_now:
            summary = _logged_stats(acc_stats, bad_step, ddp, verifier, work_dir, last_good)
            elapsed = time.perf_counter() - window_start
            last_log = {"step": done, "epoch": step.epoch, "lr": lr, "tokens": tokens_done,
                        "tokens_per_s": window_tokens / max(elapsed, 1e-9), "grad_norm": float(grad_norm),
                        **summary}
            run_log.write(last_log)
            acc_stats.zero_()
            window_tokens, window_start = 0, time.perf_counter()
        if checkpoint_now:
            last_good = _save(run, work_dir, step, done, tokens_done, last_log) or last_good
            if ddp.main:  # a rerun was refused: stop here, not at the end, and free the devices for it
                check_not_superseded(lock_beside(work_dir), f"training in {work_dir}", TrainingError)
    return tokens_done, last_log, last_good


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, trainable: list[nn.Parameter], micro_batches,
               num_micro: int, weights: torch.Tensor, *, max_grad_norm: float, autocast, world: int = 1,
               exact: bool = False):
    """One optimizer step over ``num_micro`` micro-batches (device dicts); returns device tensors
    (summed loss, summed stats [K, 6] in float64, gradient norm) without synchronising. ``exact``
    adds the whole-vocabulary acceptance statistics (``TTTObjective.forward``)."""
    optimizer.zero_grad(set_to_none=True)
    step_loss, step_stats = None, None
    for a, batch in enumerate(micro_batches):
        last = a == num_micro - 1
        ctx = model.no_sync() if (world > 1 and not last) else contextlib.nullcontext()
        with ctx:
            with autocast:
                loss, stats = model(batch, weights, exact=exact)
            loss.backward()
        step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
        step_stats = stats.double() if step_stats is None else step_stats + stats.double()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
    optimizer.step()
    return step_loss, step_stats, grad_norm


def _lr_at(step: int, settings: TrainSettings, total: int) -> float:
    """Linear warm-up, then linear decay to zero at the last step (speculators' default schedule)."""
    warmup = settings.warmup_for(total)
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    return settings.lr * max(0.0, (total - step) / max(total - warmup, 1))


def _logged_stats(acc_stats: torch.Tensor, bad_step: torch.Tensor, ddp: Dist, verifier: ShardVerifier | None,
                  work_dir: Path, last_good: str | None) -> dict:
    """The statistics since the last log, summed over the processes (``summarize``); stops the run
    at a NaN loss on any process or a corrupt shard."""
    reduced = acc_stats.clone()
    flag = bad_step.clone().double()[None]
    if ddp.world > 1:
        dist.all_reduce(reduced)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() >= 0:
        raise TrainingError(
            f"the loss became NaN or infinite at step {int(flag.item())}",
            where=f"{work_dir} (last good checkpoint: {last_good or 'none'})",
            fix="lower train.lr or raise train.warmup_steps; check the hidden states for "
                "inf values (fp16 targets overflow); the run resumes from the last good checkpoint")
    if verifier is not None and verifier.error is not None:
        raise verifier.error
    return summarize(reduced.tolist())


def _save(run: _Run, work_dir: Path, step: Step, done: int, tokens_done: int, last_log: dict) -> str | None:
    """Checkpoint after step ``done`` (the main process writes it); returns its path there."""
    path = None
    if run.ddp.main:
        fingerprint = hashlib.sha256(json.dumps(run.key, sort_keys=True).encode()).hexdigest()
        state = {"format": CHECKPOINT_FORMAT, "fingerprint": fingerprint, "key": run.key, "step": done,
                 "epoch": step.epoch, "step_in_epoch": step.index + 1, "total_steps": len(run.steps),
                 "tokens": tokens_done, "world_size": run.ddp.world, "settings": dataclasses.asdict(run.settings),
                 "metrics": last_log}
        path = str(save_checkpoint(work_dir / "checkpoints", done, run.draft, run.optimizer, state,
                                   run.settings.keep_checkpoints))
    if run.ddp.world > 1:
        dist.barrier()
    return path


def _wait_for_verification(verifier: ShardVerifier, ddp: Dist, device: torch.device, index_path: Path) -> None:
    """Wait for this process's checksums, and stop every process when any of them found a corrupt shard."""
    verifier.join()
    failed = torch.tensor([1.0 if verifier.error is not None else 0.0], device=device)
    if ddp.world > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if verifier.error is not None:
        raise verifier.error
    if failed.item():
        raise TrainingError("another training process found a corrupt hidden-state shard",
                            where=str(index_path), fix="see that process's error in the log")


# ----------------------------------------------------------------------------------------------
# Building the run


def _prepare(index_path: Path | None, mapping_path: Path, target_json: Path, work_dir: Path,
             settings: TrainSettings, ddp: Dist, source: StateSource | None) -> _Run:
    """The draft and its objective, the plan of every step, the optimizer, and the resume point
    (a matching checkpoint loaded, or the stale state of an earlier run cleared)."""
    device = torch.device(f"cuda:{ddp.local_rank}") if use_cuda(settings) else torch.device("cpu")
    dtype, attention, compile_ = _resolve(settings, device)
    index = HiddenStateIndex.load(index_path) if source is None else source.index
    where = index_path or index.root
    target = read_json(target_json)
    config, d2t, t2d = _draft_config(index, target, where, mapping_path, target_json, settings)
    metas = None if source is None else source.metas(settings)
    metas, steps = plan_run(index, settings, ddp.world, where, metas)
    _check_plan(steps, metas, settings, index, config, device, attention, where)
    draft, objective = _build(config, d2t, t2d, target_json, settings, device, dtype, attention, compile_)

    states = None if source is None else source.fingerprint
    key = checkpoint_key(settings, index_path, mapping_path, target, step_group(settings, ddp.world), states)
    checkpoint, checkpoint_state, resume = find_checkpoint(work_dir, key)
    log.info("%s", resume)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay,
                                  fused=device.type == "cuda")
    start = 0
    if checkpoint is not None:
        load_checkpoint(checkpoint, draft, optimizer)
        start = int(checkpoint_state["step"])
        log.info("resuming at step %d of %d", start, len(steps))
    if ddp.world > 1:
        dist.barrier()  # every rank has read the checkpoint pointer before rank 0 clears stale state
    if checkpoint is None and ddp.main:
        clear_stale_state(work_dir)
    if ddp.world > 1:
        dist.barrier()

    model: nn.Module = objective
    if ddp.world > 1:
        model = nn.parallel.DistributedDataParallel(
            objective, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    return _Run(settings, ddp, device, dtype, attention, index, config, draft, model, trainable, optimizer,
                metas, steps, key, start, resume, checkpoint, checkpoint_state, source)


def _resolve(settings: TrainSettings, device: torch.device) -> tuple[torch.dtype, str, bool]:
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "bfloat16": torch.bfloat16, "float32": torch.float32}[settings.dtype]
    attention = settings.attention if settings.attention != "auto" else ("flex" if device.type == "cuda" else "sdpa")
    compile_ = settings.compile in ("true", True) or (settings.compile == "auto" and device.type == "cuda")
    return dtype, attention, compile_


def _draft_config(index: HiddenStateIndex, target: dict, index_path: Path, mapping_path: Path, target_json: Path,
                  settings: TrainSettings) -> tuple[Eagle3DraftConfig, torch.Tensor, torch.Tensor]:
    """The draft's config and the vocabulary mapping (d2t, t2d), once the inputs agree with each other."""
    mapping = load_file(str(mapping_path))
    d2t, t2d = mapping["d2t"].long(), mapping["t2d"].bool()
    _check_inputs(index, target, t2d, index_path, target_json, mapping_path)
    config = Eagle3DraftConfig.from_target(
        target, draft_vocab_size=int(d2t.shape[0]), num_layers=settings.num_layers, variant=settings.variant,
        norm_before_residual=settings.norm_before_residual, speculative_tokens=settings.ttt_steps,
        aux_layer_ids=index.aux_layer_ids)
    return config, d2t, t2d


def _check_plan(steps: list[Step], metas: list[ShardMeta], settings: TrainSettings, index: HiddenStateIndex,
                config: Eagle3DraftConfig, device: torch.device, attention: str, index_path: Path) -> None:
    """Refuse a run whose plan cannot train, before any weight is read: the step count and the batches
    depend on the store, so this is the first place they are known (check_setup, before the store
    exists, checks full batches of train.batch_tokens against memory, an upper bound)."""
    if settings.warmup_steps is not None:  # the automatic one fits any run
        check_warmup(settings.warmup_steps, len(steps), plan_summary(steps, settings, index.num_tokens))
    positions = batch_positions(steps, device)
    longest = max((int(meta.lengths.max()) for meta in metas if len(meta.lengths)), default=positions)
    span = attention_span(attention, longest) if device.type == "cpu" else None
    shape = StepShape(settings.ttt_steps, config.num_attention_heads, config.num_layers,
                      config.draft_vocab_size, attention, span)
    basis = (f"the largest micro-batch this run packs from the {index.num_tokens:,}-token store with "
             f"train.batch_tokens={settings.batch_tokens}" + (", padded for the GPU" if device.type == "cuda" else ""))
    check_step_fits(positions, basis, shape, process_memory(device),
                    where=f"config keys train.batch_tokens, device ({device.type}); the store {index_path}")


def _build(config: Eagle3DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor, target_json: Path,
           settings: TrainSettings, device: torch.device, dtype: torch.dtype, attention: str,
           compile_: bool) -> tuple[Eagle3Draft, TTTObjective]:
    """The draft (seeded init, the target's embedding and lm_head rows frozen in) and its objective, on ``device``."""
    from draftsmith.engines.weights import load_embedding_and_head

    torch.manual_seed(settings.seed)
    draft = Eagle3Draft(config)
    embed, head = load_embedding_and_head(target_json)
    draft.load_target_weights(embed.to(dtype), head, d2t, t2d)
    draft.lm_head.weight.requires_grad_(settings.train_lm_head)
    if not settings.train_lm_head:
        draft.lm_head.weight.data = draft.lm_head.weight.data.to(dtype)
    rows = draft_rows(d2t, t2d, config.target_vocab_size)
    flex_fn = None
    if attention == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        flex_fn = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
    objective = TTTObjective(draft, head.to(dtype), rows, ttt_steps=settings.ttt_steps,
                             ttt_decay=settings.ttt_decay, attention=attention,
                             hard_label_weight=settings.hard_label_weight, feature_noise=settings.feature_noise,
                             logit_transform=read_json(target_json).get("logit_transform"), flex_fn=flex_fn)
    del embed, head
    draft.to(device)
    objective.to_device(device, dtype)
    if compile_:
        objective.compile_steps()
    return draft, objective


def _check_inputs(index: HiddenStateIndex, target: dict, t2d: torch.Tensor, index_path: Path, target_json: Path,
                  mapping_path: Path) -> None:
    if index.hidden_size != target["hidden_size"]:
        raise TrainingError(f"hidden states have size {index.hidden_size}, the target {target['hidden_size']}",
                            where=str(index_path), fix="rerun extraction for this target")
    if index.final_layer_id != target["final_layer_id"]:
        raise TrainingError(f"the index's final layer is {index.final_layer_id}, the target's "
                            f"{target['final_layer_id']}: the teacher must be the state the lm_head reads",
                            where=str(index_path), fix="rerun extraction for this target")
    if t2d.shape[0] != target["vocab_size"]:
        raise TrainingError(f"t2d covers {t2d.shape[0]} target tokens, the target has {target['vocab_size']}",
                            where=str(mapping_path), fix="rerun build_vocab_mapping for this target")
    if not index.aux_layer_ids:
        raise TrainingError("the hidden states hold no aux layers", where=str(index_path))


