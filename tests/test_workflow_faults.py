"""Crashes, a concurrent run and a corrupted shard, through real `snakemake` runs of the workflow.

One workflow folder lives through: an extraction job killed (as the OOM killer would), a second
`snakemake` refused by the first one's lock, the whole `snakemake` killed mid-training (its lock
stays: `--unlock`), and a shard corrupted after it was written. Each rerun resumes where the
crash left off and the draft ends byte-identical to one trained without interruption.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import tiny
from draftsmith.extract.extract import extract_part, merge
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.io import read_json
from draftsmith.train import TrainSettings, run_training
from workflow_helpers import SNAKEMAKE, copy_workflow, snakemake, write_config

pytestmark = pytest.mark.slow

RESULTS = "results/t"
DRAFT = f"{RESULTS}/draft/model.safetensors"
TRAIN = {"max_steps": 40, "epochs": 4, "batch_tokens": 64, "checkpoint_every": 5, "log_every": 1,
         "warmup_steps": 2}
EXTRACTION = {"parts": 2, "shard_tokens": 64, "batch_tokens": 64}


def _config(model: Path, data: Path, **train) -> dict:
    return {"run": "t", "device": "cpu", "target": {"source": "path", "path": str(model)},
            "data": {"sources": [str(data)], "max_seq_len": 64, "heldout_fraction": 0.1},
            "vocab": {"draft_vocab_size": 64}, "extraction": EXTRACTION, "train": {**TRAIN, **train}}


def _start(workdir: Path, config: Path, *args: str) -> subprocess.Popen:
    """`snakemake` in its own session, so that it and its jobs can be killed together."""
    env = {**os.environ, "PYTHONPATH": str(workdir), "PYTHONUNBUFFERED": "1"}
    cmd = [SNAKEMAKE, "--cores", "2", "--resources", "gpu=0", f"--configfile={config}", *args]
    return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _session(sid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process of session ``sid``: the run and its jobs."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
            except (ProcessLookupError, PermissionError, FileNotFoundError):
                pass
    return found


def _wait(proc: subprocess.Popen, condition, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"snakemake ended before {what}:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _shards(workdir: Path, part: int) -> dict[str, int]:
    """Complete shard files of a part -> mtime."""
    return {str(p): p.stat().st_mtime_ns for p in (workdir / RESULTS / "hidden_states").glob(f"part-{part}/shard-*/*")}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def workflow(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    model = tiny.build_llama(tmp_path / "model")
    rows = [{"messages": [{"role": "user", "content": f"Hello there number {i}, how are you doing today?"},
                          {"role": "assistant", "content": f"I am fine, thank you {i}. It is sunny and warm."}]}
            for i in range(40)]
    data = tiny.write_jsonl(tmp_path / "chats.jsonl", rows)
    return workdir, model, data


def _reference(workdir: Path, tmp: Path) -> tuple[dict[str, str], str]:
    """The hidden states and draft an uninterrupted run makes from the workflow's own inputs, with
    the train job's thread count (floating-point sums depend on it)."""
    results = workdir / RESULTS
    store = tmp / "reference"
    settings = ExtractionSettings.from_config({"extraction": EXTRACTION, "device": "cpu"})
    for part in range(2):
        extract_part(results / "data" / "train.jsonl", results / "target.json", part, settings, store,
                     store / f"part-{part}.json")
    merge([store / f"part-{p}.json" for p in range(2)], store / "index.json")
    states = {str(p.relative_to(store)): _sha(p) for p in store.rglob("*") if p.is_file()}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        values = {**read_json(results / "train" / "summary.json")["settings"]}
        run_training(results / "hidden_states" / "index.json", results / "vocab" / "mapping.safetensors",
                     results / "target.json", tmp / "draft", tmp / "work", TrainSettings(**values))
    finally:
        torch.set_num_threads(threads)
    return states, _sha(tmp / "draft" / "model.safetensors")


