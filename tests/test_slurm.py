"""The cluster path, run for real: a one-node SLURM cluster started on this machine
(tests/slurm/start-cluster.sh), the workflow submitted to it through profiles/slurm with
`--executor slurm`, and `sacct` asked what every job requested and was given.

The node has no GPU; the cluster books stand-in GPUs (GRES gpu without devices), so a GPU rule's
request is submitted, scheduled and accounted as on a GPU node while the rule itself runs on CPU.
Needs root (the daemons) and either SLURM installed or apt-get to install it (about a minute).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml

from workflow_helpers import ROOT, SNAKEMAKE, planned_rules, tiny_workflow, write_config

pytestmark = pytest.mark.slow

SLURM_SCRIPTS = ROOT / "tests" / "slurm"
SLURM_PROFILE = ROOT / "profiles" / "slurm" / "config.yaml"
LOCAL_PROFILE = ROOT / "profiles" / "local" / "config.yaml"

# Preflight, plus one extraction part: a GPU rule, given stand-in GPUs on the test cluster.
TARGETS = ["results/t/target.json", "results/t/vocab/mapping.safetensors",
           "results/t/hidden_states/part-0.json"]

# What the test profile asks for, scaled to the test node (2 CPUs, ~24 GB), and what sacct must show.
ACCOUNT, PARTITION = "draftsmith", "debug"
CORES = 2
CPU_JOB = {"mem_mb": 1500, "runtime": 10}
GPU_JOB = {"mem_mb": 3000, "runtime": 15, "cpus_per_gpu": 1}
# GPUs booked for the GPU rules (device: cpu makes them declare gpu=0; a GPU run declares these).
GPUS = {"extract_hidden_states": 2, "train_draft": 2, "evaluate_draft": 1}
# CPU rules whose worker processes take the profile's cores (device: cpu: no GPU job beside them).
DATA_RULES = {"prepare_dataset", "build_vocab_mapping"}


def expected(rule: str) -> tuple[int, int, int, int]:
    """(CPUs, mem_mb, GPUs, time limit in minutes) that sacct must show for the rule's job."""
    if rule in GPUS:
        return GPUS[rule] * GPU_JOB["cpus_per_gpu"], GPU_JOB["mem_mb"], GPUS[rule], GPU_JOB["runtime"]
    return CORES if rule in DATA_RULES else 1, CPU_JOB["mem_mb"], 0, CPU_JOB["runtime"]


PREFLIGHT_RULES = {"inspect_target", "prepare_dataset", "build_vocab_mapping", "extract_hidden_states"}
ALL_RULES = PREFLIGHT_RULES | {"check_setup", "merge_hidden_states", "train_draft", "plot_training",
                               "evaluate_draft", "plot_evaluation", "estimate_payoff"}
SACCT_FIELDS = ["JobID", "JobName", "Comment", "State", "ExitCode", "Account", "Partition",
                "NTasks", "AllocCPUS", "ReqMem", "TimelimitRaw", "ReqTRES", "AllocTRES"]


def _why_no_cluster() -> str | None:
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        return "snakemake-executor-plugin-slurm is not installed (run `make setup`)"
    if os.geteuid() != 0:
        return "starting the SLURM test cluster needs root (munge, MariaDB, slurmdbd, slurmctld, slurmd)"
    installed = all(shutil.which(d, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
                    for d in ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "sbatch"))
    if not installed and shutil.which("apt-get") is None:
        return "SLURM, munge and MariaDB are not installed and there is no apt-get to install them"
    return None


def _free_port_base() -> int:
    """A base port with it and the next three free (slurmctld, slurmd, slurmdbd, MariaDB)."""
    for base in range(16817, 20000, 100):
        with socket.socket() as s0, socket.socket() as s1, socket.socket() as s2, socket.socket() as s3:
            try:
                for offset, s in enumerate((s0, s1, s2, s3)):
                    s.bind(("127.0.0.1", base + offset))
                return base
            except OSError:
                continue
    raise RuntimeError("no four free consecutive ports between 16817 and 20000")


@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory):
    """Start the test cluster once per session; yield the environment its clients need."""
    reason = _why_no_cluster()
    if reason:
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURM_TEST_PORT_BASE": str(_free_port_base())}
    started = time.monotonic()
    result = subprocess.run(["bash", str(SLURM_SCRIPTS / "start-cluster.sh"), str(state)], env=env,
                            capture_output=True, text=True, timeout=900)
    if result.returncode == 3:
        pytest.skip(f"could not install SLURM with apt-get:\n{result.stderr[-3000:]}")
    assert result.returncode == 0, f"the SLURM test cluster did not start:\n{result.stderr[-6000:]}"
    print(f"\nSLURM test cluster up in {time.monotonic() - started:.0f} s:\n{result.stderr}", file=sys.stderr)
    env["SLURM_CONF"] = str(state / "etc" / "slurm.conf")
    yield env
    subprocess.run(["bash", str(SLURM_SCRIPTS / "stop-cluster.sh"), str(state)], timeout=120)


@pytest.fixture
def tiny_run(tmp_path):
    """A private copy of the workflow with a config for a tiny random-init target on CPU."""
    workdir, config = tiny_workflow(tmp_path, max_heldout=4)
    config.update(vocab={"draft_vocab_size": 64},
                  train={"epochs": 1, "max_steps": 5, "batch_tokens": 512, "warmup_steps": 1},
                  eval={"max_prompts": 2, "max_new_tokens": 8, "k_sweep": [1, 2]})
    return workdir, write_config(workdir, config)


