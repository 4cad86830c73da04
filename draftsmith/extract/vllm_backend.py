"""Capture hidden states with vLLM: prefill-only requests, forward hooks in the workers.

Each distinct sample is one request with ``max_tokens=1``, so the model runs exactly the prompt's
prefill (the one sampled token is never fed back). Prefix caching is off (a cached prefix is never
computed, so its rows would be missing) and so is chunked prefill (each prompt is computed whole in
one forward pass, which is how the workers recognise its rows: see
:mod:`draftsmith.extract.vllm_worker`); the token budget of a pass is at least ``max_model_len``.
vLLM must run eagerly (``enforce_eager=True``) so the Python hooks run as written. The workers
spool each pass's states to files in a shared-memory folder; this process maps them. For an fp8
store (``fp8=True``) the workers quantise the states on their device before they leave it, so the
spool and this process carry half the bytes and this process does no quantising.
``capture_stream`` runs the batches through the engine from a feeder thread, back to back, while
this thread maps the batch before, so the engine waits neither for the last passes to reach the
spool nor for what the caller does with the states, unless the caller falls more than a batch behind.

vLLM is imported only where an engine loads in this process (requests pass as plain data,
``draftsmith.engines.plain``), so this module, and a job attached to a warm engine, import without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from draftsmith.engines.shared import DEFAULT_TOKEN_BUDGET, SharedEngine, capture_engine_args
from draftsmith.engines.warm import open_llm
from draftsmith.errors import ExtractionError
from draftsmith.extract.backends import CaptureBackend
from draftsmith.extract.hidden_states import CapturedRows
from draftsmith.prefetch import Prefetcher
from draftsmith.targets.vllm_install import installed_vllm_version

log = logging.getLogger(__name__)

# the batches in flight: RUN_AHEAD + 2 as pass files (one mapped, the queued, the feeder's), and the
# mapped ones the store still holds (its queue and the one it writes); about 6 x 0.94 GB for Kimi-K2.5
# batches of 16,384 tokens in bf16. Containers often mount a 64 MiB /dev/shm.
SPOOL_MIN_FREE = 8 << 30
SPOOL_WAIT_S = 600  # a pass file the worker has not written by then means the worker is gone
RUN_AHEAD = 1  # computed batches queued beside the one the feeder holds: their passes wait in the spool


def spool_folder() -> str:
    """A fresh folder for the workers' captured passes: in shared memory where the machine has room."""
    shm = "/dev/shm"
    roomy = os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= SPOOL_MIN_FREE
    return tempfile.mkdtemp(prefix="draftsmith-capture-", dir=shm if roomy else None)


@dataclass
class _Ran:
    """A batch vLLM has computed; its pass files may still be on their way to the spool."""

    keys: list[tuple[int, ...]]  # the batch's samples, in order
    distinct: list[tuple[int, ...]]  # the prompts run, one per distinct sample
    result: dict[str, Any]  # the worker's draftsmith_collect answer


