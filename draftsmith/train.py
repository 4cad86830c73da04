"""Train an EAGLE-3 draft on captured hidden states, with training-time test (TTT).

Conventions are speculators 0.9's (speculators/models/eagle3/{data,core,attention,metrics}.py),
so a draft trained here behaves under vLLM's eagle3 proposer as one trained there:

* shift (data.py ``shift_batch``): per sample of n tokens the draft sees n-1 positions t with
  token x[t+1], fused aux state g[t], teacher state y[t+1] (the target's distribution over
  x[t+2]), loss mask l[t+1] and position id t+1.
* TTT (core.py ``forward``): step j feeds back step j-1's output hidden state (pre-norm) with the
  teacher-forced token x[t+1+j] (``original_input_ids[:, 1 + ttt_step:]``) at position id t+1+j;
  its logits at t are scored against the teacher at t+j under loss mask l[t+1+j]
  (metrics.py ``align_for_step``), weighted by ``ttt_decay**j``, each step's KL averaged over its
  loss tokens (losses/utils.py ``loss_function``) and the steps summed.
* attention (attention.py ``create_combined_mask_mod``, ``extend_*_mask_for_draft_tokens``):
  step j's query at t sees step 0's keys causally within its sample plus the keys of steps 1..j
  at the same t.

Where speculators lets a shifted step read past the end of a packed sample (its right-padding
runs across document boundaries), positions whose step-j target lies outside the sample are
excluded here, so packing never changes the loss.

The teacher is the captured final state (post-norm, what the target's lm_head consumes) times
the lm_head rows of the draft vocabulary. The lm_head, the teacher and the loss touch only the
positions that carry a loss (gather indices built with the batch, on the host). The rest of the
target's vocabulary is touched only on logging steps, chunked, to learn whether the target's true
argmax lies in the draft vocabulary, so that the reported accuracy is the probability that vLLM
accepts the draft token; every step also counts agreement within the draft vocabulary.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import queue
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors
from torch import nn

from draftsmith.draft import Eagle3Draft, Eagle3DraftConfig, draft_rows, save_speculators
from draftsmith.errors import TrainingError
from draftsmith.hidden_states import (
    HiddenStateIndex,
    ShardInfo,
    dequantize_fp8,
    layer_file,
    read_shard,
    verify_store,
)
from draftsmith.io import atomic_write_bytes, atomic_write_json, atomic_write_text, fsync_dir, read_json, sha256_file
from draftsmith.settings import bad_setting, check_settings, from_schema, settings_from

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "draftsmith.train-checkpoint/2"
FINISHED = "finished.json"  # in the work dir once the rule's outputs are written: its checkpoints are not resumed
PAD_MULTIPLE = 128  # flex attention's block size: padded batches keep one compiled shape


@dataclass(frozen=True)
class TrainSettings:
    """Everything that decides the trained weights, plus how often to log and checkpoint.

    ``batch_tokens`` is per micro-batch (one process, one forward); an optimizer step takes
    ``world_size * grad_accum_steps`` micro-batches, so 2 processes x 1 and 1 process x 2
    train on the same global batches and give the same weights.
    """

    ttt_steps: int = from_schema("train.ttt_steps")
    ttt_decay: float = from_schema("train.ttt_decay")
    epochs: float = from_schema("train.epochs")  # a fraction trains on the first part of the last epoch's batches
    max_steps: int | None = from_schema("train.max_steps")
    batch_tokens: int = from_schema("train.batch_tokens")
    grad_accum_steps: int = 1
    lr: float = from_schema("train.lr")
    warmup_steps: int = from_schema("train.warmup_steps")
    weight_decay: float = from_schema("train.weight_decay")
    max_grad_norm: float = from_schema("train.max_grad_norm")
    checkpoint_every: int = from_schema("train.checkpoint_every")
    keep_checkpoints: int = 2
    log_every: int = from_schema("train.log_every")
    seed: int = from_schema("seed")
    dtype: str = "auto"  # "auto" (bfloat16 autocast on GPU, float32 on CPU), "bfloat16", "float32"
    num_layers: int = 1
    norm_before_residual: bool = True  # speculators' trainer default (and vLLM's default reading)
    train_lm_head: bool = False  # speculators 0.9 keeps lm_head frozen at the target's rows
    attention: str = "auto"  # "flex" (GPU default) or "sdpa" (CPU default): same math
    compile: str = "auto"  # torch.compile the draft step: "auto" = on GPU
    verify_shards: bool = True
    progress: bool = True
    device: str = from_schema("device")  # "auto" (cuda when present), "cuda" or "cpu"

    SECTION = "train"
    NOT_SETTINGS = {key: "launch, not math: run_training's arguments (settings_and_launch)"
                    for key in ("devices", "nodes", "rdzv_port")}

    # settings that do not change the weights: a checkpoint stays valid when they change
    NON_MATH = ("checkpoint_every", "keep_checkpoints", "log_every", "verify_shards", "progress",
                "compile", "attention", "device")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Check the config keys against the schema, then the Python-only settings."""
        check_settings(self)
        choices = {"dtype": ("auto", "bfloat16", "float32"), "attention": ("auto", "flex", "sdpa"),
                   "compile": ("auto", "true", "false", True, False)}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise bad_setting(f"train.{key}", getattr(self, key), "one of " + ", ".join(map(repr, allowed)))
        for key in ("grad_accum_steps", "keep_checkpoints", "num_layers"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise bad_setting(f"train.{key}", getattr(self, key), "an integer >= 1")

    def math_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.NON_MATH}


# ----------------------------------------------------------------------------------------------
# Data: plan packed micro-batches from shard metadata, read rows of one shard at a time


@dataclass
class _ShardMeta:
    """Per usable sample of one shard: first row, shifted length, loss tokens per TTT step."""

    starts: np.ndarray  # int64 [n]: row of the sample's first token in the shard
    lengths: np.ndarray  # int64 [n]: positions after the shift (n_tokens - 1, capped)
    counts: np.ndarray  # int64 [n, K]: loss positions valid at step j


def _shard_meta(index: HiddenStateIndex, shard: ShardInfo, cap: int, ttt_steps: int, verify: bool) -> _ShardMeta:
    data = read_shard(index, shard, layer_ids=[], verify=verify)
    offsets = data.offsets.numpy().astype(np.int64)
    starts, ends = offsets[:-1], offsets[1:]
    lengths = np.minimum(ends - starts - 1, cap)
    keep = lengths >= 1
    starts, lengths = starts[keep], lengths[keep]
    cs = np.concatenate([[0], np.cumsum(data.loss_mask.numpy().astype(np.int64))])
    counts = np.zeros((len(starts), ttt_steps), dtype=np.int64)
    for j in range(ttt_steps):
        # shifted positions t+j for t in [0, m-j) are rows start+1+j .. start+m
        lo = np.minimum(starts + 1 + j, starts + 1 + lengths)
        counts[:, j] = cs[starts + 1 + lengths] - cs[lo]
    return _ShardMeta(starts, lengths, counts)


@dataclass(frozen=True)
class _Pack:
    shard: int  # position in index.shards
    samples: tuple[int, ...]  # sample positions in that shard's _ShardMeta
    tokens: int
    counts: tuple[int, ...]  # loss positions per TTT step
    dummy: bool = False  # fills the last global batch; carries no loss


