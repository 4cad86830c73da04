"""Run the real workflow with `snakemake` on a private copy of the repository's workflow files.

The copy includes the draftsmith package, put first on PYTHONPATH, so a test may edit package
code (to prove that caching follows it) without touching the checkout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_PARTS = ["Snakefile", "rules", "workflow_scripts", "config", "report", "envs", "draftsmith"]
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


def snakemake(workdir: Path, *args: str, configfile: Path | None = None, check: bool = True,
              timeout: int = 900) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(workdir), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
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
    config = {"run": "t", "device": "cpu", "target": {"source": "path", "path": str(model)},
              "data": {"sources": [str(source)], "max_seq_len": 64, "heldout_fraction": 0.1, **data}}
    return workdir, config


def planned_jobs(result: subprocess.CompletedProcess) -> dict[str, dict]:
    """Per rule of a dry run's job table (the last job of a rule wins): its threads and resources."""
    jobs: dict[str, dict] = {}
    text = result.stdout + result.stderr
    for block in re.split(r"\n(?=\[)|\n\s*\n", text):
        match = re.search(r"^(?:local)?rule (\w+):", block, flags=re.M)
        if not match:
            continue
        threads = re.search(r"^\s+threads: (\d+)", block, flags=re.M)
        resources = re.search(r"^\s+resources: (.*)$", block, flags=re.M)
        pairs = [p.split("=", 1) for p in resources.group(1).split(", ")] if resources else []
        jobs[match.group(1)] = {
            "threads": int(threads.group(1)) if threads else 1,
            "resources": {k: int(v) if v.isdigit() else v for k, v in pairs},
        }
    return jobs
