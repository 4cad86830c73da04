"""Run the real workflow with `snakemake` on a private copy of the repository's workflow files.

The copy includes the draftsmith package, put first on PYTHONPATH, so a test may edit package
code (to prove that caching follows it) without touching the checkout.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_PARTS = ["Snakefile", "rules", "workflow_scripts", "config", "report", "envs", "profiles", "draftsmith"]
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
# the console script beside this Python, or the module where the package alone was installed (pip --target)
SNAKEMAKE_COMMAND = [SNAKEMAKE] if Path(SNAKEMAKE).exists() else [sys.executable, "-m", "snakemake"]


def copy_workflow(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / part)
    return dest


def write_config(workdir: Path, config: dict, name: str = "test.yaml") -> Path:
    path = workdir / name
    path.write_text(yaml.safe_dump(config))
    return path


def path_first(*folders: Path) -> dict[str, str]:
    """This process's environment with ``folders`` first on PYTHONPATH, before what it held (where a
    machine installs packages through PYTHONPATH, as the GPU kit does, they stay importable)."""
    path = os.pathsep.join(p for p in (*map(str, folders), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def snakemake(workdir: Path, *args: str, configfile: Path | None = None, check: bool = True,
              timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**path_first(workdir), "PYTHONUNBUFFERED": "1"}
    cmd = [*SNAKEMAKE_COMMAND, "--cores", "2", "--resources", "gpu=0"]
    if configfile is not None:
        cmd.append(f"--configfile={configfile}")  # "=": the option takes several values
    result = subprocess.run([*cmd, *args], cwd=workdir, env=env, capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    return result


def planned_rules(result: subprocess.CompletedProcess) -> set[str]:
    """Rules a dry run would execute, read from its job table."""
    text = result.stdout + result.stderr
    return set(re.findall(r"^(?:local)?rule (\w+):", text, flags=re.M)) - {"all", "preflight", "extract"}


def tiny_workflow(tmp_path: Path, **data: object) -> tuple[Path, dict]:
    """A private copy of the workflow and a config for a tiny random-init target on CPU, with 40
    short conversations; ``data`` overrides keys of the config's data section."""
    import tiny

    workdir = copy_workflow(tmp_path / "wf")
    model = tiny.build_llama(tmp_path / "model")
    rows = [{"messages": [{"role": "user", "content": f"Hello there number {i}"},
                          {"role": "assistant", "content": f"I am fine, thank you {i}."}]} for i in range(40)]
    source = tiny.write_jsonl(tmp_path / "chats.jsonl", rows)
    # each job loads and closes its own engine, as before the warm target (tests/test_warm.py and the
    # GPU lane's workflow case test warm engines)
    config = {"run": "t", "device": "cpu", "target": {"source": "path", "path": str(model)},
              "data": {"sources": [str(source)], "max_seq_len": 64, "heldout_fraction": 0.1, **data},
              "warm_target": {"minutes": 0}}
    return workdir, config


def planned_jobs(result: subprocess.CompletedProcess) -> dict[str, dict]:
    """Per rule of a dry run's job table (the last job of a rule wins): its threads, resources and
    scheduling priority."""
    jobs: dict[str, dict] = {}
    text = result.stdout + result.stderr
    for block in re.split(r"\n(?=\[)|\n\s*\n", text):
        match = re.search(r"^(?:local)?rule (\w+):", block, flags=re.M)
        if not match:
            continue
        threads = re.search(r"^\s+threads: (\d+)", block, flags=re.M)
        resources = re.search(r"^\s+resources: (.*)$", block, flags=re.M)
        priority = re.search(r"^\s+priority: (\d+)", block, flags=re.M)
        pairs = [p.split("=", 1) for p in resources.group(1).split(", ")] if resources else []
        jobs[match.group(1)] = {
            "threads": int(threads.group(1)) if threads else 1,
            "resources": {k: int(v) if v.isdigit() else v for k, v in pairs},
            "priority": int(priority.group(1)) if priority else 0,
        }
    return jobs


# The GPU lane's whole-workflow cases (tests/test_gpu_workflow.py, bench/target_loads.py): target
# builder, its dtype, and whether the HF loop checks vLLM token for token.
VLLM_CASES = {
    "llama": ("build_llama", "float32", True),
    # the trial target: DeepSeek's head sizes (on CUDA), 16 routed experts, 6 layers
    "deepseek_v3": ("build_deepseek_v3", "bfloat16", False),
}
VLLM_PROMPTS, VLLM_NEW_TOKENS = 4, 16


def vllm_workflow(tmp_path: Path, case: str, **overrides: dict) -> tuple[Path, Path, dict]:
    """``tiny_workflow`` with every stage that runs the target in vLLM on a GPU: 40 conversations
    regenerated at 16 tokens, 2 epochs, 4 prompts evaluated at k = 3 (the k sweep runs in the HF loop
    only); ``overrides`` replace whole config sections. Returns the workdir, the config file and
    the config."""
    import tiny
    import tiny_vllm

    builder, dtype, hf_check = VLLM_CASES[case]
    if builder == "build_llama":
        model = tiny.build_llama(tmp_path / "vllm-target")
    else:
        model = tiny_vllm.build_deepseek_v3_for_platform(tmp_path / "vllm-target", n_routed_experts=16,
                                                         num_hidden_layers=6)
    workdir, config = tiny_workflow(tmp_path)
    config.update(
        device="cuda", target={"source": "path", "path": str(model), "dtype": dtype},
        regenerate={"enabled": True, "backend": "vllm", "max_new_tokens": VLLM_NEW_TOKENS, "enforce_eager": True},
        extraction={"backend": "vllm"}, vocab={"draft_vocab_size": 64}, train={"epochs": 2, "batch_tokens": 256},
        eval={"backend": "vllm", "hf_check": hf_check, "enforce_eager": True, "max_prompts": VLLM_PROMPTS,
              "max_new_tokens": VLLM_NEW_TOKENS, "k_sweep": [1, 3], "sweep_max_prompts": 2},
        warm_target={"minutes": 10})
    for section, value in overrides.items():
        config[section] = {**config.get(section, {}), **value}
    return workdir, write_config(workdir, config), config


def stage_seconds(workdir: Path, run: str = "t") -> dict[str, float]:
    """Each job's wall seconds, from Snakemake's benchmark files."""
    seconds, root = {}, workdir / "benchmarks" / run
    for path in sorted(root.rglob("*.tsv")):
        with open(path) as f:
            seconds[str(path.relative_to(root).with_suffix(""))] = float(next(csv.DictReader(f, delimiter="\t"))["s"])
    return seconds


def target_loads(workdir: Path, run: str = "t") -> dict[str, list[tuple[str, float]]]:
    """Each job's target loads and their seconds, as engines.loads logs them ("target load N of this
    job: ... in S s")."""
    root = workdir / "logs" / run
    return {str(path.relative_to(root).with_suffix("")):
            [(what, float(s)) for what, s in re.findall(r"target load \d+ of this job: (.*) in ([\d.]+) s", path.read_text())]
            for path in sorted(root.rglob("*.log"))}


def engine_starts(workdir: Path, run: str = "t") -> dict[str, list[str]]:
    """Where each warm engine a job started spent its start, as engines.warm logs it ("was ready S s
    after its process started: the process and its imports ..., vLLM's load ...")."""
    root = workdir / "logs" / run
    return {str(path.relative_to(root).with_suffix("")):
            re.findall(r"was ready [\d.]+ s after its process started: (.*)", path.read_text())
            for path in sorted(root.rglob("*.log"))}