def _plan_epoch(metas: list[_ShardMeta], cap: int, seed: int, epoch: int) -> list[_Pack]:
    """The epoch's micro-batches: shards in a seeded order, each packed best-fit-decreasing into
    batches of at most ``cap`` positions, in seeded order. Depends on nothing but data and seed."""
    rng = np.random.default_rng([seed, epoch])
    packs: list[_Pack] = []
    for s in rng.permutation(len(metas)):
        meta = metas[s]
        order = rng.permutation(len(meta.lengths))
        order = order[np.argsort(-meta.lengths[order], kind="stable")]
        bins: list[list[int]] = []
        room: list[tuple[int, int]] = []  # sorted (free space, bin id)
        for i in order:
            need = int(meta.lengths[i])
            k = bisect.bisect_left(room, (need, -1))
            if k == len(room):
                bins.append([int(i)])
                bisect.insort(room, (cap - need, len(bins) - 1))
            else:
                free, b = room.pop(k)
                bins[b].append(int(i))
                bisect.insort(room, (free - need, b))
        for b in rng.permutation(len(bins)):
            members = tuple(sorted(bins[b]))
            idx = np.asarray(members)
            packs.append(_Pack(int(s), members, int(meta.lengths[idx].sum()),
                               tuple(int(c) for c in meta.counts[idx].sum(0))))
    return packs


@dataclass
class _Step:
    epoch: int
    index: int  # step within the epoch
    packs: list[_Pack]  # the global batch: world_size * grad_accum micro-batches
    counts: np.ndarray  # loss positions per TTT step over the global batch
    tokens: int


def _plan_steps(metas: list[_ShardMeta], settings: TrainSettings, group: int) -> list[_Step]:
    steps: list[_Step] = []
    num_epochs = math.ceil(settings.epochs)
    for epoch in range(num_epochs):
        packs = _plan_epoch(metas, settings.batch_tokens, settings.seed, epoch)
        if not packs:
            break
        per_epoch = math.ceil(len(packs) / group)
        if epoch == num_epochs - 1 and settings.epochs < num_epochs:
            per_epoch = max(1, math.ceil((settings.epochs - epoch) * per_epoch))
        for i in range(per_epoch):
            chunk = packs[i * group:(i + 1) * group]
            chunk += [dataclasses.replace(packs[k % len(packs)], dummy=True) for k in range(group - len(chunk))]
            real = [p for p in chunk if not p.dummy]
            counts = np.sum([p.counts for p in real], axis=0)
            steps.append(_Step(epoch, i, chunk, counts, sum(p.tokens for p in real)))
            if settings.max_steps is not None and len(steps) >= settings.max_steps:
                return steps
    return steps


class _ShardRows:
    """Rows of one shard's files, memory-mapped: only the rows a micro-batch uses are read."""

    def __init__(self, index: HiddenStateIndex, shard: ShardInfo, layer_ids: list[int]) -> None:
        tokens = read_shard(index, shard, layer_ids=[], verify=False)
        self.input_ids = tokens.input_ids
        self.loss_mask = tokens.loss_mask
        root = index.root / shard.path
        self.files = {i: safe_open(str(root / layer_file(i)), "pt") for i in layer_ids}
        self.fp8 = index.dtype == "fp8"

    def rows(self, layer_id: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stored rows and, for fp8, their per-token scales (dequantised later, on the device)."""
        f = self.files[layer_id]
        values = f.get_slice("hidden_states")[start:stop]
        return values, (f.get_slice("scales")[start:stop] if self.fp8 else None)


def _padded_length(tokens: int, pad_to: int, fixed: int | None) -> int:
    if fixed is not None:
        return fixed
    return max(tokens, 1) if pad_to <= 1 else -(-tokens // pad_to) * pad_to


def _build_batch(pack: _Pack, meta: _ShardMeta, rows: _ShardRows, aux_ids: list[int], final_id: int,
                 hidden: int, ttt_steps: int, t_pad: int, dtype: torch.dtype, pin: bool) -> dict:
    """Pack the samples into ``t_pad`` rows: aux [T, A*H], final [T, H], per-step token ids and
    valid masks [K, T], positions, document ids (padding rows form one extra document), and the
    gather indices of ``scored_positions``."""
    total = pack.tokens
    # fp8 stores travel as fp8 plus per-token scales and are dequantised on the device
    # (``dequantize_batch``): half the bytes over PCIe, and no slow CPU float8 conversion.
    store_dtype = torch.float8_e4m3fn if rows.fp8 else dtype
    aux = torch.zeros(t_pad, len(aux_ids) * hidden, dtype=store_dtype)
    final = torch.zeros(t_pad, hidden, dtype=store_dtype)
    scales = torch.zeros(t_pad, len(aux_ids) + 1) if rows.fp8 else None  # aux layers, then final
    ids = torch.zeros(ttt_steps, t_pad, dtype=torch.long)
    valid = torch.zeros(ttt_steps, t_pad, dtype=torch.bool)
    pos = torch.zeros(t_pad, dtype=torch.long)
    doc = torch.full((t_pad,), len(pack.samples), dtype=torch.int32)  # padding: one extra document
    o = 0
    for d, i in enumerate(pack.samples):
        s, m = int(meta.starts[i]), int(meta.lengths[i])
        for a, layer in enumerate([*aux_ids, final_id]):
            final_layer = a == len(aux_ids)
            start = s + 1 if final_layer else s  # the final state of the *next* token is the teacher's
            values, layer_scales = rows.rows(layer, start, start + m)
            if final_layer:
                final[o:o + m] = values
            else:
                aux[o:o + m, a * hidden:(a + 1) * hidden] = values
            if scales is not None:
                scales[o:o + m, a] = layer_scales
        sample_ids = rows.input_ids[s + 1:s + 1 + m]
        sample_loss = rows.loss_mask[s + 1:s + 1 + m]
        if not pack.dummy:
            for j in range(min(ttt_steps, m)):
                valid[j, o:o + m - j] = sample_loss[j:]
        for j in range(min(ttt_steps, m)):
            ids[j, o:o + m - j] = sample_ids[j:]
        pos[o:o + m] = torch.arange(1, m + 1)
        doc[o:o + m] = d
        o += m
    batch = {"aux": aux, "final": final, "ids": ids, "valid": valid, "pos": pos, "doc": doc, **scored_positions(valid)}
    if scales is not None:
        batch["scales"] = scales
    if pin:
        batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    batch["tokens"] = total
    return batch


class _Prefetcher:
    """Builds this rank's micro-batches on a background thread, one shard open at a time."""

    def __init__(self, jobs: list[tuple[_Pack, Any]], make, depth: int = 2) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(jobs, make), daemon=True)
        self._thread.start()

    def _run(self, jobs, make) -> None:
        try:
            for job in jobs:
                if self._stop.is_set():
                    return
                self._queue.put(("ok", make(*job)))
        except BaseException as e:  # handed to the training loop, which re-raises it
            self._queue.put(("error", e))

    def get(self) -> dict:
        kind, value = self._queue.get()
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()


def _to_device(batches: list[dict], device: torch.device, stream) -> list[dict]:
    """Start copying micro-batches to the device; on GPU on a side stream (``stream``), so the copy
    of the next step's inputs (about 0.3 GB for 8k tokens of an 8B target's states, some 5 ms over
    PCIe) overlaps this step's compute instead of stalling it."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        return [{k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                for b in batches]


def dequantize_batch(batch: dict, dtype: torch.dtype) -> dict:
    """An fp8 micro-batch's states as ``dtype``, on the device it sits on (a no-op for others)."""
    if "scales" not in batch:
        return batch
    scales = batch.pop("scales")
    t, a = scales.shape[0], scales.shape[1] - 1
    aux_rows = batch["aux"].view(t * a, -1)  # one row per (token, aux layer), each with its own scale
    batch["aux"] = dequantize_fp8(aux_rows, scales[:, :a].reshape(-1), dtype).view(t, -1)
    batch["final"] = dequantize_fp8(batch["final"], scales[:, a], dtype)
    return batch


