"""The engine's side of the window, in a process of its own: make the shards in the order training
reads them, waiting while the window is full (``python -m draftsmith.online.producer spec.json``).

It starts where training resumes (``progress.json``, written by the trainer once it has found its
checkpoint), skips shards already complete in the window, and ends when its parent does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from draftsmith.engines.hf_model import stage_model_dtype
from draftsmith.extract.capture import extract_shards, make_backend
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.extract.shard_writer import PartStore
from draftsmith.io import atomic_write_json, read_json
from draftsmith.online.plan import PART, OnlinePlan, OnlineSettings, Unit
from draftsmith.online.window import POLL_S, PRODUCER_STATS, WAIT_LOG_S, present_shards, read_progress
from draftsmith.settings import PROGRESS_INTERVAL_S
from draftsmith.train.batches import plan_steps
from draftsmith.train.settings import TrainSettings

log = logging.getLogger(__name__)


class ParentGone(Exception):
    """The training job that started this producer has ended: nothing will read what it makes."""


class Producer:
    def __init__(self, spec: dict) -> None:
        from draftsmith.targets.inspect import read_target_json

        self.target_info = read_target_json(spec["target_json"])
        self.extraction = ExtractionSettings(**spec["extraction"])
        self.online = OnlineSettings(**spec["online"])
        self.plan = OnlinePlan.build(spec["train_jsonl"], self.target_info, spec["window"], self.extraction,
                                     self.online)
        settings = TrainSettings(**spec["train"])
        steps = plan_steps(self.plan.metas(settings), settings, spec["processes"])
        self.units = self.plan.units(steps)
        self.store = PartStore(self.plan.window, PART, fingerprint=self.plan.fingerprint, dtype=self.extraction.dtype,
                               hidden_size=self.target_info["hidden_size"],
                               layer_ids=self.target_info["captured_layer_ids"],
                               model_dtype=stage_model_dtype(self.extraction),
                               read_soon=True)  # the trainer reads each shard from the page cache
        self.parent = os.getppid()
        self.peak = 0
        self.made = self.made_tokens = 0

    def _check_parent(self) -> None:
        if os.getppid() != self.parent:
            raise ParentGone

    def _wait(self, ready, what: str) -> None:
        started = logged = time.monotonic()
        while not ready():
            self._check_parent()
            now = time.monotonic()
            if now - logged >= WAIT_LOG_S:
                log.info("producer: waiting %.0f s for %s", now - started, what)
                logged = now
            time.sleep(POLL_S)

    def _window_tokens(self) -> int:
        return sum(self.plan.tokens(n) for n in present_shards(self.plan) if n not in self.plan.cached)

    def run(self) -> None:
        self._wait(lambda: read_progress(self.plan.window) is not None, "the trainer to find its resume point")
        start = read_progress(self.plan.window)
        todo = [(k, u) for k, u in enumerate(self.units) if u.last >= start]
        log.info("producer: %d shard stays from step %d on (%d shards, %d cached); window %d tokens",
                 len(todo), start, len(self.plan.shards), len(self.plan.cached), self.online.window_tokens)
        previous: dict[int, Unit | None] = {}  # each stay's shard's stay before it
        latest: dict[int, Unit] = {}
        for k, u in enumerate(self.units):
            previous[k] = latest.get(u.shard)
            latest[u.shard] = u
        with contextlib.ExitStack() as stack:
            backend = None
            started = last_log = time.perf_counter()
            for k, unit in todo:
                previous_unit = previous[k]
                if previous_unit is not None and previous_unit.last >= start:
                    # the same shard's earlier stay: its deletion must come before this one's making
                    self._wait(lambda p=previous_unit: read_progress(self.plan.window) > p.last,
                               f"step {previous_unit.last + 1} to finish with shard {unit.shard}")
                if self.store.shard_info(unit.shard) is not None:  # made before a restart, or cached
                    continue
                need = self.plan.tokens(unit.shard)
                if not unit.cached:
                    self._wait(lambda n=need: self._window_tokens() + n <= self.online.window_tokens,
                               f"room in the window for shard {unit.shard} ({need} tokens)")
                    self.peak = max(self.peak, self._window_tokens() + need)
                if backend is None:
                    backend = stack.enter_context(self._load())
                extract_shards(backend, self.store, [(unit.shard, self.plan.shards[unit.shard])],
                               batch_tokens=self.extraction.batch_tokens)
                self.made += 1
                self.made_tokens += need
                now = time.perf_counter()
                if now - last_log >= PROGRESS_INTERVAL_S:
                    log.info("producer: %d shards, %d tokens made (%.0f tokens/s); at stay %d of %d", self.made,
                             self.made_tokens, self.made_tokens / max(now - started, 1e-9), k + 1, len(self.units))
                    last_log = now
        atomic_write_json(self.plan.window / PRODUCER_STATS, {
            "shards_made": self.made, "tokens_made": self.made_tokens, "peak_window_tokens": self.peak,
            "window_tokens": self.online.window_tokens, "started_at_step": start})
        log.info("producer: done: %d shards, %d tokens; peak window %d of %d tokens", self.made, self.made_tokens,
                 self.peak, self.online.window_tokens)

    def _load(self):
        longest = max(len(s["input_ids"]) for shard in self.plan.shards for s in shard)
        started = time.perf_counter()
        backend = make_backend(self.target_info, self.extraction, longest)
        log.info("producer: %s backend ready in %.1f s", self.extraction.backend, time.perf_counter() - started)
        return backend


def main(argv: list[str] | None = None) -> int:
    from draftsmith.logs import setup_logging

    argv = sys.argv[1:] if argv is None else argv
    setup_logging(None)
    spec = read_json(Path(argv[0]))
    try:
        Producer(spec).run()
    except ParentGone:
        log.warning("producer: the training job ended; stopping")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