@pytest.mark.parametrize("profile", [LOCAL_PROFILE, SLURM_PROFILE], ids=["local", "slurm"])
def test_profile_parses_and_plans_the_workflow(profile, tiny_run):
    """Each profile is a valid option set for this Snakemake and plugin (a dry run reads it)."""
    if profile == SLURM_PROFILE and importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        pytest.skip("snakemake-executor-plugin-slurm is not installed (run `make setup`)")
    workdir, config = tiny_run
    result = subprocess.run([SNAKEMAKE, "-n", *TARGETS, "--profile", str(profile.parent),
                             "--configfile", str(config)], cwd=workdir,
                            env={**os.environ, "PYTHONPATH": str(workdir)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{profile}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert planned_rules(result) == PREFLIGHT_RULES, result.stdout


def _test_profile(dest: Path) -> Path:
    """profiles/slurm with its placeholders filled in for the test cluster and its sizes scaled to
    the test node; every other setting (executor, the GPU-job settings, ...) is the profile's own."""
    profile = yaml.safe_load(SLURM_PROFILE.read_text())
    assert profile["executor"] == "slurm"
    profile["cores"] = CORES
    profile["default-resources"].update(slurm_partition=PARTITION, slurm_account=ACCOUNT, **CPU_JOB)
    gpu_rules = profile["set-resources"]
    assert {"extract_hidden_states", "train_draft"} <= set(gpu_rules)
    for resources in gpu_rules.values():
        resources.update(slurm_partition=PARTITION, **GPU_JOB)
    for rule, gpus in GPUS.items():
        gpu_rules[rule]["gpu"] = gpus
    dest.mkdir(parents=True)
    (dest / "config.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    return dest


def _sacct(env: dict, run_id: str, since: datetime) -> list[dict]:
    result = subprocess.run(
        ["sacct", "--name", run_id, "--starttime", f"{since:%Y-%m-%dT%H:%M:%S}", "--parsable2",
         "--noheader", "--format", ",".join(SACCT_FIELDS)],
        env=env, capture_output=True, text=True, timeout=60, check=True)
    return [dict(zip(SACCT_FIELDS, line.split("|"))) for line in result.stdout.splitlines() if line]


def _tres(text: str) -> dict:
    return dict(item.split("=", 1) for item in text.split(",") if item)


def run_through_slurm(env: dict, workdir: Path, config: Path, profile: Path, targets: list[str],
                      rules: set[str]) -> None:
    """Run snakemake with the SLURM profile; check that each rule ran as one SLURM job that asked
    for, and got, what the rule and the profile declare."""
    since = datetime.now() - timedelta(minutes=5)
    started = time.monotonic()
    result = subprocess.run(
        [SNAKEMAKE, *targets, "--profile", str(profile), "--configfile", str(config)],
        cwd=workdir, env={**env, "PYTHONPATH": str(workdir), "PYTHONUNBUFFERED": "1"},
        capture_output=True, text=True, timeout=1800)
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"snakemake --executor slurm failed:\n{log[-8000:]}"
    print(f"\nworkflow through SLURM: {time.monotonic() - started:.0f} s", file=sys.stderr)

    run_id = next(line.split()[-1] for line in log.splitlines() if "SLURM run ID:" in line)
    rows = _sacct(env, run_id, since)
    print("\n".join("|".join(row.values()) for row in rows), file=sys.stderr)
    by_rule: dict[str, dict] = {}
    for job in (row for row in rows if "." not in row["JobID"]):
        rule = next(r for r in rules
                    if job["Comment"] == f"rule_{r}" or job["Comment"].startswith(f"rule_{r}_wildcards_"))
        assert rule not in by_rule, f"{rule} was submitted twice"
        by_rule[rule] = job
    assert set(by_rule) == rules, f"SLURM jobs seen: {sorted(by_rule)}"

    for rule, job in by_rule.items():
        cpus, mem_mb, gpus, minutes = expected(rule)
        where = f"{rule} (SLURM job {job['JobID']})"
        assert (job["State"], job["ExitCode"]) == ("COMPLETED", "0:0"), where
        assert (job["Account"], job["Partition"]) == (ACCOUNT, PARTITION), where
        assert int(job["TimelimitRaw"]) == minutes, where
        requested = _tres(job["ReqTRES"])
        assert int(requested["cpu"]) == cpus, f"{where}: {job['ReqTRES']}"
        assert requested["mem"] == f"{mem_mb}M", f"{where}: {job['ReqTRES']}"
        assert int(requested.get("gres/gpu", 0)) == gpus, f"{where}: {job['ReqTRES']}"
        assert _tres(job["AllocTRES"]).get("gres/gpu") == requested.get("gres/gpu"), where
        # The rule ran once: no step of its job started more than one task (a GPU job whose
        # rule srun started once per GPU would show a step with NTasks = GPUs).
        steps = [row for row in rows if row["JobID"].startswith(job["JobID"] + ".")]
        assert steps, where
        assert all(int(step["NTasks"] or 1) == 1 for step in steps), f"{where}: {steps}"


def test_preflight_and_extraction_run_as_slurm_jobs_with_the_declared_resources(slurm_env, tiny_run,
                                                                                 tmp_path):
    workdir, config = tiny_run
    run_through_slurm(slurm_env, workdir, config, _test_profile(tmp_path / "profile"), TARGETS,
                      PREFLIGHT_RULES)
    for target in TARGETS:
        assert (workdir / target).is_file(), target


@pytest.mark.skipif(not os.environ.get("DRAFTSMITH_SLURM_FULL"),
                    reason="the whole workflow through SLURM takes ~6 min; set DRAFTSMITH_SLURM_FULL=1")
def test_whole_workflow_runs_as_slurm_jobs(slurm_env, tiny_run, tmp_path):
    workdir, config = tiny_run
    run_through_slurm(slurm_env, workdir, config, _test_profile(tmp_path / "profile"), [], ALL_RULES)
    assert (workdir / "results/t/eval/acceptance.json").is_file()