def _ready(batches: list[dict], stream) -> list[dict]:
    """Make the compute stream wait for ``_to_device``'s copies, and keep the allocator from
    handing their memory to the side stream while the compute stream still reads it."""
    if stream is not None:
        current = torch.cuda.current_stream(stream.device)
        current.wait_stream(stream)
        for b in batches:
            for v in b.values():
                if isinstance(v, torch.Tensor):
                    v.record_stream(current)
    return batches


class _Verifier(threading.Thread):
    """Checks the sha256 of the state files of this rank's share of the shards, beside training."""

    def __init__(self, index: HiddenStateIndex, shards: list[ShardInfo]) -> None:
        super().__init__(daemon=True)
        self.index, self.shards, self.error = index, shards, None

    def run(self) -> None:
        for shard in self.shards:
            for name, digest in shard.checksums.items():
                path = self.index.root / shard.path / name
                if sha256_file(path) != digest:
                    self.error = TrainingError(
                        f"checksum mismatch: part {shard.part} shard {shard.shard} file {name} is corrupt",
                        where=str(path), fix="rerun the workflow: extraction regenerates damaged shards")
                    return


# ----------------------------------------------------------------------------------------------
# Attention of the unrolled draft


try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch < 2.9
    AuxRequest = None


def _flex_with_lse(fn, q, k, v, block_mask, scale):
    """flex_attention returning (out, lse), on both the new and the old return convention."""
    if AuxRequest is not None:
        out, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_lse=True)


class TTTAttention:
    """The TTT attention pattern for one micro-batch, used as the draft's ``attend``.

    Step 0 stores each layer's keys/values; step j attends to them causally within the sample
    and to the keys/values of steps 1..j at the same position. ``sdpa`` concatenates those keys
    and uses an explicit boolean mask (speculators' dense path); ``flex`` runs the causal part
    with flex attention over block-diagonal document masks and merges the few same-position keys
    through the log-sum-exp, so it never materialises the (j+1)*T-wide mask.
    """

    def __init__(self, doc: torch.Tensor, impl: str, flex_fn=None) -> None:
        self.impl, self.step_index = impl, 0
        self.k0: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.extra: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        t = doc.shape[0]
        if impl == "sdpa":
            same = doc[:, None] == doc[None, :]
            self.mask = same & torch.ones(t, t, dtype=torch.bool, device=doc.device).tril()
            self.eye = torch.eye(t, dtype=torch.bool, device=doc.device)
        else:
            from torch.nn.attention.flex_attention import create_block_mask

            def causal_document(b, h, q_idx, kv_idx):
                return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

            self.block_mask = create_block_mask(causal_document, None, None, t, t, device=doc.device,
                                                _compile=doc.is_cuda)
            if flex_fn is None:
                from torch.nn.attention.flex_attention import flex_attention as flex_fn
            self.flex = flex_fn

    def next_step(self) -> None:
        self.step_index += 1

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        gqa = q.shape[1] != k.shape[1]
        if self.step_index == 0:
            self.k0[layer] = (k, v)
            self.extra[layer] = []
        else:
            self.extra[layer].append((k, v))
        k0, v0 = self.k0[layer]
        extra = self.extra[layer]
        if self.impl == "sdpa":
            keys = torch.cat([k0] + [e[0] for e in extra])
            values = torch.cat([v0] + [e[1] for e in extra])
            mask = torch.cat([self.mask] + [self.eye] * len(extra), dim=1)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                                 attn_mask=mask, scale=scale, enable_gqa=gqa)
            return out.transpose(0, 1)
        out, lse = _flex_with_lse(self.flex, q.transpose(0, 1)[None].contiguous(),
                                  k0.transpose(0, 1)[None].contiguous(), v0.transpose(0, 1)[None].contiguous(),
                                  self.block_mask, scale)
        out, lse = out[0].transpose(0, 1), lse[0].transpose(0, 1)  # [T, Hq, D], [T, Hq]
        if not extra:
            return out
        group = q.shape[1] // k.shape[1]
        ks = torch.stack([e[0] for e in extra], dim=2).repeat_interleave(group, dim=1)  # [T, Hq, j, D]
        vs = torch.stack([e[1] for e in extra], dim=2).repeat_interleave(group, dim=1)
        f = torch.promote_types(q.dtype, torch.float32)
        scores = torch.einsum("thd,thjd->thj", q.to(f), ks.to(f)) * scale  # [T, Hq, j]
        weights = torch.softmax(torch.cat([lse.to(f)[..., None], scores], dim=-1), dim=-1)
        merged = weights[..., :1] * out.to(f) + torch.einsum("thj,thjd->thd", weights[..., 1:], vs.to(f))
        return merged.to(q.dtype)


# ----------------------------------------------------------------------------------------------
# The objective


def scored_positions(valid: torch.Tensor) -> dict:
    """Gather indices of the positions each TTT step scores, from ``valid`` [K, T] on the host, so
    that the lm_head, the teacher and the loss touch only those and the step never syncs.

    ``teach_rows`` [N0]: the teacher's rows, the step-0 loss positions (step j at t is scored
    against the teacher at t+j, itself a step-0 loss position of the same sample); ``rows``: the
    positions of steps 0..K-1, concatenated, ``splits`` their counts; ``teach``: each position's
    teacher as an index into ``teach_rows``; ``keep``: per step, the rows whose output is used
    (concatenated, ``keep_splits`` their counts); ``pick``: each scored position as an index into
    its step's ``keep``.
    """
    valid = valid.cpu()
    t = valid.shape[1]
    teach_rows = valid[0].nonzero().squeeze(1)
    compact = valid[0].long().cumsum(0) - 1
    rows, teach = [], []
    for j in range(valid.shape[0]):
        r = valid[j].nonzero().squeeze(1)
        if bool((r + j >= t).any()) or not bool(valid[0][r + j].all()):
            raise TrainingError(f"TTT step {j}'s loss positions are not step 0's shifted by {j} within samples",
                                where="training batch", fix="build batches with draftsmith.train._build_batch")
        rows.append(r)
        teach.append(compact[r + j])
    # keep[j]: the rows whose step-j output anything uses, those scored at step j or later (step
    # j+1 reads step j's output at the same row); pick[j]: step j's scored rows within keep[j].
    keep, pick, needed = [None] * len(rows), [None] * len(rows), torch.zeros(t, dtype=torch.bool)
    for j in reversed(range(len(rows))):
        needed = needed | valid[j]
        keep[j] = needed.nonzero().squeeze(1)
        pick[j] = (needed.long().cumsum(0) - 1)[rows[j]]
    return {"teach_rows": teach_rows, "rows": torch.cat(rows), "teach": torch.cat(teach),
            "splits": tuple(len(r) for r in rows), "keep": torch.cat(keep), "keep_splits": tuple(map(len, keep)),
            "pick": torch.cat(pick)}


def _teacher_rows(tz: torch.Tensor):
    """Per row of teacher logits: logsumexp, negative entropy (sum p log p), argmax and max."""
    tf = tz.float()
    tlse = torch.logsumexp(tf, -1)
    logp = tf - tlse[:, None]
    top, arg = tf.max(-1)
    return tlse, (logp.exp() * logp).sum(-1), arg, top