def test_crashes_a_concurrent_run_and_a_corrupt_shard_cost_only_the_unit_in_flight(workflow, tmp_path):
    workdir, model, data = workflow
    config = write_config(workdir, _config(model, data))
    results = workdir / RESULTS

    # 1. An extraction job killed mid-part (the OOM killer): snakemake fails the job, keeps the
    #    complete shards (they are not rule outputs) and releases its lock.
    run = _start(workdir, config, DRAFT)
    _wait(run, lambda: any(len({Path(f).parent for f in _shards(workdir, p)}) >= 2 for p in range(2)),
          "two shards of a part were written")
    jobs = [pid for pid, cmd in _session(run.pid) if "extract_hidden_states" in cmd]
    assert jobs, _session(run.pid)
    for pid in jobs:
        os.kill(pid, signal.SIGKILL)
    out = run.communicate(timeout=120)[0]
    assert run.returncode != 0 and "Error in rule extract_hidden_states" in out, out[-3000:]
    killed_part = next(p for p in range(2)
                       if _shards(workdir, p) and not (results / "hidden_states" / f"part-{p}.json").exists())
    kept = _shards(workdir, killed_part)
    assert kept

    # 2. The rerun resumes the part; a second snakemake started meanwhile on the same folder is
    #    refused by the first one's lock and changes nothing.
    run = _start(workdir, config, DRAFT)
    _wait(run, lambda: any("extract_hidden_states" in cmd for _, cmd in _session(run.pid)), "extraction restarted")
    second = snakemake(workdir, DRAFT, configfile=config, check=False)
    assert second.returncode != 0 and "LockException" in second.stdout + second.stderr, second.stderr[-3000:]
    #    Then the whole run is killed, jobs and all, once training has written a checkpoint.
    pointer = results / "train" / "state" / "checkpoints" / "latest.json"
    _wait(run, pointer.exists, "a training checkpoint")
    for pid, _ in _session(run.pid):
        os.kill(pid, signal.SIGKILL)
    run.communicate(timeout=60)
    assert not (results / "draft" / "config.json").exists()
    assert {p: m for p, m in _shards(workdir, killed_part).items() if p in kept} == kept  # not redone
    log = (workdir / f"logs/t/extract_hidden_states/part-{killed_part}.log").read_text()
    assert f"part {killed_part}: {len({Path(f).parent for f in kept})} of " in log, log
    checkpoint = read_json(pointer)["step"]

    # 3. A crash leaves snakemake's lock behind: the next run says so; --unlock, then it resumes.
    stale = snakemake(workdir, DRAFT, configfile=config, check=False)
    assert stale.returncode != 0 and "--unlock" in stale.stdout + stale.stderr
    snakemake(workdir, "--unlock", configfile=config)
    snakemake(workdir, DRAFT, configfile=config)
    summary = read_json(results / "train" / "summary.json")
    assert summary["resumed_from_step"] >= checkpoint and summary["steps"] == TRAIN["max_steps"]
    states, draft = _reference(workdir, tmp_path)
    store = results / "hidden_states"
    assert {str(p.relative_to(store)): _sha(p) for p in store.rglob("*") if p.is_file()} == states
    assert _sha(workdir / DRAFT) == draft

    # 4. A shard corrupted on disk: the next training run (here for a changed log interval) stops
    #    before training, naming it; the run after regenerates that shard alone.
    victim = sorted((store / "part-1").glob("shard-*"))[1] / "layer-4.safetensors"
    good = victim.read_bytes()
    victim.write_bytes(good[:-7] + bytes([good[-7] ^ 0x10]) + good[-6:])
    intact = {p: m for p, m in {**_shards(workdir, 0), **_shards(workdir, 1)}.items()
              if Path(p).parent != victim.parent}
    config = write_config(workdir, _config(model, data, log_every=2))
    failed = snakemake(workdir, DRAFT, configfile=config, check=False)
    assert failed.returncode != 0
    train_log = (workdir / "logs/t/train_draft.log").read_text()  # the rule's log says why
    assert f"part 1 shard {int(victim.parent.name.split('-')[1])}: layer-4.safetensors fails its checksum" \
        in train_log, failed.stderr[-3000:]
    assert not (store / "part-1.json").exists()
    snakemake(workdir, DRAFT, configfile=config)
    assert victim.read_bytes() == good
    assert {p: Path(p).stat().st_mtime_ns for p in intact} == intact  # only the damaged shard was rewritten
    assert _sha(workdir / DRAFT) == draft


def test_a_job_that_outlived_its_killed_snakemake_is_redone_by_a_plain_rerun(workflow):
    """kill -9 of snakemake alone (a lost login shell): its job goes on and writes its outputs, which
    Snakemake still holds incomplete. A plain rerun (the workflow profile's rerun-incomplete, read
    with or without another profile) redoes the job instead of stopping at them."""
    workdir, model, data = workflow
    config = write_config(workdir, _config(model, data))
    script = workdir / "workflow_scripts" / "prepare_dataset.py"
    script.write_text('import os, time\nif os.path.exists("SLOW"):\n    time.sleep(20)\n' + script.read_text())
    (workdir / "SLOW").touch()
    train = workdir / RESULTS / "data" / "train.jsonl"
    run = _start(workdir, config, f"{RESULTS}/data/train.jsonl")
    _wait(run, lambda: any("prepare_dataset" in cmd for _, cmd in _session(run.pid)), "prepare_dataset")
    orphans = [pid for pid, cmd in _session(run.pid) if "prepare_dataset" in cmd]
    os.kill(run.pid, signal.SIGKILL)  # snakemake alone: the job lives on
    run.communicate(timeout=60)
    deadline = time.monotonic() + 120
    while any(Path(f"/proc/{pid}").exists() for pid in orphans) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert train.exists()  # the orphan finished its outputs
    (workdir / "SLOW").unlink()
    snakemake(workdir, "--unlock", configfile=config)
    rerun = snakemake(workdir, f"{RESULTS}/data/train.jsonl", configfile=config)
    assert "IncompleteFilesException" not in rerun.stderr and "prepare_dataset" in rerun.stderr
