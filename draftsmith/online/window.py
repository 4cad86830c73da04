"""The trainer's side of the window: wait for each shard the engine makes, delete a shard once the
steps that read it are done, and tell the engine how far training has come (``progress.json``)."""

from __future__ import annotations

import logging
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch.distributed as dist

from draftsmith.errors import TrainingError
from draftsmith.extract.hidden_states import SHARD_MANIFEST, DamagedShard, load_shard_manifest, shard_dir_name
from draftsmith.io import atomic_write_json, read_json
from draftsmith.online.plan import OnlinePlan, OnlineSettings, Unit
from draftsmith.train.batches import ShardMeta, Step
from draftsmith.train.settings import TrainSettings

log = logging.getLogger(__name__)

PROGRESS = "progress.json"  # {"steps_done": n}: written by the main training process
PRODUCER_STATS = "producer.json"  # what the producer made and the window's peak, written when it ends
POLL_S = 0.05
WAIT_LOG_S = 60.0


def read_progress(window: Path) -> int | None:
    """Steps training has done, as last published; None before this run's trainer has started."""
    try:
        return int(read_json(window / PROGRESS)["steps_done"])
    except FileNotFoundError:
        return None


def present_shards(plan: OnlinePlan) -> set[int]:
    """Shards complete in the window (a shard folder appears by rename, manifest and all)."""
    names = plan.shard_numbers
    return {names[p.parent.name] for p in plan.store_dir.glob(f"*/{SHARD_MANIFEST}") if p.parent.name in names}


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited child not yet reaped is a zombie: not running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


class WindowSource:
    """Training's ``StateSource`` when the engine runs beside it: shards appear in the window, and
    the main process deletes each one when its last step is done."""

    def __init__(self, plan: OnlinePlan, online: OnlineSettings, producer_pid: int, log_path: str | None = None):
        self.plan, self.online, self.producer_pid, self.log_path = plan, online, producer_pid, log_path
        self.index, self.fingerprint = plan.index, plan.fingerprint
        self.ending: dict[int, list[Unit]] = defaultdict(list)
        self.main = False

    def metas(self, settings: TrainSettings) -> list[ShardMeta]:
        return self.plan.metas(settings)

    def start(self, steps: list[Step], start: int, main: bool) -> None:
        """Plan the window from training's steps; the main process clears what a crashed run left
        that no step from ``start`` on reads, then publishes ``start`` so the engine begins there."""
        units = self.plan.units(steps)
        for u in units:
            self.ending[u.last].append(u)
        self.main = main
        if not main:
            return
        keep = {u.shard for u in units if u.first <= start <= u.last or (u.cached and u.last >= start)}
        stale = present_shards(self.plan) - keep
        for shard in stale:
            shutil.rmtree(self.plan.store_dir / shard_dir_name(shard), ignore_errors=True)
        if stale:
            log.info("online: removed %d shards that no step from %d on reads", len(stale), start)
        atomic_write_json(self.plan.window / PROGRESS, {"steps_done": start})

    def before_read(self, shard: int) -> None:
        """Wait until the engine has made ``shard``; stop when the engine's process has ended without it."""
        folder = self.plan.store_dir / shard_dir_name(shard)
        started = logged = time.monotonic()
        while not (folder / SHARD_MANIFEST).exists():
            if not process_alive(self.producer_pid):
                if (folder / SHARD_MANIFEST).exists():
                    break
                raise TrainingError(
                    f"the hidden-state producer (pid {self.producer_pid}) ended before it made shard {shard}",
                    where=self.log_path or str(self.plan.window),
                    fix="read the producer's traceback in the log; rerunning resumes both at the last checkpoint")
            now = time.monotonic()
            if now - logged >= WAIT_LOG_S:
                log.info("online: waiting %.0f s for shard %d from the engine", now - started, shard)
                logged = now
            time.sleep(POLL_S)
        try:
            made_from = load_shard_manifest(folder).get("fingerprint")
        except DamagedShard as e:
            raise TrainingError(f"online shard {shard} is damaged: {e}", where=str(folder),
                                fix="rerun: the engine makes the damaged shard again") from None
        if made_from != self.fingerprint:  # what PartStore wrote to store.json for this plan
            raise TrainingError(f"online shard {shard} was made from other inputs or settings", where=str(folder),
                                fix="rerun: the engine's store clears shards of other inputs")

    def step_done(self, done: int) -> None:
        """After step ``done`` (1-based) on every process: delete the shards no later step reads,
        then publish the progress the engine waits on."""
        ended = self.ending.get(done - 1)
        if not ended:
            return
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every process has built its batches of this step
        if not self.main:
            return
        for u in ended:
            shutil.rmtree(self.plan.store_dir / shard_dir_name(u.shard), ignore_errors=True)
        atomic_write_json(self.plan.window / PROGRESS, {"steps_done": done})