def _kl_rows(z: torch.Tensor, tz: torch.Tensor, tlse: torch.Tensor, negent: torch.Tensor, teach: torch.Tensor):
    """KL(teacher || draft) of each draft row z against teacher row ``teach``, with the draft's
    logsumexp (for the backward) and argmax; the teacher's probabilities are recomputed from its
    logits, never stored."""
    zf = z.float()
    lse = torch.logsumexp(zf, -1)
    p = torch.exp(tz[teach].float() - tlse[teach, None])
    return lse - (p * zf).sum(-1) + negent[teach], lse, zf.argmax(-1)


def _kl_rows_grad(z: torch.Tensor, lse: torch.Tensor, tz: torch.Tensor, tlse: torch.Tensor, teach: torch.Tensor,
                  grad: torch.Tensor) -> torch.Tensor:
    """d KL / d z = softmax(z) - p, times each row's incoming gradient, in z's dtype."""
    p = torch.exp(tz[teach].float() - tlse[teach, None])
    return (grad[:, None] * (torch.exp(z.float() - lse[:, None]) - p)).to(z.dtype)


@dataclass(frozen=True)
class LossKernels:
    """The row-wise parts of the loss. Eager, they run in row chunks (bounding the float32
    temporaries); compiled, Inductor fuses each into kernels that read the logits once or twice and
    write only per-row results (the backward: the gradient), so they take all rows at once. Row
    counts differ per batch: compiled with automatic dynamic shapes."""

    teacher: Any = _teacher_rows
    kl: Any = _kl_rows
    kl_grad: Any = _kl_rows_grad
    chunk: int | None = 4096

    @classmethod
    def compiled(cls, backend: str = "inductor") -> LossKernels:
        return cls(*(torch.compile(f, backend=backend) for f in (_teacher_rows, _kl_rows, _kl_rows_grad)), chunk=None)

    def slices(self, n: int) -> list[slice]:
        if self.chunk is None or n <= self.chunk:
            return [slice(None)]
        return [slice(i, i + self.chunk) for i in range(0, n, self.chunk)]

    def rows(self, fn, n: int, *args, rowwise: tuple[int, ...] = (0,)) -> tuple[torch.Tensor, ...]:
        """fn over row chunks of the arguments at positions ``rowwise``, outputs concatenated."""
        parts = [fn(*(a[s] if i in rowwise else a for i, a in enumerate(args))) for s in self.slices(n)]
        if len(parts) == 1:
            return parts[0]
        if isinstance(parts[0], torch.Tensor):
            return torch.cat(parts)
        return tuple(torch.cat(p) for p in zip(*parts))


class DraftKL(torch.autograd.Function):
    """Per scored row, KL(teacher || draft) over the draft vocabulary, and the draft's argmax.

    Inputs: draft logits z [N, Vd] (the lm_head's output, in its compute dtype), the teacher's
    logits tz [N0, Vd] with their logsumexp and negative entropy [N0], and each draft row's teacher
    row ``teach`` [N]. Saves z and per-row floats only: the float32 softmaxes are recomputed in the
    backward instead of kept per TTT step (autograd through log_softmax would hold several float32
    [N, Vd] tensors per step).
    """

    @staticmethod
    def forward(ctx, z, tz, tlse, negent, teach, kernels: LossKernels):
        with torch.autocast(z.device.type, enabled=False):
            kl, lse, arg = kernels.rows(kernels.kl, z.shape[0], z, tz, tlse, negent, teach, rowwise=(0, 4))
        ctx.save_for_backward(z, lse, tz, tlse, teach)
        ctx.kernels = kernels
        ctx.mark_non_differentiable(arg)
        return kl, arg

    @staticmethod
    def backward(ctx, grad_kl, grad_arg):
        z, lse, tz, tlse, teach = ctx.saved_tensors
        kernels = ctx.kernels
        with torch.autocast(z.device.type, enabled=False):
            grad = kernels.rows(kernels.kl_grad, z.shape[0], z, lse, tz, tlse, teach, grad_kl.contiguous(),
                                rowwise=(0, 1, 4, 5))
        return grad, None, None, None, None, None


