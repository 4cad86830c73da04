"""Capturing a part's shards: load the target under a backend, run its batches, and write each
batch into its shard on a writer thread while the backend computes the next one.

The planning of parts, shards and batches and the part's resume are in ``draftsmith.extract.extract``;
the shard format in ``draftsmith.extract.hidden_states`` and ``draftsmith.extract.shard_writer``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from draftsmith.engines.shared import SharedEngine
from draftsmith.errors import DraftsmithError, ExtractionError, StorageError
from draftsmith.extract.backends import CaptureBackend
from draftsmith.extract.hidden_states import STORAGE_DTYPES, CapturedRows, Fp8Rows, ShardInfo, quantize_fp8
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.extract.shard_writer import PartStore, ShardWriter
from draftsmith.io import storage_error
from draftsmith.settings import BACKENDS

log = logging.getLogger(__name__)


def plan_batches(shard: Sequence[dict], batch_tokens: int) -> list[list[dict]]:
    """Consecutive runs of the shard's samples, each at most ``batch_tokens`` padded tokens
    (a sample longer than that forms a batch of its own)."""
    batches, current, longest = [], [], 0
    for sample in shard:
        length = len(sample["input_ids"])
        if current and (len(current) + 1) * max(longest, length) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(sample)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


# ---------------------------------------------------------------------------------------------
# Backends


def make_backend(target_info: dict, settings: ExtractionSettings, longest_sample: int, *,
                 shared: SharedEngine | None = None) -> CaptureBackend:
    """Load the target under ``settings.backend`` (``hf`` or ``vllm``), hooked for the captured
    layers, for samples of up to ``longest_sample`` tokens."""
    from draftsmith.engines.hf_model import resolve_device, stage_model_dtype

    layer_ids = target_info["captured_layer_ids"]
    trust = bool(target_info.get("trust_remote_code", False))
    device = resolve_device(settings.device)
    # An fp8 store's rows are quantised where the target runs: half the bytes leave the device,
    # and this process's CPU does no quantising.
    fp8 = settings.dtype == "fp8"
    name, dtype = settings.backend, stage_model_dtype(settings)  # the dtype the part's fingerprint names
    if name == "hf":
        from draftsmith.extract.hf_backend import HfBackend

        return HfBackend.load(
            target_info["model_path"], layers_path=target_info["layers_path"], capture_layer_ids=layer_ids,
            final_layer_id=target_info["final_layer_id"], lm_head_path=target_info.get("lm_head_path"),
            dtype=dtype, device=device,
            device_map=settings.device_map, trust_remote_code=trust,
            fp8=fp8, logit_transform=target_info.get("logit_transform"))
    if name == "vllm":
        support = (target_info.get("backends") or {}).get("vllm") or {}
        if support and not support.get("supported"):
            raise ExtractionError(f"the vLLM backend cannot capture this target: {support.get('reason')}",
                                  where="target.json backends.vllm",
                                  fix=support.get("fix") or "use extraction.backend: hf")
        from draftsmith.extract.vllm_backend import VllmBackend

        return VllmBackend(
            target_info["model_path"], layer_ids, tensor_parallel_size=settings.tensor_parallel_size,
            dtype=dtype,
            # vLLM samples one token after each prompt: the context must hold the longest sample plus one.
            max_model_len=settings.max_model_len or longest_sample + 1,
            trust_remote_code=trust, layers_path=target_info["layers_path"], fp8=fp8, shared=shared)
    raise ExtractionError(f"unknown extraction backend {name!r}", where="extraction.backend",
                          fix=f"use one of {', '.join(BACKENDS)}")


def capture_batches(backend: CaptureBackend, batches: Iterable[list[list[int]]]
                    ) -> Iterator[list[dict[int, CapturedRows]]]:
    """The backend's results batch by batch; pipelined where the backend runs ahead (``capture_stream``)."""
    stream = getattr(backend, "capture_stream", None)
    if stream is not None:
        yield from stream(batches)
    else:
        for batch in batches:
            yield backend.capture(batch)


# ---------------------------------------------------------------------------------------------
# Writing


