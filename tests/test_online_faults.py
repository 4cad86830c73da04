"""Online training under crashes, through real `snakemake` runs: the producer killed (the job fails
naming it), the trainer killed (the kernel takes the producer down with it), and each rerun
resumes both at the trainer's last checkpoint, ending at the draft of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_online import WEIGHT_TOLERANCE
from test_workflow_faults import DRAFT, RESULTS, _session, _start, _wait, workflow  # noqa: F401, F811 - a fixture

from draftsmith.extract.settings import ExtractionSettings
from draftsmith.io import read_json
from draftsmith.online import OnlineSettings, run_online_training
from draftsmith.online.window import process_alive
from draftsmith.train import TrainSettings
from workflow_helpers import snakemake, write_config

pytestmark = pytest.mark.slow

TRAIN = {"mode": "online", "max_steps": 60, "epochs": 4, "batch_tokens": 64, "checkpoint_every": 5, "log_every": 1,
         "warmup_steps": 2}
EXTRACTION = {"shard_tokens": 64, "batch_tokens": 64}
ONLINE = {"window_tokens": 256}  # what the plan needs: the mixed group and the steps read ahead


def _config(model: Path, data: Path) -> dict:
    return {"run": "t", "device": "cpu", "target": {"source": "path", "path": str(model)},
            "data": {"sources": [str(data)], "max_seq_len": 64, "heldout_fraction": 0.1},
            "vocab": {"draft_vocab_size": 64}, "extraction": EXTRACTION, "train": TRAIN, "online": ONLINE}


def _pids(run, marker: str) -> list[int]:
    return [pid for pid, cmd in _session(run.pid) if marker in cmd]


def test_killing_the_producer_or_the_trainer_resumes_both_at_the_checkpoint(workflow, tmp_path):  # noqa: F811
    workdir, model, data = workflow
    config = write_config(workdir, _config(model, data))
    results = workdir / RESULTS
    pointer = results / "train" / "state" / "checkpoints" / "latest.json"

    # 1. The producer killed mid-run: the trainer, waiting for its next shard, stops the job by name.
    run = _start(workdir, config, DRAFT)
    _wait(run, lambda: pointer.exists() and _pids(run, "draftsmith.online.producer"), "a checkpoint")
    for pid in _pids(run, "draftsmith.online.producer"):
        os.kill(pid, signal.SIGKILL)
    out = run.communicate(timeout=300)[0]
    assert run.returncode != 0 and "Error in rule train_draft_online" in out, out[-3000:]
    log = (workdir / "logs/t/train_draft_online.log").read_text()
    assert "the hidden-state producer" in log and "ended before it made shard" in log, log[-3000:]
    first = read_json(pointer)["step"]

    # 2. The trainer (the job's own process) killed: its producer dies with it, however it died.
    run = _start(workdir, config, DRAFT)
    _wait(run, lambda: read_json(pointer)["step"] > first + 5 if pointer.exists() else False, "a later checkpoint")
    producers = _pids(run, "draftsmith.online.producer")
    jobs = [pid for pid in _pids(run, "train_draft_online") if pid not in producers]
    assert producers and jobs
    for pid in jobs:
        os.kill(pid, signal.SIGKILL)
    run.communicate(timeout=300)
    deadline = time.monotonic() + 30
    while any(process_alive(p) for p in producers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(process_alive(p) for p in producers)
    second = read_json(pointer)["step"]

    # 3. The rerun resumes at the last checkpoint and ends where an uninterrupted run ends.
    snakemake(workdir, DRAFT, configfile=config)
    summary = read_json(results / "train" / "summary.json")
    assert summary["resumed_from_step"] >= second > first and summary["steps"] == TRAIN["max_steps"]
    # the producer starts where the trainer is when it reads its progress: at the checkpoint or later
    assert summary["online"]["started_at_step"] >= summary["resumed_from_step"]
    assert summary["online"]["peak_window_tokens"] <= ONLINE["window_tokens"]

    config = {"train": TRAIN, "extraction": EXTRACTION, "online": ONLINE, "device": "cpu"}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the job's thread count: float sums depend on it
    try:
        run_online_training(results / "data" / "train.jsonl", results / "target.json",
                            results / "vocab" / "mapping.safetensors", tmp_path / "draft", tmp_path / "work",
                            TrainSettings.from_config(config), ExtractionSettings.from_config(config),
                            OnlineSettings.from_config(config))
    finally:
        torch.set_num_threads(threads)
    ours, reference = load_file(str(workdir / DRAFT)), load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert max((ours[k].float() - reference[k].float()).abs().max().item() for k in ours) <= WEIGHT_TOLERANCE