class TTTObjective(nn.Module):
    """Loss and accuracy counts of the draft unrolled for ``ttt_steps`` on one packed micro-batch.

    The teacher matrices are plain attributes, not parameters or buffers: DDP neither syncs nor
    broadcasts them, and checkpoints do not carry them (they come from the target).
    """

    def __init__(self, draft: Eagle3Draft, lm_head: torch.Tensor, rows: torch.Tensor, *, ttt_steps: int,
                 ttt_decay: float, attention: str, flex_fn=None, argmax_chunk: int = 2048) -> None:
        super().__init__()
        self.draft = draft
        self.teacher = lm_head[rows]  # [Vd, H] draft-vocab rows, in draft order
        outside = torch.ones(lm_head.shape[0], dtype=torch.bool)
        outside[rows] = False
        self.rest = lm_head[outside]  # [V - Vd, H]: only for "is the true argmax in the draft vocab?"
        self.ttt_steps, self.ttt_decay = ttt_steps, ttt_decay
        self.attention, self.flex_fn, self.argmax_chunk = attention, flex_fn, argmax_chunk
        self.step_fn = draft.advance
        self.kernels = LossKernels()

    def to_device(self, device: torch.device, dtype: torch.dtype) -> TTTObjective:
        self.teacher = self.teacher.to(device=device, dtype=dtype)
        self.rest = self.rest.to(device=device, dtype=dtype)
        return self

    def compile_steps(self, backend: str = "inductor") -> TTTObjective:
        """torch.compile the draft step (one graph per TTT step: GPU batches have one padded length, and
        the kept row count is marked dynamic) and the loss's row kernels."""
        self.step_fn = torch.compile(self.draft.advance, dynamic=False, backend=backend)
        self.kernels = LossKernels.compiled(backend)
        return self

    def unroll(self, aux: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor,
               keep: Sequence[torch.Tensor] | None = None):
        """Yield the final-normed states (what the lm_head reads) of TTT steps 0..K-1 (module
        docstring): [T, H], or with ``keep`` (per step, the rows whose outputs are used, each
        step's within the previous one's; ``scored_positions``) [len(keep[j]), H], stopping
        before the first step that keeps no row."""
        hidden = self.draft.fuse(aux)
        attend = TTTAttention(doc, self.attention, self.flex_fn)
        k, t = ids.shape
        cos, sin = self.draft.rope((pos[None] + torch.arange(k, device=pos.device)[:, None]).flatten())
        for j in range(k):
            rows = None if keep is None else keep[j]
            if rows is not None:
                if not len(rows):
                    return
                if len(rows) > 1:  # one compiled graph per TTT step, whatever the batch's row count
                    torch._dynamo.mark_dynamic(rows, 0)
            out, normed = self.step_fn(hidden, ids[j], cos[j * t:(j + 1) * t], sin[j * t:(j + 1) * t], attend, rows)
            attend.next_step()
            yield normed
            if rows is not None and j + 1 < k:  # rows dropped here stay dropped: zeros stand in for them
                out = out.new_zeros(t, out.shape[1]).index_copy(0, rows, out)
            hidden = out

    @torch.no_grad()
    def _teacher(self, final: torch.Tensor, teach_rows: torch.Tensor, exact: bool):
        """The teacher at its rows: logits [N0, Vd], logsumexp, negative entropy, argmax, and (``exact``)
        whether the target's argmax over its whole vocabulary lies in the draft vocabulary."""
        x = final[teach_rows]
        tz = x @ self.teacher.to(x.dtype).T
        tlse, negent, arg, top = self.kernels.rows(self.kernels.teacher, tz.shape[0], tz)
        in_vocab = None
        if exact:
            in_vocab = torch.ones_like(arg, dtype=torch.bool)
            if self.rest.shape[0]:
                rest = self.rest.to(x.dtype)
                max_out = torch.cat([(c @ rest.T).max(-1).values for c in x.split(self.argmax_chunk)])
                in_vocab = top >= max_out.float()
        return tz, tlse, negent, arg, in_vocab

    def forward(self, batch: dict, weights: torch.Tensor, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (sum_j weights[j] * sum of step-j KL over its scored positions, stats [K, 6]).

        ``batch``: aux, final, ids, valid, pos, doc as ``_build_batch`` makes them, plus
        ``scored_positions(valid)``. stats columns: KL sum, scored positions, positions where the
        draft's argmax is the teacher's within the draft vocabulary; with ``exact`` (logging steps:
        it costs a pass over the target's whole lm_head) also positions checked, positions where the
        draft's token is the target's argmax over its whole vocabulary (what vLLM accepts), and
        positions whose steps 0..j all were (the accepted-prefix events behind the acceptance length).
        """
        aux, final, ids, valid, pos, doc = (batch[k] for k in ("aux", "final", "ids", "valid", "pos", "doc"))
        splits = batch["splits"]
        stats = aux.new_zeros((ids.shape[0], 6), dtype=torch.float32)
        if not splits[0]:  # a filler micro-batch: zero gradients for every parameter, so DDP still reduces
            return sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0, stats
        tz, tlse, negent, target_arg, in_vocab = self._teacher(final, batch["teach_rows"], exact)
        rows, teach, pick = (batch[k].split(splits) for k in ("rows", "teach", "pick"))
        keep = batch["keep"].split(batch["keep_splits"])
        chain = valid[0]
        loss = aux.new_zeros((), dtype=torch.float32)
        for j, normed in enumerate(self.unroll(aux, ids, pos, doc, keep)):
            kl, arg = DraftKL.apply(self.draft.lm_head(normed[pick[j]]), tz, tlse, negent, teach[j], self.kernels)
            kl_sum = kl.sum()
            loss = loss + weights[j] * kl_sum
            with torch.no_grad():
                n = kl_sum.new_full((), splits[j])
                hit = arg == target_arg[teach[j]]
                row = [kl_sum.detach(), n, hit.sum().float()]
                if in_vocab is not None:
                    hit = hit & in_vocab[teach[j]]
                    chain = chain & torch.zeros_like(chain).index_put_((rows[j],), hit)
                    row += [n, hit.sum().float(), chain.sum().float()]
                stats[j, :len(row)] = torch.stack(row)
        return loss, stats


# ----------------------------------------------------------------------------------------------
# Distributed


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def _use_cuda(settings: TrainSettings) -> bool:
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device is cuda but no CUDA device is visible", where="device",
                            fix="set device: cpu, or run where a GPU is visible")
    return settings.device != "cpu" and torch.cuda.is_available()


def _init_distributed(cuda: bool) -> _Dist:
    """Join the torchrun process group if there is one (NCCL on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not dist.is_initialized():
        return _Dist()
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        owns = True
    return _Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), owns)


# ----------------------------------------------------------------------------------------------
# Checkpoints


def _checkpoint_key(settings: TrainSettings, index_path: Path, mapping_path: Path, target: dict,
                    group: int) -> dict[str, str]:
    """What a checkpoint was made from, part by part, so a refusal can say which part changed:
    the training code (this module and every draftsmith module it imports), the settings that
    change the math, the hidden states, the vocab mapping and the target."""
    from draftsmith.fingerprint import code_fingerprint

    keys = ("model_path", "hidden_size", "vocab_size", "num_hidden_layers", "aux_layer_ids", "final_layer_id",
            "text_config")

    def digest(value) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]

    return {
        "format": CHECKPOINT_FORMAT,
        "code": code_fingerprint("draftsmith.train"),
        "settings": digest({"math": settings.math_dict(), "micro_batches_per_step": group}),
        "index": sha256_file(index_path),
        "mapping": sha256_file(mapping_path),
        "target": digest({k: target.get(k) for k in keys}),
    }


# What each part of the checkpoint key is, for the log.
_KEY_PARTS = {"format": "the checkpoint format", "code": "the training code (draftsmith.train and its imports)",
              "settings": "the training settings", "index": "the hidden states (index.json)",
              "mapping": "the vocab mapping", "target": "the target"}


def _trainable_state(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().contiguous() for n, p in draft.named_parameters() if p.requires_grad}


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The optimizer's state as named tensors (for safetensors) and its param groups (for JSON):
    checkpoints hold no pickles."""
    state = optimizer.state_dict()
    tensors = {f"{index}.{key}": torch.as_tensor(value).detach().cpu().contiguous()
               for index, entry in state["state"].items() for key, value in entry.items()}
    return tensors, state["param_groups"]


def _optimizer_state(tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    return {"state": state, "param_groups": groups}


def _save_checkpoint(ckpt_root: Path, step: int, draft: Eagle3Draft, optimizer: torch.optim.Optimizer,
                     state: dict, keep: int) -> Path:
    """Write into a hidden folder, then rename: a kill leaves the previous checkpoint intact."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step-{step:08d}"
    tmp = ckpt_root / f".step-{step:08d}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files = {
            "model.safetensors": save_safetensors(_trainable_state(draft)),
            "rng.safetensors": save_safetensors(_rng_state()),
        }
        for name, data in files.items():
            atomic_write_bytes(tmp / name, data)
        tensors, groups = _optimizer_tensors(optimizer)
        atomic_write_bytes(tmp / "optimizer.safetensors", save_safetensors(tensors))
        atomic_write_json(tmp / "optimizer.json", groups)
        atomic_write_json(tmp / "state.json", state)
        if final.exists():
            _remove_hidden(final)
        tmp.rename(final)
        fsync_dir(ckpt_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_json(ckpt_root / "latest.json", {"step": step, "path": final.name})
    old = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir() and p != final)
    for p in old[:max(len(old) - (keep - 1), 0)]:
        _remove_hidden(p)
    return final


def _remove_hidden(folder: Path) -> None:
    """Rename to a hidden name, then delete: a kill mid-delete never leaves a partial step-* on show."""
    doomed = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
    folder.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _find_checkpoint(work_dir: Path, key: dict[str, str]) -> tuple[Path | None, dict | None, str]:
    """The latest checkpoint if it was made by the same code from the same inputs and settings by
    a run that has not finished, else (None, None); and, for the log, why it is or is not resumed."""
    ckpt_root = work_dir / "checkpoints"
    for stale in ckpt_root.glob(".step-*"):  # a checkpoint half-written or half-deleted by a kill
        shutil.rmtree(stale, ignore_errors=True)
    pointer = ckpt_root / "latest.json"
    if not pointer.exists():
        return None, None, f"no checkpoint in {ckpt_root}: training from step 0"
    path = ckpt_root / read_json(pointer)["path"]
    if not (path / "state.json").exists():
        return None, None, f"the checkpoint pointer in {ckpt_root} names no checkpoint: training from step 0"
    state = read_json(path / "state.json")
    old = state.get("key") or {}
    changed = [_KEY_PARTS[part] for part in key if old.get(part) != key[part]]
    if changed:
        return None, None, (f"not resuming from {path.name} (step {state.get('step')}): "
                            f"{', '.join(changed)} changed since it was written; training from step 0")
    if (work_dir / FINISHED).exists():
        # The run that wrote it delivered its draft: the rule runs again because it was told to
        # (--forcerun) or its outputs were removed, and a rerun must train, not copy the old draft.
        return None, None, (f"not resuming from {path.name}: it ends a finished run whose draft was delivered; "
                            "training again from step 0")
    return path, state, f"resuming from {path} (step {state['step']}): same code, settings and inputs"