def check_states(sample_ids: Sequence[str], states: Sequence[dict[int, CapturedRows]], where: str,
                 storage: str = "bfloat16") -> None:
    """Stop on NaN/Inf anywhere (also values the storage dtype cannot hold), or on a sample whose
    states at a layer are all zero. Rows already in fp8 are checked by their scales: NaN or Inf
    makes a row's scale non-finite, and only a row within 1e-12 of zero has the quantiser's floor
    scale (its values then decide)."""
    limit = torch.finfo(STORAGE_DTYPES[storage]).max if storage != "fp8" else math.inf  # fp8: scaled per token
    for sample_id, layers in zip(sample_ids, states, strict=True):
        for layer_id, rows in sorted(layers.items()):
            bad, zero = _check_fp8(rows) if isinstance(rows, Fp8Rows) else _check_tensor(rows, limit)
            if bad is not None:
                raise ExtractionError(
                    f"sample {sample_id!r}: layer {layer_id} states hold NaN or Inf, or values beyond "
                    f"{storage}'s range (first at token {bad})",
                    where=where, fix="with extraction.dtype: float16, large states overflow: use bfloat16; "
                                     "otherwise run the target in bfloat16 or float32 (target.dtype) and check "
                                     "that its weights load correctly")
            if zero:
                raise ExtractionError(
                    f"sample {sample_id!r}: layer {layer_id} states are all zero", where=where,
                    fix="the capture hook took the wrong tensor or the weights did not load; "
                        "check target.json layers_path and the model folder")


def _check_tensor(rows: torch.Tensor, limit: float) -> tuple[int | None, bool]:
    """The first token holding NaN/Inf or a value beyond ``limit`` (None if none), and whether all are zero."""
    low, high = torch.aminmax(rows)  # NaN propagates; cheap even on CPU
    if not (torch.isfinite(low) and torch.isfinite(high) and max(-low, high) <= limit):
        return (~torch.isfinite(rows) | (rows.abs() > limit)).any(dim=-1).nonzero()[0].item(), False
    return None, bool(low == 0 and high == 0)


_FP8_ZERO_SCALE = quantize_fp8(torch.zeros(1, 1))[1].item()  # the quantiser's scale of an all-zero row


def _check_fp8(rows: Fp8Rows) -> tuple[int | None, bool]:
    """``_check_tensor`` for rows already in fp8: a pass over their scales, over the values only
    when every scale is at the floor."""
    finite = torch.isfinite(rows.scales)
    if not finite.all():
        return (~finite).nonzero()[0].item(), False
    return None, bool(rows.scales.max() <= _FP8_ZERO_SCALE) and not rows.values.float().any()


@dataclass
class _BatchJob:
    number: int  # the shard it belongs to
    samples: list[dict]  # the batch's samples, consecutive in the shard
    states: list[dict[int, CapturedRows]]  # per sample: layer id -> [length, hidden] as captured


class _StoreThread:
    """A background thread that checks each captured batch and appends it to its shard's files,
    committing a shard when its last batch is in; at most ``max_pending`` batches wait."""

    def __init__(self, store: PartStore, shards: dict[int, list[dict]], max_pending: int = 2) -> None:
        self.store, self.shards = store, shards
        self.written: list[ShardInfo] = []
        self._open: ShardWriter | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._abort = False
        self.busy_s = 0.0  # checking and writing batches
        self.waited_s = 0.0  # the capture side blocked on a full queue
        self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-check")
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._thread.start()

    def submit(self, job: _BatchJob) -> None:
        started = time.perf_counter()
        while True:
            self._raise_error()
            try:
                self._queue.put(job, timeout=0.2)
                break
            except queue.Full:
                continue
        self.waited_s += time.perf_counter() - started

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                break
            if self._error is not None or self._abort:
                continue
            started = time.perf_counter()
            try:
                self._write(job)
            except BaseException as e:  # handed to the main thread, which raises it
                self._error = e
            self.busy_s += time.perf_counter() - started
        self._checker.shutdown()
        if self._open is not None:  # an unfinished shard (error or abort): no trace of it stays
            self._open.abort()
            self._open = None

    def _write(self, job: _BatchJob) -> None:
        where = f"part {self.store.part} shard {job.number}"
        samples = self.shards[job.number]
        try:
            if self._open is None:
                self._open = self.store.open_shard(job.number, sum(len(s["input_ids"]) for s in samples))
            # Outside fp8 the check reads every value (about 8.6 CPU seconds of a 30-s bf16 run of 1M
            # tokens, docs/benchmarks.md): it runs beside the batch's write, not before it, and a bad
            # batch still stops before its shard can commit.
            checked = self._checker.submit(check_states, [s["id"] for s in job.samples], job.states, where=where,
                                           storage=self.store.meta["dtype"])
            # Each sample's rows are written as they are (views of the backend's batch buffer): no copy.
            self._open.append({i: [s[i] for s in job.states] for i in self.store.layer_ids})
            checked.result()
            if self._open.rows < self._open.num_tokens:
                return
            shard, self._open = self._open, None
            info = shard.commit([s["id"] for s in samples], [s["input_ids"] for s in samples],
                                [s["loss_mask"] for s in samples])
        except OSError as e:
            if isinstance(e, DraftsmithError):  # already says what, where and how to fix
                raise
            raise StorageError(f"writing {where} failed: {e.strerror or e}", where=str(self.store.dir),
                               fix=storage_error(self.store.dir, e).fix, errno=e.errno) from e
        self.written.append(info)
        log.debug("part %d shard %d written: %d samples, %d tokens", info.part, info.shard, info.num_samples,
                  info.num_tokens)

    def close(self, abort: bool = False) -> None:
        """Wait for the queued batches to be written (or drop them with ``abort``) and stop."""
        self._abort = self._abort or abort
        self._queue.put(None)
        self._thread.join()
        if not abort:
            self._raise_error()


