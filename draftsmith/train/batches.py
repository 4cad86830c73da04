"""Micro-batches from the shard store: plan the run from shard metadata alone (identically on
every rank), pack samples best-fit into batches of ``batch_tokens`` positions, build each batch
from the rows the store reads, and prefetch them on a thread and a side CUDA stream."""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from draftsmith.errors import TrainingError
from draftsmith.extract.hidden_states import HiddenStateIndex, ShardInfo, ShardRows, dequantize_fp8, read_shard
from draftsmith.io import file_matches
from draftsmith.prefetch import Prefetcher
from draftsmith.train.objective import scored_positions
from draftsmith.train.settings import TrainSettings

PAD_MULTIPLE = 128  # flex attention's block size: padded batches keep one compiled shape


@dataclass
class ShardMeta:
    """Per usable sample of one shard: first row, shifted length, loss tokens per TTT step."""

    starts: np.ndarray  # int64 [n]: row of the sample's first token in the shard
    lengths: np.ndarray  # int64 [n]: positions after the shift (n_tokens - 1, capped)
    counts: np.ndarray  # int64 [n, K]: loss positions valid at step j
    loss_on: str  # train.loss_on, which ``scored_mask`` applies to each sample's loss mask


def scored_mask(loss_mask, loss_on: str):
    """The positions the loss scores (``train.loss_on``): the data's loss mask ("answers"), or every
    position ("all"), as the same kind of array (numpy or torch) as ``loss_mask``."""
    if loss_on == "answers":
        return loss_mask
    return np.ones_like(loss_mask) if isinstance(loss_mask, np.ndarray) else torch.ones_like(loss_mask)


def shard_meta(index: HiddenStateIndex, shard: ShardInfo, settings: TrainSettings) -> ShardMeta:
    """The metadata of a shard on disk, from its tokens file."""
    data = read_shard(index, shard, layer_ids=[], verify=settings.verify_shards)
    return tokens_meta(data.offsets.numpy(), data.loss_mask.numpy(), settings.batch_tokens, settings.ttt_steps,
                       settings.loss_on)


def tokens_meta(offsets: np.ndarray, loss_mask: np.ndarray, cap: int, ttt_steps: int, loss_on: str) -> ShardMeta:
    """The metadata of a shard's samples from their offsets [n+1] and flat loss mask [T]: what a
    shard on disk says, and what online training computes before the shard exists."""
    offsets = np.asarray(offsets).astype(np.int64)
    starts, ends = offsets[:-1], offsets[1:]
    lengths = np.minimum(ends - starts - 1, cap)
    keep = lengths >= 1
    starts, lengths = starts[keep], lengths[keep]
    cs = np.concatenate([[0], np.cumsum(scored_mask(np.asarray(loss_mask).astype(np.int64), loss_on))])
    counts = np.zeros((len(starts), ttt_steps), dtype=np.int64)
    for j in range(ttt_steps):
        # shifted positions t+j for t in [0, m-j) are rows start+1+j .. start+m
        lo = np.minimum(starts + 1 + j, starts + 1 + lengths)
        counts[:, j] = cs[starts + 1 + lengths] - cs[lo]
    return ShardMeta(starts, lengths, counts, loss_on)


@dataclass(frozen=True)
class Pack:
    members: tuple[tuple[int, int], ...]  # (shard's position in index.shards, sample position in its ShardMeta)
    tokens: int
    counts: tuple[int, ...]  # loss positions per TTT step
    dummy: bool = False  # fills the last global batch; carries no loss
    group: int = 0  # the epoch's group of shards whose samples are mixed

    @property
    def shards(self) -> list[int]:
        return sorted({shard for shard, _ in self.members})


PACKINGS = ("shuffled", "best_fit")