# ----------------------------------------------------------------------------------------------
# Training


def _lr_at(step: int, settings: TrainSettings, total: int) -> float:
    """Linear warm-up, then linear decay to zero at the last step (speculators' default schedule)."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    return settings.lr * max(0.0, (total - step) / max(total - settings.warmup_steps, 1))


def _resolve(settings: TrainSettings, device: torch.device) -> tuple[torch.dtype, str, bool]:
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "bfloat16": torch.bfloat16, "float32": torch.float32}[settings.dtype]
    attention = settings.attention if settings.attention != "auto" else ("flex" if device.type == "cuda" else "sdpa")
    compile_ = settings.compile in ("true", True) or (settings.compile == "auto" and device.type == "cuda")
    return dtype, attention, compile_


def summarize(stats: list[list[float]]) -> dict:
    """Per-step metrics from summed [K, 6] stats (``TTTObjective.forward``).

    ``loss`` and ``draft_vocab_acc`` (top-1 agreement with the teacher within the draft
    vocabulary, an upper bound of acc) cover every step since the last log; ``acc``, ``cond_acc``,
    ``joint_acc`` and ``tau`` (the acceptance vLLM would see: the target's argmax over its whole
    vocabulary) cover the logging step's batch, ``tokens_scored_exact`` positions.
    """
    out: dict[str, Any] = {"loss": [], "acc": [], "cond_acc": [], "joint_acc": [], "draft_vocab_acc": []}
    starts = stats[0][3] if stats else 0.0
    prev_chain = starts
    for kl, n, agree, checked, correct, chain in stats:  # None where a ratio has no positions to count
        out["loss"].append(kl / n if n else None)
        out["draft_vocab_acc"].append(agree / n if n else None)
        out["acc"].append(correct / checked if checked else None)
        out["cond_acc"].append(chain / prev_chain if prev_chain else None)
        out["joint_acc"].append(chain / starts if starts else None)
        prev_chain = chain
    # tau = 1 + E[accepted prefix length]; the accepted prefix has length >= j+1 exactly when
    # steps 0..j are all correct (chain), so E = sum_j P(chain_j), per start position.
    out["tau"] = 1.0 + sum(out["joint_acc"]) if starts else None
    out["tokens_scored"] = stats[0][1] if stats else 0.0
    out["tokens_scored_exact"] = starts
    return out


def train_draft(index_path: str | Path, mapping_path: str | Path, target_json: str | Path, out_dir: str | Path,
                work_dir: str | Path, settings: TrainSettings = TrainSettings()) -> dict:
    """Train an EAGLE-3 draft and write it to ``out_dir`` in the speculators format; returns a summary.

    Resumable: checkpoints under ``work_dir`` (never the rule's output) are picked up when they
    were made by the same code from the same data and settings, and the run that wrote them has not
    delivered its draft (``run_training`` marks that); the log says why a checkpoint is or is not
    resumed. Under torchrun every process calls this function.
    """
    settings.check()
    index_path, mapping_path, out_dir, work_dir = map(Path, (index_path, mapping_path, out_dir, work_dir))
    ddp = _init_distributed(_use_cuda(settings))
    try:
        return _train(index_path, mapping_path, Path(target_json), out_dir, work_dir, settings, ddp)
    finally:
        if ddp.owns_group:
            dist.destroy_process_group()


def _train(index_path: Path, mapping_path: Path, target_json: Path, out_dir: Path, work_dir: Path,
           settings: TrainSettings, ddp: _Dist) -> dict:
    from draftsmith.targets.weights import load_embedding_and_head

    device = torch.device(f"cuda:{ddp.local_rank}") if _use_cuda(settings) else torch.device("cpu")
    dtype, attention, compile_ = _resolve(settings, device)
    index = HiddenStateIndex.load(index_path)
    target = read_json(target_json)
    mapping = load_file(str(mapping_path))
    d2t, t2d = mapping["d2t"].long(), mapping["t2d"].bool()
    _check_inputs(index, target, t2d, index_path, target_json, mapping_path)

    config = Eagle3DraftConfig.from_target(
        target, draft_vocab_size=int(d2t.shape[0]), num_layers=settings.num_layers,
        norm_before_residual=settings.norm_before_residual, speculative_tokens=settings.ttt_steps,
        aux_layer_ids=index.aux_layer_ids)
    torch.manual_seed(settings.seed)
    draft = Eagle3Draft(config)
    embed, head = load_embedding_and_head(target_json)
    frozen_dtype = dtype if dtype == torch.bfloat16 else torch.float32
    draft.load_target_weights(embed.to(frozen_dtype), head, d2t, t2d)
    draft.lm_head.weight.requires_grad_(settings.train_lm_head)
    if not settings.train_lm_head:
        draft.lm_head.weight.data = draft.lm_head.weight.data.to(frozen_dtype)
    rows = draft_rows(d2t, t2d, config.target_vocab_size)
    flex_fn = None
    if attention == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        flex_fn = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
    objective = TTTObjective(draft, head.to(frozen_dtype), rows, ttt_steps=settings.ttt_steps,
                             ttt_decay=settings.ttt_decay, attention=attention, flex_fn=flex_fn)
    del embed, head
    draft.to(device)
    objective.to_device(device, frozen_dtype)
    if compile_:
        objective.compile_steps()

    # plan the run from shard metadata alone (cheap), identically on every rank
    group = ddp.world * settings.grad_accum_steps
    metas = [_shard_meta(index, s, settings.batch_tokens, settings.ttt_steps, settings.verify_shards)
             for s in index.shards]
    steps = _plan_steps(metas, settings, group)
    if not steps:
        raise TrainingError("the hidden states hold no sample with at least 2 tokens", where=str(index_path),
                            fix="check the dataset stage: every training sample needs a prompt and a reply")
    total = len(steps)

    key = _checkpoint_key(settings, index_path, mapping_path, target, group)
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    ckpt_root = work_dir / "checkpoints"
    ckpt_path, ckpt_state, resume = _find_checkpoint(work_dir, key)
    log.info("%s", resume)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay,
                                  fused=device.type == "cuda")
    start = 0
    if ckpt_path is not None:
        tensors = load_file(str(ckpt_path / "model.safetensors"))
        draft.load_state_dict(tensors, strict=False)
        expected = {n for n, p in draft.named_parameters() if p.requires_grad}
        if set(tensors) != expected:
            raise TrainingError(f"checkpoint weights do not match the draft ({sorted(set(tensors) ^ expected)})",
                                where=str(ckpt_path), fix=f"delete {ckpt_root} to start over")
        # load_state_dict moves each state tensor where its parameter (and fused/capturable) wants it
        optimizer.load_state_dict(_optimizer_state(load_file(str(ckpt_path / "optimizer.safetensors")),
                                                   read_json(ckpt_path / "optimizer.json")))
        rng = load_file(str(ckpt_path / "rng.safetensors"))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        start = int(ckpt_state["step"])
        log.info("resuming at step %d of %d", start, total)
    if ddp.world > 1:
        dist.barrier()  # every rank has read the checkpoint pointer before rank 0 clears stale state
    if ckpt_path is None and ddp.main:
        for stale in ("checkpoints", "tensorboard", "metrics.jsonl", FINISHED):
            p = work_dir / stale
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    if ddp.world > 1:
        dist.barrier()

    model: nn.Module = objective
    if ddp.world > 1:
        model = nn.parallel.DistributedDataParallel(
            objective, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)

    # this rank's micro-batches, in order, from the resume point on
    jobs = []
    for step in steps[start:]:
        for a in range(settings.grad_accum_steps):
            pack = step.packs[ddp.rank * settings.grad_accum_steps + a]
            jobs.append((pack,))
    aux_ids, final_id = list(index.aux_layer_ids), index.final_layer_id
    # On GPU every batch has the same padded length, so the compiled step, the compiled flex
    # kernel and its block mask are built once; the best-fit packing keeps the padding small.
    pad_to = PAD_MULTIPLE if attention == "flex" else 1
    fixed = -(-settings.batch_tokens // PAD_MULTIPLE) * PAD_MULTIPLE if device.type == "cuda" else None
    batch_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    open_rows: dict[int, _ShardRows] = {}

    def make(pack: _Pack) -> dict:
        if pack.shard not in open_rows:
            open_rows.clear()  # one shard open at a time
            open_rows[pack.shard] = _ShardRows(index, index.shards[pack.shard], [*aux_ids, final_id])
        return _build_batch(pack, metas[pack.shard], open_rows[pack.shard], aux_ids, final_id, index.hidden_size,
                            settings.ttt_steps, _padded_length(pack.tokens, pad_to, fixed), batch_dtype,
                            device.type == "cuda")

    prefetch = _Prefetcher(jobs, make)
    verifier = None
    if settings.verify_shards:
        verifier = _Verifier(index, [s for i, s in enumerate(index.shards) if i % ddp.world == ddp.rank])
        verifier.start()

    writer = metrics_file = None
    if ddp.main:
        work_dir.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(work_dir / "metrics.jsonl", start)
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(work_dir / "tensorboard"), purge_step=start if start else None)
        metrics_file = open(work_dir / "metrics.jsonl", "a", encoding="utf-8")
    progress = None
    if ddp.main and settings.progress:
        from tqdm import tqdm

        progress = tqdm(total=sum(s.tokens for s in steps), initial=sum(s.tokens for s in steps[:start]),
                        unit="tok", unit_scale=True, desc="train_draft", mininterval=2.0)

    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16
                else contextlib.nullcontext())
    decay = torch.tensor([settings.ttt_decay ** j for j in range(settings.ttt_steps)], dtype=torch.float64)
    acc_stats = torch.zeros(settings.ttt_steps, 6, device=device, dtype=torch.float64)
    bad_step = torch.full((), -1, device=device, dtype=torch.long)
    last_good = str(ckpt_path) if ckpt_path is not None else None
    window_tokens, window_start, window_steps = 0, time.perf_counter(), 0
    tokens_done = sum(s.tokens for s in steps[:start])
    last_log: dict = {}
    started = time.perf_counter()
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def fetch() -> list[dict]:  # this rank's micro-batches of the next step, on their way to the device
        return _to_device([prefetch.get() for _ in range(settings.grad_accum_steps)], device, stream)

    upcoming = fetch() if start < total else []
    model.train()
    try:
        for s in range(start, total):
            step = steps[s]
            done = s + 1
            checkpoint_now = done % settings.checkpoint_every == 0 or done == total
            log_now = done % settings.log_every == 0 or checkpoint_now
            lr = _lr_at(s, settings, total)
            for g in optimizer.param_groups:
                g["lr"] = lr
            # loss = sum_j decay^j * (KL summed over the global batch's step-j positions) / their number;
            # DDP averages gradients over ranks, hence the factor world.
            weights = (decay / torch.from_numpy(np.maximum(step.counts, 1)) * ddp.world).to(torch.float32)
            weights = weights.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else weights
            micro = [dequantize_batch(b, batch_dtype) for b in _ready(upcoming, stream)]
            # the exact (whole-vocabulary) acceptance statistics only on the steps that log them
            step_loss, stats, grad_norm = train_step(model, optimizer, trainable, micro, settings.grad_accum_steps,
                                                     weights, max_grad_norm=settings.max_grad_norm,
                                                     autocast=autocast, world=ddp.world, exact=log_now)
            del micro
            upcoming = fetch() if done < total else []  # copies while this step computes
            acc_stats += stats
            bad = ~torch.isfinite(step_loss) | ~torch.isfinite(grad_norm)
            bad_step = torch.where((bad_step < 0) & bad, torch.full_like(bad_step, s + 1), bad_step)
            tokens_done += step.tokens
            window_tokens += step.tokens
            window_steps += 1
            if progress is not None:
                progress.update(step.tokens)
            if log_now:
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
                elapsed = time.perf_counter() - window_start
                summary = summarize(reduced.tolist())
                last_log = {"step": done, "epoch": step.epoch, "lr": lr, "tokens": tokens_done,
                            "tokens_per_s": window_tokens / max(elapsed, 1e-9),
                            "grad_norm": float(grad_norm), **summary}
                if ddp.main:
                    _log_metrics(metrics_file, writer, last_log)
                    if progress is not None:
                        progress.set_postfix(loss=_rounded(summary["loss"][0]), acc0=_rounded(summary["acc"][0]),
                                             tau=_rounded(summary["tau"]))
                acc_stats.zero_()
                window_tokens, window_start, window_steps = 0, time.perf_counter(), 0
            if checkpoint_now:
                if ddp.main:
                    state = {"format": CHECKPOINT_FORMAT, "fingerprint": fingerprint, "key": key, "step": done,
                             "epoch": step.epoch, "step_in_epoch": step.index + 1, "total_steps": total,
                             "tokens": tokens_done, "world_size": ddp.world, "settings": dataclasses.asdict(settings),
                             "metrics": last_log}
                    last_good = str(_save_checkpoint(ckpt_root, done, draft, optimizer, state,
                                                     settings.keep_checkpoints))
                if ddp.world > 1:
                    dist.barrier()
        if verifier is not None:  # a draft is never written from data that fails its checksums
            verifier.join()
            failed = torch.tensor([1.0 if verifier.error is not None else 0.0], device=device)
            if ddp.world > 1:
                dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if verifier.error is not None:
                raise verifier.error
            if failed.item():
                raise TrainingError("another training process found a corrupt hidden-state shard",
                                    where=str(index_path), fix="see that process's error in the log")
    finally:
        prefetch.close()
        if progress is not None:
            progress.close()
        if metrics_file is not None:
            metrics_file.close()
        if writer is not None:
            writer.close()

    result = {
        "steps": total, "tokens": tokens_done, "resumed_from_step": start, "resume": resume,
        "seconds": round(time.perf_counter() - started, 3), "world_size": ddp.world,
        "final": last_log or (ckpt_state or {}).get("metrics", {}),
        "draft_vocab_size": config.draft_vocab_size, "aux_layer_ids": config.aux_layer_ids,
        "checkpoint": last_good, "settings": dataclasses.asdict(settings),
    }
    if ddp.main:
        save_dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"
        save_speculators(draft, out_dir, dtype=save_dtype, extra_files={"training_summary.json": result})
        atomic_write_json(work_dir / "summary.json", result)
        log.info("draft written to %s: %d steps, %d tokens, step-0 accuracy %s, simulated tau %s", out_dir, total,
                 tokens_done, result["final"].get("acc", ["?"])[0], result["final"].get("tau"))
    if ddp.world > 1:
        dist.barrier()
    return result


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


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop log lines past the resumed step, so metrics.jsonl reads like one uninterrupted run."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in keep))


def _log_metrics(metrics_file, writer, entry: dict) -> None:
    metrics_file.write(json.dumps(entry) + "\n")
    metrics_file.flush()
    step = entry["step"]
    for key in ("lr", "tokens_per_s", "grad_norm", "tau"):
        if entry[key] is not None:
            writer.add_scalar(f"train/{key}", entry[key], step)
    for key in ("loss", "acc", "cond_acc", "joint_acc", "draft_vocab_acc"):
        for j, value in enumerate(entry[key]):
            if value is not None:
                writer.add_scalar(f"train/{key}_{j}", value, step)
    log.info("step %d: loss %s acc %s tau %s %.0f tok/s", step, _rounded(entry["loss"]), _rounded(entry["acc"]),
             _rounded(entry["tau"]), entry["tokens_per_s"])


def _rounded(x):
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return None if x is None else round(x, 4)


# ----------------------------------------------------------------------------------------------
# Entry points: the workflow rule, and torchrun's worker processes


def settings_from_dict(values: dict[str, Any]) -> TrainSettings:
    """TrainSettings from the workflow's ``train:`` section (unknown keys are a ConfigError)."""
    return settings_from(TrainSettings, values, "train")


LAUNCH_KEYS = ("devices", "nodes", "rdzv_port")  # train: keys that decide the processes, not the math


def settings_and_launch(values: dict[str, Any]) -> tuple[TrainSettings, dict[str, int]]:
    """The workflow's ``train:`` section split into TrainSettings and ``run_training``'s launch
    arguments (``devices``, ``nodes``, ``rdzv_port``)."""
    launch = {k: values[k] for k in LAUNCH_KEYS if k in values}
    return settings_from_dict({k: v for k, v in values.items() if k not in launch}), launch


# Task layouts the batch step exports (the SLURM profile's GPU jobs get --ntasks-per-gpu): srun
# reads them as options, and they contradict the one task per node a multi-node launch asks for.
_SLURM_TASK_LAYOUT = ("SLURM_NTASKS_PER_GPU", "SLURM_TRES_PER_TASK", "SLURM_NTASKS", "SLURM_NPROCS",
                      "SLURM_NTASKS_PER_NODE")


def launch_command(launch: Path, devices: int, nodes: int = 1, *, rdzv_port: int = 29400,
                   env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command, and its environment, that start training's processes: ``devices`` on each of
    ``nodes`` nodes.

    One node: ``torchrun --standalone``. Several: inside a SLURM allocation of that many nodes
    (the rule runs on its first node), ``srun`` starts one ``torchrun`` per node with ``devices``
    GPUs each, and they meet at a c10d rendezvous on this host named after the job.
    """
    env = dict(os.environ if env is None else env)
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={devices}"]
    module = ["-m", "draftsmith.train", str(launch)]
    if nodes == 1:
        return [*torchrun, "--standalone", *module], env
    job = env.get("SLURM_JOB_ID")
    if job is None:
        raise TrainingError(f"train.nodes is {nodes}, but this job is not a SLURM allocation",
                            where="train.nodes",
                            fix="run the workflow with --profile profiles/slurm and set nodes for train_draft "
                                "there to train.nodes (docs/cluster.md), or set train.nodes: 1")
    allocated = int(env.get("SLURM_JOB_NUM_NODES", "1"))
    if allocated < nodes:
        raise TrainingError(f"train.nodes is {nodes}, but SLURM job {job} has {allocated} node(s)",
                            where="train.nodes",
                            fix=f"give train_draft nodes: {nodes} in the profile's set-resources "
                                f"(or --set-resources train_draft:nodes={nodes})")
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", f"--gpus-per-node={devices}",
           "--kill-on-bad-exit=1", *torchrun, f"--nnodes={nodes}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint={socket.gethostname()}:{rdzv_port}", f"--rdzv_id=draftsmith-{job}", *module]
    return cmd, {k: v for k, v in env.items() if k not in _SLURM_TASK_LAYOUT}


def run_training(index_path: str | Path, mapping_path: str | Path, target_json: str | Path, out_dir: str | Path,
                 work_dir: str | Path, settings: TrainSettings, *, devices: int = 1, nodes: int = 1,
                 rdzv_port: int = 29400, log_path: str | Path | None = None,
                 metrics_out: str | Path | None = None, summary_out: str | Path | None = None) -> dict:
    """Train in this process, or with ``devices`` processes on each of ``nodes`` nodes (DDP;
    ``launch_command``); then copy the metrics and summary from the work dir to the rule's outputs."""
    work_dir = Path(work_dir)
    launch = work_dir / "launch.json"
    if devices * nodes > 1:  # a launch that cannot work stops before the store is read
        cmd, env = launch_command(launch, devices, nodes, rdzv_port=rdzv_port)
    if settings.verify_shards:
        # Every shard's checksums before any state is read (training reads them shuffled): a damaged
        # shard stops the run here, by name, and its part is queued for re-extraction.
        verify_store(index_path)
        settings = dataclasses.replace(settings, verify_shards=False)
    work_dir.mkdir(parents=True, exist_ok=True)
    args = {"index_path": str(index_path), "mapping_path": str(mapping_path), "target_json": str(target_json),
            "out_dir": str(out_dir), "work_dir": str(work_dir), "settings": dataclasses.asdict(settings)}
    if devices * nodes > 1:
        import subprocess

        atomic_write_json(launch, args)
        log.info("launching %s", " ".join(cmd))
        with open(log_path, "a", encoding="utf-8") if log_path else contextlib.nullcontext() as sink:
            code = subprocess.call(cmd, stdout=sink, stderr=subprocess.STDOUT if sink else None, env=env)
        if code != 0:
            raise TrainingError(f"{devices * nodes} training processes ({nodes} node(s)) exited with status {code}",
                                where=str(log_path or "stderr"),
                                fix="read the first traceback in the log; rerunning resumes from the last checkpoint")
        summary = read_json(work_dir / "summary.json")
    else:
        summary = train_draft(index_path, mapping_path, target_json, out_dir, work_dir, settings)
    if metrics_out is not None:
        source = work_dir / "metrics.jsonl"
        atomic_write_bytes(metrics_out, source.read_bytes() if source.exists() else b"")
    if summary_out is not None:
        atomic_write_json(summary_out, summary)
    # The draft is delivered: a later run of the rule (--forcerun, outputs removed) trains again
    # instead of resuming at the last step and re-saving this draft.
    atomic_write_json(work_dir / FINISHED, {"checkpoint": summary.get("checkpoint"), "steps": summary.get("steps")})
    return summary


def main(argv: list[str] | None = None) -> None:
    """``python -m draftsmith.train launch.json``: one torchrun worker."""
    from draftsmith.logs import setup_logging

    argv = sys.argv[1:] if argv is None else argv
    setup_logging(None)
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger().setLevel(logging.WARNING)
    args = read_json(argv[0])
    settings = TrainSettings(**args.pop("settings"))
    if int(os.environ.get("RANK", "0")) != 0:
        settings = dataclasses.replace(settings, progress=False)
    train_draft(settings=settings, **args)


if __name__ == "__main__":
    main()
