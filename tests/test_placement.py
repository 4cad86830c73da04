"""GPU placement on a fake device list: jobs get disjoint devices, and a killed job frees its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.placement import (
    DEVICES_ENV,
    LOCK_DIR_ENV,
    PlacementError,
    claim_devices,
    engine_env,
    engine_placement,
)

ROOT = Path(__file__).resolve().parents[1]

HOLDER = """
import sys, time
from draftsmith.placement import engine_placement
with engine_placement(int(sys.argv[1])) as claim:
    import os
    print(os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
    sys.stdin.readline()  # hold the devices until the test says so (or kills us)
"""


@pytest.fixture
def four_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv(DEVICES_ENV, "0,1,2,3")
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def _holder(gpus: int) -> tuple[subprocess.Popen, set[str]]:
    """A job in its own process that claims ``gpus`` devices and holds them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(gpus)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline().strip()
    assert line, proc.wait()
    return proc, set(line.split(","))


def test_two_tp2_jobs_on_four_gpus_get_disjoint_devices(four_gpus):
    first, a = _holder(2)
    second, b = _holder(2)
    try:
        assert len(a) == len(b) == 2
        assert not a & b and a | b == {"0", "1", "2", "3"}
        with pytest.raises(PlacementError, match="not free"):
            claim_devices(1, timeout=0)
    finally:
        for proc in (first, second):
            proc.stdin.close()
            proc.wait()
    claim = claim_devices(4, timeout=0)  # both exited: everything is free again
    assert claim.visible == "0,1,2,3"
    claim.release()


def test_a_killed_job_frees_its_devices(four_gpus):
    holder, held = _holder(3)
    try:
        with pytest.raises(PlacementError):
            claim_devices(2, timeout=0)
        claim = claim_devices(1, timeout=0)  # the one device the holder left
        assert claim.visible not in held
        claim.release()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    claim = claim_devices(4, timeout=0)  # no clean-up ran, yet the kernel dropped the locks
    assert len(claim.devices) == 4
    claim.release()


def test_claims_in_one_process_are_disjoint_and_released(four_gpus):
    a, b = claim_devices(2, timeout=0), claim_devices(2, timeout=0)
    assert not set(a.visible.split(",")) & set(b.visible.split(","))
    a.release()
    c = claim_devices(2, timeout=0)
    assert c.visible == a.visible
    b.release()
    c.release()


def test_placement_sets_the_devices_and_the_engine_environment(four_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the workflow was started on GPUs 2 and 3
    for key in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "NCCL_P2P_DISABLE"):
        monkeypatch.delenv(key, raising=False)
    for key in ("DRAFTSMITH_JOB_GPUS", "DRAFTSMITH_KEEP_WARM_S"):  # set below; gone again after the test
        monkeypatch.setenv(key, "")
    config = {"engine_env": {"NCCL_P2P_DISABLE": 1, "extract_hidden_states": {"DO_NOT_TRACK": "0"}},
              "warm_target": {"minutes": 1.5}}
    env = engine_env(config, "extract_hidden_states")
    assert env == {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "0", "NCCL_P2P_DISABLE": "1",
                   "DRAFTSMITH_KEEP_WARM_S": "90.0"}
    with engine_placement(1, env) as claim:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == claim.visible == "2"
        assert os.environ["NCCL_P2P_DISABLE"] == "1" and os.environ["DO_NOT_TRACK"] == "0"
        # the warm engines a job may attach to are those on its own GPUs
        assert os.environ["DRAFTSMITH_JOB_GPUS"] == claim.devices[0].uuid
    assert engine_env({}, "evaluate_draft") == {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                                                "DRAFTSMITH_KEEP_WARM_S": "0.0"}


def test_too_many_gpus_are_refused_at_once(four_gpus):
    with pytest.raises(PlacementError, match="needs 8 GPUs; this machine has 4"):
        claim_devices(8)


def test_under_slurm_the_allocation_is_used_as_it_is(four_gpus, monkeypatch):
    monkeypatch.delenv(DEVICES_ENV)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert claim_devices(2).visible == "0,1"
    assert claim_devices(2).visible == "0,1"  # no lock: the allocation is this job's alone
    assert claim_devices(4).visible == "0,1"  # SLURM decides: what it gave is used, with a warning
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert claim_devices(2).devices == []  # stand-in GPUs without device files
    assert claim_devices(0).devices == []


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs two CUDA devices (the GPU lane on a 2-GPU machine)")
def test_two_extraction_parts_run_on_different_gpus(tmp_path):
    """Through snakemake on a real 2-GPU machine: two TP=1 parts, started together, each on a GPU
    of its own, named by UUID in its log."""
    import re

    from workflow_helpers import snakemake, tiny_workflow, write_config

    workdir, config = tiny_workflow(tmp_path)
    config["device"] = "cuda"
    config["extraction"] = {"parts": 2, "tensor_parallel_size": 1}
    parts = [f"results/t/hidden_states/part-{p}.json" for p in (0, 1)]
    # targets first: --resources takes every word after it
    snakemake(workdir, *parts, "--cores", "4", "--resources", "gpu=2", configfile=write_config(workdir, config))
    uuids = []
    for p in (0, 1):
        log = (workdir / f"logs/t/extract_hidden_states/part-{p}.log").read_text()
        found = re.search(r"CUDA_VISIBLE_DEVICES=(\S+); UUIDs (\S+)", log)
        assert found, log[-2000:]
        uuids.append(found.group(2))
    assert uuids[0] != uuids[1], uuids


@pytest.mark.slow
@pytest.mark.parametrize("cores, threads_each", [(4, 1), (32, 4)])
def test_gpu_jobs_share_the_cores_so_every_gpu_can_be_busy(tmp_path, cores, threads_each):
    """Two TP=1 extraction parts on a run given 2 GPUs: their threads fit the cores together (one
    left for the CPU stages), so Snakemake starts both at once instead of one after the other."""
    from workflow_helpers import planned_jobs, snakemake, tiny_workflow, write_config

    workdir, config = tiny_workflow(tmp_path)
    config["device"] = "cuda"
    config["extraction"] = {"parts": 2, "tensor_parallel_size": 1}
    plan = snakemake(workdir, "-n", "--cores", str(cores), "--resources", "gpu=2",
                     configfile=write_config(workdir, config))
    jobs = planned_jobs(plan)
    assert jobs["extract_hidden_states"]["threads"] == threads_each
    assert 2 * threads_each <= cores - 1
