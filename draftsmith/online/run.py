"""``run_online_training``: the engine in a child process on its GPUs, the trainer on the others,
one window of shards between them; the train_draft_online rule's whole job."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

# Both for their names: the processes this job starts run them (python -m), and imported they are in
# train_draft_online's code fingerprint, so a patch to either trains again.
import draftsmith.online.producer as producer_module
import draftsmith.online.worker as worker_module
from draftsmith.engines.hf_model import stage_model_dtype
from draftsmith.errors import TrainingError
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.extract.shard_writer import PartStore
from draftsmith.io import atomic_write_json, read_json
from draftsmith.online.plan import PART, OnlinePlan, OnlineSettings
from draftsmith.online.window import PRODUCER_STATS, PROGRESS, WindowSource
from draftsmith.train.batches import plan_steps
from draftsmith.train.launch import run_training, trainer_lock
from draftsmith.train.settings import TrainSettings

log = logging.getLogger(__name__)

PRODUCER_EXIT_WAIT_S = 120.0


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when the training job dies, however it dies."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def split_devices(devices: list, engine_gpus: int) -> tuple[str | None, str | None]:
    """``CUDA_VISIBLE_DEVICES`` of the engine (the first ``engine_gpus`` of the job's claimed
    devices) and of the trainer (the rest); None for both on the CPU (no devices claimed)."""
    ids = [d.index for d in devices]
    if not ids:
        return None, None
    return ",".join(ids[:engine_gpus]), ",".join(ids[engine_gpus:])


def run_online_training(train_jsonl: str | Path, target_json: str | Path, mapping_path: str | Path,
                        out_dir: str | Path, work_dir: str | Path, settings: TrainSettings,
                        extraction: ExtractionSettings, online: OnlineSettings, *, devices: int = 1,
                        engine_devices: str | None = None, trainer_devices: str | None = None,
                        log_path: str | Path | None = None, metrics_out: str | Path | None = None,
                        summary_out: str | Path | None = None) -> dict:
    """Train the draft while the engine makes its hidden states, through a window of at most
    ``online.window_tokens`` tokens under ``work_dir/window``; same draft as offline training on
    the same data, settings and seed. ``engine_devices``/``trainer_devices`` are the
    ``CUDA_VISIBLE_DEVICES`` of each side (None: as this process sees them, or the CPU)."""
    from draftsmith.targets.inspect import read_target_json

    work_dir = Path(work_dir)
    with trainer_lock(work_dir):  # before the window is touched; run_training then holds it already
        window = work_dir / "window"
        target_info = read_target_json(target_json)
        plan = OnlinePlan.build(train_jsonl, target_info, window, extraction, online)
        steps = plan_steps(plan.metas(settings), settings, devices)
        units = plan.units(steps)
        needed = plan.check_window(units, len(steps), online, extraction)
        made_again = len(units) - len(plan.shards)
        log.info("online: %d shards of %d tokens in %d steps; the engine makes %d shard stays (%d again for later "
                 "epochs, %d shards cached); the window needs %d of its %d tokens", len(plan.shards),
                 plan.index.num_tokens, len(steps), len(units), made_again, len(plan.cached), needed,
                 online.window_tokens)
        # The store clears shards of other inputs or code now, before either side reads the window.
        PartStore(window, PART, fingerprint=plan.fingerprint, dtype=extraction.dtype,
                  hidden_size=target_info["hidden_size"], layer_ids=target_info["captured_layer_ids"],
                  model_dtype=stage_model_dtype(extraction))
        for stale in (PROGRESS, PRODUCER_STATS):  # the producer waits for this run's trainer's progress
            (window / stale).unlink(missing_ok=True)
        spec_path = work_dir / "online.json"
        atomic_write_json(spec_path, {
            "train_jsonl": str(train_jsonl), "target_json": str(target_json), "window": str(window), "processes": devices,
            "extraction": dataclasses.asdict(extraction), "online": dataclasses.asdict(online),
            "train": dataclasses.asdict(settings)})

        env = dict(os.environ)
        if engine_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = engine_devices
        if trainer_devices is not None:  # before this process (or torchrun's) first touches CUDA
            os.environ["CUDA_VISIBLE_DEVICES"] = trainer_devices
        with open(log_path, "a", encoding="utf-8") if log_path else contextlib.nullcontext() as sink:
            producer = subprocess.Popen([sys.executable, "-m", producer_module.__name__, str(spec_path)], env=env,
                                        stdout=sink, stderr=subprocess.STDOUT if sink else None,
                                        preexec_fn=_die_with_parent)
        log.info("online: producer pid %d (CUDA_VISIBLE_DEVICES=%s), trainer on %s", producer.pid,
                 engine_devices, trainer_devices)
        source = WindowSource(plan, online, producer.pid, str(log_path) if log_path else None)
        try:
            summary = run_training(None, mapping_path, target_json, out_dir, work_dir, settings, devices=devices,
                                   log_path=log_path, metrics_out=metrics_out, source=source,
                                   worker=worker_module.__name__,
                                   worker_args={"online_spec": str(spec_path), "producer_pid": producer.pid})
            code = producer.wait(timeout=PRODUCER_EXIT_WAIT_S)
        finally:
            if producer.poll() is None:
                producer.kill()
                producer.wait()
        if code != 0:
            raise TrainingError(f"the hidden-state producer exited with status {code} after training ended",
                                where=str(log_path or "stderr"), fix="read its traceback in the log")
        stats = read_json(window / PRODUCER_STATS)
        summary["online"] = {**stats, "units": len(units), "window_needed_tokens": needed,
                             "cache_fraction": online.cache_fraction}
        atomic_write_json(work_dir / "summary.json", summary)
        if summary_out is not None:
            atomic_write_json(summary_out, summary)
        return summary