def plan_epoch(metas: list[ShardMeta], cap: int, seed: int, epoch: int, mix_shards: int, packing: str) -> list[Pack]:
    """The epoch's micro-batches: shards in a seeded order, in groups of ``mix_shards``; each group's
    samples packed into batches of at most ``cap`` positions, the group's batches in a seeded order.
    Depends on nothing but data and seed.

    Extraction sorts samples by length before it cuts shards, so each shard holds one band of
    lengths (and often one kind of sample). ``shuffled`` packs the group's samples, all its shards
    together, consecutively in a seeded shuffle (as speculators packs): each batch is a random mix
    of lengths. ``best_fit`` packs each shard best-fit-decreasing (the least padding): each batch
    holds samples of one band, and the last batch of each shard is a part-filled one."""
    if packing not in PACKINGS:
        raise TrainingError(f"unknown packing {packing!r}", where="config key train.packing",
                            fix="use one of " + ", ".join(PACKINGS))
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(metas))
    packs: list[Pack] = []
    for group, first in enumerate(range(0, len(order), mix_shards)):
        shards = [int(s) for s in order[first:first + mix_shards]]
        if packing == "shuffled":
            mixed = _pack_shuffled(metas, shards, group, cap, rng)
        else:
            mixed = [pack for s in shards for pack in _pack_best_fit(metas, s, group, cap, rng)]
        packs += [mixed[b] for b in rng.permutation(len(mixed))]
    return packs


def _pack(metas: list[ShardMeta], members: list[tuple[int, int]], group: int) -> Pack:
    members = sorted(members)  # rows read in store order
    lengths = sum(int(metas[s].lengths[i]) for s, i in members)
    counts = np.sum([metas[s].counts[i] for s, i in members], axis=0)
    return Pack(tuple(members), lengths, tuple(int(c) for c in counts), group=group)


def _pack_shuffled(metas: list[ShardMeta], shards: list[int], group: int, cap: int,
                   rng: np.random.Generator) -> list[Pack]:
    """The samples of ``shards`` in a seeded shuffle, cut into consecutive runs of at most ``cap`` positions."""
    members = [(s, i) for s in shards for i in range(len(metas[s].lengths))]
    packs, current, used = [], [], 0
    for k in rng.permutation(len(members)):
        shard, i = members[k]
        need = int(metas[shard].lengths[i])
        if current and used + need > cap:
            packs.append(_pack(metas, current, group))
            current, used = [], 0
        current.append((shard, i))
        used += need
    if current:
        packs.append(_pack(metas, current, group))
    return packs


def _pack_best_fit(metas: list[ShardMeta], shard: int, group: int, cap: int, rng: np.random.Generator) -> list[Pack]:
    """One shard's samples packed best-fit-decreasing (ties in seeded order) into batches of at most ``cap``."""
    meta = metas[shard]
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
    return [_pack(metas, [(shard, i) for i in members], group) for members in bins]


@dataclass
class Step:
    epoch: int
    index: int  # step within the epoch
    packs: list[Pack]  # the global batch: world_size * grad_accum micro-batches
    counts: np.ndarray  # loss positions per TTT step over the global batch
    tokens: int


def step_group(settings: TrainSettings, processes: int) -> int:
    """Micro-batches in one optimizer step: each of the ``processes`` takes ``grad_accum_steps``."""
    return processes * settings.grad_accum_steps


def plan_steps(metas: list[ShardMeta], settings: TrainSettings, processes: int) -> list[Step]:
    """Every optimizer step of a run by ``processes`` training processes, from shard metadata alone:
    the one plan offline training, online training and online training's producer all follow."""
    group = step_group(settings, processes)
    steps: list[Step] = []
    num_epochs = math.ceil(settings.epochs)
    for epoch in range(num_epochs):
        packs = plan_epoch(metas, settings.batch_tokens, settings.seed, epoch, settings.mix_shards, settings.packing)
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
            steps.append(Step(epoch, i, chunk, counts, sum(p.tokens for p in real)))
            if settings.max_steps is not None and len(steps) >= settings.max_steps:
                return steps
    return steps


def plan_summary(steps: list[Step], settings: TrainSettings, store_tokens: int) -> str:
    """Where the plan's step count comes from, for the messages that ask to change it."""
    per_epoch = sorted(collections.Counter(step.epoch for step in steps).values())
    each = f"{per_epoch[0]}" if per_epoch[0] == per_epoch[-1] else f"{per_epoch[0]} to {per_epoch[-1]}"
    text = (f"{len(steps)} optimizer steps: {settings.epochs:g} epoch(s) (train.epochs) of {each} steps over the "
            f"{store_tokens:,}-token store, in micro-batches of up to train.batch_tokens={settings.batch_tokens} "
            f"positions, {len(steps[0].packs)} per step")
    if settings.max_steps is not None and len(steps) == settings.max_steps:
        text += f", cut at train.max_steps={settings.max_steps}"
    return text