def _check_shapes(backend: str, store: PartStore, shard: int, batch: list[dict],
                  captured: list[dict[int, CapturedRows]]) -> None:
    """Stop when the backend returned other samples, layers or shapes than the batch asked for."""
    where, hidden = f"part {store.part} shard {shard}", store.meta["hidden_size"]
    if len(captured) != len(batch):
        raise ExtractionError(f"the {backend} backend returned {len(captured)} results for a batch "
                              f"of {len(batch)} samples", where=where)
    for sample, states in zip(batch, captured):
        length = len(sample["input_ids"])
        if sorted(states) != store.layer_ids:
            raise ExtractionError(f"the {backend} backend returned layers {sorted(states)} for sample "
                                  f"{sample['id']!r}, expected {store.layer_ids}", where=where)
        for layer_id, tensor in states.items():
            if tensor.shape != (length, hidden):
                raise ExtractionError(
                    f"the {backend} backend returned layer {layer_id} states of shape {tuple(tensor.shape)} "
                    f"for sample {sample['id']!r} of {length} tokens (expected ({length}, {hidden}))", where=where)
            if isinstance(tensor, Fp8Rows) and (tensor.scales.shape != (length,) or tensor.scales.dtype != torch.float32
                                                or tensor.values.dtype != torch.float8_e4m3fn):
                raise ExtractionError(
                    f"the {backend} backend returned layer {layer_id} fp8 rows for sample {sample['id']!r} as "
                    f"{tensor.values.dtype} values with {tensor.scales.dtype} scales of shape "
                    f"{tuple(tensor.scales.shape)} (expected float8_e4m3fn values and float32 scales of shape "
                    f"({length},))", where=where)


def extract_shards(backend: CaptureBackend, store: PartStore, todo: Sequence[tuple[int, list[dict]]],
                   *, batch_tokens: int, max_pending: int = 2, progress=None) -> list[ShardInfo]:
    """Capture and store the listed (shard number, samples) shards; returns their infos in order.

    Each batch's states go to the writer thread as they come back and are appended to the
    shard's files there, while the backend computes the next batch: the disk works alongside
    the accelerator, and a shard's end costs only its last batch's write and the syncs.
    """
    jobs = [(number, batch) for number, samples in todo for batch in plan_batches(samples, batch_tokens)]
    writer = _StoreThread(store, dict(todo), max_pending=max_pending)
    inputs = ([s["input_ids"] for s in batch] for _, batch in jobs)
    ok, started = False, time.perf_counter()
    try:
        # closed on any error, so a pipelined backend drops what it still has in flight at once
        with contextlib.closing(capture_batches(backend, inputs)) as results:
            for (number, batch), captured in zip(jobs, results, strict=True):
                _check_shapes(backend.name, store, number, batch, captured)
                writer.submit(_BatchJob(number, batch, captured))
                if progress is not None:
                    progress(len(batch), sum(len(s["input_ids"]) for s in batch))
        ok = True
    finally:
        captured_at = time.perf_counter()
        writer.close(abort=not ok)
    # Which side sets the pace: a store busy most of the run, with the capture waiting on it,
    # means the disk or the writer's CPU, not the engine, bounds extraction.
    log.info("part %d: %d batches in %.1f s; the store was busy %.1f s, the capture waited %.1f s for it, "
             "and the store finished %.1f s after the last batch came", store.part, len(jobs),
             time.perf_counter() - started, writer.busy_s, writer.waited_s, time.perf_counter() - captured_at)
    return sorted(writer.written, key=lambda s: s.shard)
