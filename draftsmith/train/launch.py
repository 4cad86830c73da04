"""Starting training: in this process, or as torchrun's worker processes (one node), or one torchrun
per node of a SLURM allocation meeting at a c10d rendezvous (several nodes)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import socket
import sys
from pathlib import Path

from draftsmith.errors import TrainingError
from draftsmith.extract.hidden_states import verify_store
from draftsmith.io import atomic_write_bytes, atomic_write_json, lock_beside, read_json, sole_writer
from draftsmith.train.batches import StateSource
from draftsmith.train.checkpoints import FINISHED
from draftsmith.train.loop import DRAFT_SUMMARY, train_draft
from draftsmith.train.settings import TrainSettings

log = logging.getLogger(__name__)

# Task layouts the batch step exports (the SLURM profile's GPU jobs get --ntasks-per-gpu): srun
# reads them as options, and they contradict the one task per node a multi-node launch asks for.
_SLURM_TASK_LAYOUT = ("SLURM_NTASKS_PER_GPU", "SLURM_TRES_PER_TASK", "SLURM_NTASKS", "SLURM_NPROCS",
                      "SLURM_NTASKS_PER_NODE")


def launch_command(launch: Path, devices: int, nodes: int = 1, *, rdzv_port: int = 29400,
                   env: dict[str, str] | None = None, worker: str = "draftsmith.train") -> tuple[list[str], dict[str, str]]:
    """The command, and its environment, that start training's processes: ``devices`` on each of
    ``nodes`` nodes.

    One node: ``torchrun --standalone``. Several: inside a SLURM allocation of that many nodes
    (the rule runs on its first node), ``srun`` starts one ``torchrun`` per node with ``devices``
    GPUs each, and they meet at a c10d rendezvous on this host named after the job. ``worker`` is
    the module each process runs (``python -m worker launch.json``).
    """
    env = dict(os.environ if env is None else env)
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={devices}"]
    module = ["-m", worker, str(launch)]
    if nodes == 1:
        return [*torchrun, "--standalone", *module], env
    job = env.get("SLURM_JOB_ID")
    if job is None:
        raise TrainingError(f"train.nodes is {nodes}, but this job is not a SLURM allocation",
                            where="train.nodes",
                            fix="run the workflow with --profile profiles/slurm (train_draft then asks SLURM for "
                                "train.nodes nodes: docs/cluster.md), or set train.nodes: 1")
    allocated = int(env.get("SLURM_JOB_NUM_NODES", "1"))
    if allocated < nodes:
        raise TrainingError(f"train.nodes is {nodes}, but SLURM job {job} has {allocated} node(s)",
                            where="train.nodes",
                            fix="the rule asks for train.nodes nodes: remove any nodes a profile's set-resources "
                                "or --set-resources gives train_draft, which overrides it (docs/cluster.md)")
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", f"--gpus-per-node={devices}",
           "--kill-on-bad-exit=1", *torchrun, f"--nnodes={nodes}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint={socket.gethostname()}:{rdzv_port}", f"--rdzv_id=draftsmith-{job}", *module]
    return cmd, {k: v for k, v in env.items() if k not in _SLURM_TASK_LAYOUT}


def run_training(index_path: str | Path | None, mapping_path: str | Path, target_json: str | Path,
                 out_dir: str | Path, work_dir: str | Path, settings: TrainSettings, *, devices: int = 1,
                 nodes: int = 1, rdzv_port: int = 29400, log_path: str | Path | None = None,
                 metrics_out: str | Path | None = None, summary_out: str | Path | None = None,
                 source: StateSource | None = None, worker: str = "draftsmith.train",
                 worker_args: dict | None = None) -> dict:
    """Train in this process, or with ``devices`` processes on each of ``nodes`` nodes (DDP;
    ``launch_command``); then copy the metrics and summary from the work dir to the rule's outputs.

    Online training passes the ``source`` of its shards for this process, or, for torchrun's
    processes, the ``worker`` module that builds one from ``worker_args`` (in launch.json)."""
    work_dir = Path(work_dir)
    with trainer_lock(work_dir):
        # Snakemake removed the draft's files before this job, not the summary beside them: an
        # interrupted retrain must not leave the last draft's summary without its draft.
        (Path(out_dir) / DRAFT_SUMMARY).unlink(missing_ok=True)
        launch = work_dir / "launch.json"
        if devices * nodes > 1:  # a launch that cannot work stops before the store is read
            cmd, env = launch_command(launch, devices, nodes, rdzv_port=rdzv_port, worker=worker)
        if settings.verify_shards and index_path is not None:
            # Every shard's checksums before any state is read (training reads them shuffled): a damaged
            # shard stops the run here, by name, and its part is queued for re-extraction.
            verify_store(index_path)
            settings = dataclasses.replace(settings, verify_shards=False)
        work_dir.mkdir(parents=True, exist_ok=True)
        args = {"index_path": None if index_path is None else str(index_path), "mapping_path": str(mapping_path),
                "target_json": str(target_json), "out_dir": str(out_dir), "work_dir": str(work_dir),
                "settings": dataclasses.asdict(settings), **(worker_args or {})}
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
            summary = train_draft(index_path, mapping_path, target_json, out_dir, work_dir, settings, source=source)
        if metrics_out is not None:
            source = work_dir / "metrics.jsonl"
            atomic_write_bytes(metrics_out, source.read_bytes() if source.exists() else b"")
        if summary_out is not None:
            atomic_write_json(summary_out, summary)
        # The draft is delivered: a later run of the rule (--forcerun, outputs removed) trains again
        # instead of resuming at the last step and re-saving this draft.
        atomic_write_json(work_dir / FINISHED, {"checkpoint": summary.get("checkpoint"), "steps": summary.get("steps")})
        return summary


def trainer_lock(work_dir: Path):
    """This run's trainer alone in ``work_dir`` (``io.sole_writer``, the lock beside it): an orphaned
    trainer, its Snakemake killed, and the rerun's would resume from the same checkpoints, delete
    each other's and both write the draft."""
    return sole_writer(lock_beside(work_dir), f"training in {work_dir}", str(work_dir), TrainingError)


def worker_args(argv: list[str] | None = None, prog: str = "python -m draftsmith.train") -> tuple[dict, TrainSettings]:
    """A torchrun worker's launch.json (named in ``argv``): its arguments and settings, with logging
    set up (warnings only, and no progress bar, beyond rank 0)."""
    from draftsmith.logs import setup_logging

    parser = argparse.ArgumentParser(
        prog=prog, description="One torchrun worker of a training run. train_draft starts these itself "
                    "(docs/design.md); run it by hand only to replay a launch file it wrote.")
    parser.add_argument("launch_json", type=Path, help="the launch.json train_draft wrote in its work directory")
    launch = parser.parse_args(argv).launch_json
    setup_logging(None)
    if not launch.is_file():
        raise TrainingError(f"{launch}: no such launch file. train_draft writes it in the run's "
                            "train/state directory before it starts torchrun; start the stage through the workflow.")
    args = read_json(launch)
    settings = TrainSettings(**args.pop("settings"))
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger().setLevel(logging.WARNING)
        settings = dataclasses.replace(settings, progress=False)
    return args, settings


def main(argv: list[str] | None = None) -> None:
    """``python -m draftsmith.train launch.json``: one torchrun worker."""
    args, settings = worker_args(argv)
    train_draft(settings=settings, **args)