class VllmBackend(CaptureBackend):
    """Loads the target once in vLLM (or attaches to it warm); ``capture`` returns per sample
    {layer id: [len, hidden] CPU tensor, or ``Fp8Rows`` with ``fp8``}. With ``shared`` the engine
    is the one evaluation will serve the draft in (draftsmith.engines.shared)."""

    name = "vllm"
    _feeder: Prefetcher | None = None  # the open stream's engine feeder

    def __init__(self, model_path: str, capture_layer_ids: list[int], *, tensor_parallel_size: int = 1,
                 dtype: str = "bfloat16", max_model_len: int, trust_remote_code: bool = False,
                 layers_path: str | None = None, language_model_only: bool = True,
                 max_num_batched_tokens: int = DEFAULT_TOKEN_BUDGET, fp8: bool = False,
                 shared: SharedEngine | None = None, **llm_kwargs) -> None:
        self.layer_ids = sorted(set(int(i) for i in capture_layer_ids))
        self.max_model_len = int(max_model_len)
        if installed_vllm_version() is None:  # not imported here: a warm engine imports it
            raise ExtractionError("vLLM is not installed in this environment", where="extraction.backend",
                                  fix="install vLLM (envs/vllm.yaml) or use extraction.backend: hf")
        if os.environ.get("VLLM_USE_V1") == "0":
            raise ExtractionError("the vLLM backend needs the V1 engine", where="VLLM_USE_V1",
                                  fix="unset VLLM_USE_V1")
        if llm_kwargs.get("enable_expert_parallel") and tensor_parallel_size > 1:
            raise ExtractionError("expert parallelism with tensor_parallel_size > 1 splits the residual stream "
                                  "across ranks (sequence-parallel MoE); the capture hooks need every row",
                                  where="vLLM engine arguments", fix="leave enable_expert_parallel off for extraction")
        kwargs = capture_engine_args(model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                                     max_model_len=self.max_model_len, trust_remote_code=trust_remote_code,
                                     language_model_only=language_model_only,
                                     max_num_batched_tokens=max_num_batched_tokens, shared=shared, **llm_kwargs)
        budget = kwargs["max_num_batched_tokens"]
        # With VLLM_ENABLE_V1_MULTIPROCESSING=0 the CPU worker runs in this process and replaces
        # torch.set_num_threads with a no-op; close() puts it back.
        self._set_num_threads = torch.set_num_threads
        self.spool = spool_folder()
        role = ", with evaluation's speculator slot" if shared is not None else ""
        try:
            self.engine = open_llm(kwargs, set_num_threads=self._set_num_threads,
                                   speculator_slot=shared.speculator_slot if shared is not None else None,
                                   what=f"vLLM capture engine (TP {tensor_parallel_size}, eager{role})")
        except BaseException:
            shutil.rmtree(self.spool, ignore_errors=True)
            raise
        self.llm = self.engine.llm
        self.load_seconds = self.engine.load_seconds
        try:
            infos = self.llm.collective_rpc("draftsmith_install",
                                            args=(self.layer_ids, self.spool, layers_path, budget, fp8))
        except Exception as e:
            self.close()
            raise ExtractionError(f"cannot hook the decoder layers inside vLLM: {e}", where=str(model_path),
                                  fix="set target.layers_path to vLLM's module path of the decoder layers "
                                      "(e.g. language_model.model.layers)") from e
        self.info = infos[0]
        self.stalled_s = 0.0  # seconds the forward passes waited for the spool writer (the worker's count)
        log.info("vLLM %s %s; hooked %s (%d layers, hidden %d, %s) for layer ids %s%s",
                 "loaded" if self.engine.loaded else "attached to", model_path, self.info["layers_path"],
                 self.info["num_layers"], self.info["hidden_size"], self.info["runner"], self.layer_ids,
                 " as fp8, quantised on the device" if fp8 else "")

    def capture(self, batch: list[list[int]]) -> list[dict[int, CapturedRows]]:
        (states,) = self.capture_stream([batch])  # the whole stream: it ends with the spool drained
        return states

    def capture_stream(self, batches: Iterable[list[list[int]]]) -> Iterator[list[dict[int, CapturedRows]]]:
        """``capture`` for a stream of batches, in order. A feeder thread runs them through the engine
        back to back, up to ``RUN_AHEAD + 1`` computed batches ahead of the one mapped here (those queued
        and the one it holds): mapping a batch's passes, the caller's work on its states and freeing
        their memory overlap the engine's next batch instead of leaving it idle between two ``generate``
        calls; only a caller further behind makes it wait. An interrupt takes effect once the engine's
        current batch has run."""
        if self._feeder is not None and self._feeder.running():
            raise RuntimeError("a capture stream is still open on this engine: close it before starting another")
        drained = False  # every computed batch mapped: the spool holds nothing
        try:
            self._feeder = Prefetcher(((batch,) for batch in batches), self._run, RUN_AHEAD,
                                      name="draftsmith-capture-feeder")
            for ran in self._feeder:
                yield self._states(ran)
            drained = True
        finally:
            self._stop_feeder()
            if not drained and self.llm is not None:
                self._abandon()

    def _run(self, batch: list[list[int]]) -> _Ran:
        if not batch:
            return _Ran([], [], {"passes": [], "found": [], "error": None})
        for n, ids in enumerate(batch):
            if not 0 < len(ids) < self.max_model_len:
                raise ExtractionError(f"sample {n} of the batch has {len(ids)} tokens; the vLLM backend takes "
                                      f"1..{self.max_model_len - 1} (max_model_len minus the one sampled token)",
                                      where="extraction.max_model_len", fix="raise max_model_len or drop long samples")
        # Equal samples have equal states: each distinct prompt runs once.
        keys = [tuple(int(t) for t in ids) for ids in batch]
        distinct = list(dict.fromkeys(keys))
        self.llm.collective_rpc("draftsmith_expect", args=([list(p) for p in distinct],))
        self.llm.generate([list(p) for p in distinct], {"max_tokens": 1, "temperature": 0.0, "detokenize": False})
        result = next(r for r in self.llm.collective_rpc("draftsmith_collect") if r is not None)
        self.stalled_s = result["stalled_s"]
        return _Ran(keys, distinct, result)

    def _states(self, ran: _Ran) -> list[dict[int, CapturedRows]]:
        """Map a computed batch's pass files (waiting for any still being written) into its states."""
        from draftsmith.extract.vllm_worker import read_pass

        result, distinct = ran.result, ran.distinct
        try:
            passes = [read_pass(info, SPOOL_WAIT_S) for info in result["passes"]]
        except TimeoutError as e:
            raise ExtractionError(f"vLLM capture failed: {e}", where=self.spool,
                                  fix="the vLLM engine's log (above) says why its worker stopped") from e
        except OSError as e:
            raise ExtractionError(f"vLLM capture failed: {e}", where=self.spool,
                                  fix="check the free space of the spool folder's file system") from e
        if result["error"]:
            raise ExtractionError(f"vLLM capture failed: {result['error']}", where="vLLM backend")
        states = {}
        for index, prompt in enumerate(distinct):
            where = result["found"][index]
            if where is None:
                raise ExtractionError(f"vLLM computed no forward pass holding the whole prompt of {len(prompt)} "
                                      "tokens (prefix caching and chunked prefill must stay off)",
                                      where="vLLM backend", fix="do not pass enable_prefix_caching or "
                                      "enable_chunked_prefill to the extraction engine")
            number, row0, row1 = where
            rows = passes[number][:, row0:row1]
            states[prompt] = {lid: rows[k] for k, lid in enumerate(self.layer_ids)}
        return [states[key] for key in ran.keys]

    def _stop_feeder(self) -> None:
        """Stop the feeder and wait for its batch in the engine to end: the engine serves one caller
        at a time, and nothing may still be on its way into the spool when it is reset or emptied."""
        if self._feeder is not None:
            self._feeder.close()

    def _abandon(self) -> None:
        """Drop what the spool holds or is still receiving: the worker finishes its queued passes
        and forgets the batch, then the files go."""
        self.llm.collective_rpc("draftsmith_reset")
        for name in os.listdir(self.spool):
            os.unlink(os.path.join(self.spool, name))

    def close(self) -> None:
        if getattr(self, "stalled_s", 0) > 1:
            log.info("vLLM capture: forward passes waited %.1f s in all for the spool (%s) to take their states",
                     self.stalled_s, self.spool)
        self._stop_feeder()  # a stream left open, or interrupted twice, has not stopped it
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            with contextlib.suppress(Exception):  # a dead engine cannot answer, and has no writer left
                llm.collective_rpc("draftsmith_reset")  # no pass may still be on its way into the spool
            self.engine.close()
        if getattr(self, "spool", None):
            shutil.rmtree(self.spool, ignore_errors=True)