def batch_positions(steps: list[Step], device: torch.device) -> int:
    """Positions of the plan's largest micro-batch as ``device`` computes it: never more than
    train.batch_tokens, nor than one mixed group's samples (a sample is never split, a batch never
    spans groups). On GPU every batch is padded to it, rounded up to PAD_MULTIPLE: one compiled
    shape, and no padding past what a batch can hold."""
    largest = max(pack.tokens for step in steps for pack in step.packs)
    return -(-largest // PAD_MULTIPLE) * PAD_MULTIPLE if device.type == "cuda" else largest


def _padded_length(tokens: int, pad_to: int, fixed: int | None) -> int:
    if fixed is not None:
        return fixed
    return max(tokens, 1) if pad_to <= 1 else -(-tokens // pad_to) * pad_to


def build_batch(pack: Pack, metas: list[ShardMeta], open_rows: dict[int, ShardRows], aux_ids: list[int],
                final_id: int, hidden: int, ttt_steps: int, t_pad: int, dtype: torch.dtype, pin: bool) -> dict:
    """Pack the samples into ``t_pad`` rows: aux [T, A*H], final [T, H], step 0's token ids [T] (step
    j reads them shifted by j, ``TTTObjective.unroll``), per-step valid masks [K, T], positions,
    document ids (padding rows form one extra document), and the gather indices of
    ``scored_positions``. ``open_rows`` holds the pack's shards' rows."""
    total = pack.tokens
    # fp8 stores travel as fp8 plus per-token scales and are dequantised on the device
    # (``dequantize_batch``): half the bytes over PCIe, and no slow CPU float8 conversion.
    fp8 = open_rows[pack.members[0][0]].fp8
    store_dtype = torch.float8_e4m3fn if fp8 else dtype
    aux = torch.zeros(t_pad, len(aux_ids) * hidden, dtype=store_dtype)
    final = torch.zeros(t_pad, hidden, dtype=store_dtype)
    scales = torch.zeros(t_pad, len(aux_ids) + 1) if fp8 else None  # aux layers, then final
    ids = torch.zeros(t_pad, dtype=torch.long)
    valid = torch.zeros(ttt_steps, t_pad, dtype=torch.bool)
    pos = torch.zeros(t_pad, dtype=torch.long)
    doc = torch.full((t_pad,), len(pack.members), dtype=torch.int32)  # padding: one extra document
    o = 0
    for d, (shard, i) in enumerate(pack.members):
        meta, rows = metas[shard], open_rows[shard]
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
        sample_loss = scored_mask(rows.loss_mask[s + 1:s + 1 + m], meta.loss_on)
        if not pack.dummy:
            for j in range(min(ttt_steps, m)):
                valid[j, o:o + m - j] = sample_loss[j:]
        ids[o:o + m] = rows.input_ids[s + 1:s + 1 + m]
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


PREFETCH_DEPTH = 2  # micro-batches queued ahead of the step that computes
# Steps ahead of the computing one whose shards the feed may read: the queued micro-batches and the
# one being built (the online window keeps room for them, draftsmith.online.plan).
PREFETCH_AHEAD_STEPS = PREFETCH_DEPTH + 1


def noise_seed(seed: int, epoch: int, pack: Pack) -> int:
    """The seed of a micro-batch's feature noise (``train.feature_noise``): from the run's seed, the
    epoch and the pack's first sample, so a resumed run or another process count draws the same."""
    return int(np.random.SeedSequence([seed, epoch, *pack.members[0]]).generate_state(1)[0])


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


class ShardVerifier(threading.Thread):
    """Checks the checksums of the state files of this rank's share of the shards, beside training."""

    def __init__(self, index: HiddenStateIndex, shards: list[ShardInfo]) -> None:
        super().__init__(daemon=True)
        self.index, self.shards, self.error = index, shards, None

    def run(self) -> None:
        for shard in self.shards:
            for name, digest in shard.checksums.items():
                path = self.index.root / shard.path / name
                if not file_matches(path, digest):
                    self.error = TrainingError(
                        f"checksum mismatch: part {shard.part} shard {shard.shard} file {name} is corrupt",
                        where=str(path), fix="rerun the workflow: extraction regenerates damaged shards")
                    return


def plan_run(index: HiddenStateIndex, settings: TrainSettings, processes: int, index_path: Path,
             metas: list[ShardMeta] | None = None) -> tuple[list[ShardMeta], list[Step]]:
    """Every optimizer step of the run, from shard metadata alone (cheap), identically on every rank
    (``plan_steps``). ``metas`` are given
    when the shards are not on disk yet (online training)."""
    if metas is None:
        metas = [shard_meta(index, s, settings) for s in index.shards]
    steps = plan_steps(metas, settings, processes)
    if not steps:
        raise TrainingError("the hidden states hold no sample with at least 2 tokens", where=str(index_path),
                            fix="check the dataset stage: every training sample needs a prompt and a reply")
    return metas, steps


class StateSource(Protocol):
    """Where the shards come from while training, when they are not all on disk (online training)."""

    index: HiddenStateIndex  # the shards the run will read, with their counts (no checksums)
    fingerprint: str  # what the states are made from: the checkpoint key's ``index`` part

    def metas(self, settings: TrainSettings) -> list[ShardMeta]: ...

    def start(self, steps: list[Step], start: int, main: bool) -> None: ...

    def before_read(self, shard: int) -> None: ...

    def step_done(self, done: int) -> None: ...


class BatchFeed:
    """This rank's micro-batches of ``steps``, in order: built on a thread from the open shards of
    one mixed group (``plan_epoch``) at a time, then copied to the device while the previous step
    computes. With a ``source``, each shard is waited for before it is opened."""

    def __init__(self, index: HiddenStateIndex, metas: list[ShardMeta], steps: list[Step], settings: TrainSettings,
                 *, rank: int, device: torch.device, attention: str, dtype: torch.dtype, positions: int,
                 source: StateSource | None = None) -> None:
        self.index, self.metas, self.settings, self.device, self.dtype = index, metas, settings, device, dtype
        self.source = source
        self.aux_ids, self.final_id = list(index.aux_layer_ids), index.final_layer_id
        # On GPU every batch has the same padded length, ``positions`` (``batch_positions`` of the whole
        # run, so a resumed run has it too): the compiled step, the compiled flex kernel and its block
        # mask are built once.
        self.pad_to = PAD_MULTIPLE if attention == "flex" else 1
        self.fixed = positions if device.type == "cuda" else None
        self.open_rows: dict[int, ShardRows] = {}
        self.open_group: tuple[int, int] | None = None
        accum = settings.grad_accum_steps
        jobs = [(step.packs[rank * accum + a], step.epoch) for step in steps for a in range(accum)]
        self.prefetch = Prefetcher(jobs, self._make, PREFETCH_DEPTH, name="draftsmith-batches")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _make(self, pack: Pack, epoch: int) -> dict:
        if (epoch, pack.group) != self.open_group:  # the shards of one mixed group open at a time
            self.open_rows.clear()
            self.open_group = (epoch, pack.group)
        for shard in pack.shards:
            if shard not in self.open_rows:
                if self.source is not None:
                    self.source.before_read(shard)
                self.open_rows[shard] = ShardRows(self.index, self.index.shards[shard], [*self.aux_ids, self.final_id])
        batch = build_batch(pack, self.metas, self.open_rows, self.aux_ids, self.final_id, self.index.hidden_size,
                            self.settings.ttt_steps, _padded_length(pack.tokens, self.pad_to, self.fixed), self.dtype,
                            self.device.type == "cuda")
        batch["noise_seed"] = noise_seed(self.settings.seed, epoch, pack)
        return batch

    def fetch(self) -> list[dict]:
        """The next step's micro-batches, on their way to the device."""
        return _to_device([self.prefetch.get() for _ in range(self.settings.grad_accum_steps)], self.device,
                          self.stream)

    def ready(self, batches: list[dict]) -> list[dict]:
        """``fetch``'s batches once copied, fp8 states dequantised: what the step computes on."""
        return [dequantize_batch(b, self.dtype) for b in _ready(batches, self.stream)]

    def close(self) -> None:
        # not waiting: an online run's batch may wait for a shard its producer will never write
        self.prefetch.close(wait=False)
