"""The catalogue of bad inputs (docs/errors.md): each one stops the stage that meets it with an
error that says what is wrong, where and how to fix it, and leaves no output that looks complete.

Every case calls the package function its rule calls; a handful run through real `snakemake`,
which must exit non-zero with the rule's output absent.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml

import tiny
from draftsmith.config import check_config, check_semantics
from draftsmith.data import DataSettings, prepare_dataset
from draftsmith.errors import (
    ConfigError,
    DataError,
    DraftsmithError,
    EvaluationError,
    ExtractionError,
    StorageError,
    TargetError,
    TrainingError,
)
from draftsmith.extract.extract import extract_part
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.gate import PreflightGateError, gate_for_run, mark_planned, record_verdict, wait_for_preflight
from draftsmith.placement import DEVICES_ENV, PlacementError, claim_devices
from draftsmith.targets.inspect import write_target_json
from draftsmith.vocab import build_vocab_mapping
from draftsmith.workflow_hooks import check_workflow_profile
from workflow_helpers import ROOT, copy_workflow, snakemake, write_config

SCHEMA = ROOT / "config" / "schema.yaml"
CATALOGUE = ROOT / "docs" / "errors.md"
DATA_OUTPUTS = ("out/train.jsonl", "out/heldout.jsonl", "out/stats.json")
CASES: dict[str, tuple] = {}


def case(name: str, error: type, says: str, *outputs: str):
    """Register a bad input: ``run(tmp, env)`` must raise ``error`` whose message holds ``says``,
    and none of ``outputs`` (relative to tmp) may exist afterwards."""
    def register(run):
        CASES[name] = (run, error, says, outputs)
        return run
    return register


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny target (8 layers, 384 tokens, ChatML template) and its target.json."""
    root = tmp_path_factory.mktemp("bad_inputs")
    model = tiny.build_llama(root / "model")
    write_target_json(root / "target.json", model)
    return {"model": model, "target": root / "target.json"}


# ---------------------------------------------------------------------------------------------
# Configuration: checked before any job runs


def _check(patch: dict, cwd: Path | None = None) -> None:
    from snakemake.utils import validate

    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    with contextlib.chdir(cwd) if cwd else contextlib.nullcontext():
        check_config(config, SCHEMA, ["my.yaml"])
        config = copy.deepcopy(config)
        validate(config, str(SCHEMA))
        check_semantics(config, ["my.yaml"])


@case("config-unknown-key", ConfigError, "train.ttt_stepz: unknown key; allowed here:")
def _(tmp, env):
    _check({"train": {"ttt_stepz": 3}})


@case("config-wrong-type", ConfigError, "train.ttt_steps: 'three' is not of type 'integer'")
def _(tmp, env):
    _check({"train": {"ttt_steps": "three"}})


@case("config-out-of-range", ConfigError, "train.lr: -1 is less than or equal to the minimum of 0")
def _(tmp, env):
    _check({"train": {"lr": -1}})


@case("config-not-a-finite-number", ConfigError, "train.epochs: nan is not a finite number")
def _(tmp, env):
    _check({"train": {"epochs": float("nan")}})  # YAML's .nan: every range check is false for it


@case("config-unknown-choice", ConfigError, "extraction.dtype: 'int4' is not one of")
def _(tmp, env):
    _check({"extraction": {"dtype": "int4"}})


@case("config-run-outside-results", ConfigError, "run: '../elsewhere' does not match")
def _(tmp, env):
    _check({"run": "../elsewhere"})


@case("config-heldout-fraction-0", ConfigError, "data.heldout_fraction: 0 is less than or equal to the minimum")
def _(tmp, env):
    _check({"data": {"heldout_fraction": 0}})


@case("config-heldout-fraction-1", ConfigError, "data.heldout_fraction: 1 is greater than or equal to the maximum")
def _(tmp, env):
    _check({"data": {"heldout_fraction": 1}})


@case("config-cpu-bfloat16-neither-1-nor-0", ConfigError, "DRAFTSMITH_CPU_BFLOAT16 is 'yes', neither 1 nor 0")
def _(tmp, env):
    with mock.patch.dict(os.environ, {"DRAFTSMITH_CPU_BFLOAT16": "yes"}):
        _check({})


@case("config-target-path-missing", ConfigError, "target.path: required when target.source is 'path'")
def _(tmp, env):
    _check({"target": {"source": "path"}})


@case("config-target-path-not-a-folder", ConfigError, "is not a folder")
def _(tmp, env):
    _check({"target": {"source": "path", "path": str(tmp / "nowhere")}})


@case("config-target-without-config", ConfigError, "has no config.json")
def _(tmp, env):
    _check({"target": {"source": "path", "path": str(tmp)}})


@case("config-data-source-missing", ConfigError, "data.sources: ")
def _(tmp, env):
    _check({"data": {"sources": [str(tmp / "missing.jsonl")]}})


@case("config-data-source-twice", ConfigError, "is the source")
def _(tmp, env):
    source = tiny.write_jsonl(tmp / "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "hello"}]}])
    _check({"data": {"sources": [str(source), f"{tmp}/./chats.jsonl"]}})


@case("config-eval-source-missing", ConfigError, "eval.sources[0].path: ")
def _(tmp, env):
    _check({"eval": {"sources": [{"name": "mt-bench", "path": str(tmp / "missing.jsonl")}]}})


@case("config-eval-source-name-twice", ConfigError, "eval.sources[1].name: 'gsm8k' is used twice")
def _(tmp, env):
    source = str(tiny.write_jsonl(tmp / "gsm8k.jsonl", [{"question": "2 + 2?"}]))
    _check({"eval": {"sources": [{"name": "gsm8k", "path": source}, {"name": "gsm8k", "path": source}]}})


@case("config-layer-repeated", ConfigError, "target.aux_layer_ids: [2, 2] repeats a layer")
def _(tmp, env):
    _check({"target": {"aux_layer_ids": [2, 2]}})


@case("config-tensor-parallel-hf", ConfigError, "extraction.device_map: auto")
def _(tmp, env):
    _check({"extraction": {"tensor_parallel_size": 2}})


@case("config-batch-smaller-than-a-sample", ConfigError, "train.batch_tokens: 512 is smaller than data.max_seq_len (1024)")
def _(tmp, env):
    _check({"data": {"max_seq_len": 1024}, "train": {"batch_tokens": 512}})


@case("config-max-model-len-below-max-seq-len", ConfigError, "extraction.max_model_len: 256 is smaller than data.max_seq_len")
def _(tmp, env):
    _check({"data": {"max_seq_len": 512}, "extraction": {"max_model_len": 256}})


@case("config-answers-longer-than-samples", ConfigError, "regenerate.max_new_tokens: 512 is not below data.max_seq_len")
def _(tmp, env):
    _check({"data": {"max_seq_len": 256}, "regenerate": {"enabled": True, "max_new_tokens": 512}})


@case("config-self-written-requests-longer-than-samples", ConfigError,
      "synthesize.max_prompt_tokens: 512 is not below data.max_seq_len")
def _(tmp, env):
    _check({"data": {"sources": ["self"], "max_seq_len": 512}, "synthesize": {"max_prompt_tokens": 512}})


@case("self-written-template-without-an-end-of-turn", DataError, "closes a user turn without a special token",
      "preflight.json")
def _(tmp, env):
    from draftsmith.preflight import check_setup

    plain = tiny.build_llama(tmp / "plain", "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    check_setup(plain, [], tmp / "preflight.json", _settings(), self_written=[None])


@case("config-online-several-parts", ConfigError, "extraction.parts: 2 with train.mode: online")
def _(tmp, env):
    _check({"train": {"mode": "online"}, "extraction": {"parts": 2}})


@case("online-window-below-a-step", ConfigError, "online.window_tokens is 10", "draft/model.safetensors")
def _(tmp, env):
    from draftsmith.online import OnlineSettings, run_online_training
    from draftsmith.train import TrainSettings

    train = tiny.write_jsonl(tmp / "train.jsonl", tiny.random_train_rows(8))
    build_vocab_mapping(train, 384, 128, tmp / "mapping.safetensors", tmp / "vocab_stats.json")
    run_online_training(train, env["target"], tmp / "mapping.safetensors", tmp / "draft", tmp / "work",
                        TrainSettings(batch_tokens=96, device="cpu", progress=False),
                        ExtractionSettings(device="cpu", shard_tokens=60, batch_tokens=64, min_free_bytes=0),
                        OnlineSettings(window_tokens=10))


@case("config-draft-vocab-below-floor", ConfigError, "vocab.draft_vocab_size: 1 is less than the minimum of 32")
def _(tmp, env):
    _check({"vocab": {"draft_vocab_size": 1}})


@case("config-data-source-unsupported-type", ConfigError, "unsupported file type '.csv'")
def _(tmp, env):
    (tmp / "rows.csv").write_text("prompt,answer\nhi,hello\n")
    _check({"data": {"sources": [str(tmp / "rows.csv")]}})


@case("config-data-source-not-gzip", ConfigError, "is named .jsonl.gz but is not gzip-compressed")
def _(tmp, env):
    _check({"data": {"sources": [str(tiny.write_jsonl(tmp / "rows.jsonl.gz", [_chat(0)]))]}})


@case("config-results-unwritable", ConfigError, "the workflow writes to results/demo/, but")
def _(tmp, env):
    (tmp / "results").write_text("a file where the results folder should be")
    _check({}, cwd=tmp)


@case("workflow-profile-shadowed", ConfigError, "Snakemake read ./default as the workflow profile")
def _(tmp, env):
    # a folder ./default with a config.yaml of its own: Snakemake reads it instead of profiles/default
    (tmp / "default").mkdir()
    (tmp / "default" / "config.yaml").write_text("cores: 2\n")
    check_workflow_profile({"mtime", "params", "input", "software_env", "code"}, tmp, ROOT)


# ---------------------------------------------------------------------------------------------
# Datasets: prepare_dataset


def _chat(i: int, user: str | None = None) -> dict:
    return {"messages": [{"role": "user", "content": user or f"Hello there, how are you doing today? ({i})"},
                         {"role": "assistant", "content": "I am fine, thank you."}]}


def _prepare(tmp: Path, env: dict, sources, **settings) -> None:
    prepare_dataset(sources, env["model"], tmp / "out", DataSettings(**settings))


@case("eval-source-without-prompts", DataError, "no usable prompt in the evaluation set", "out/set.jsonl",
      "out/set.stats.json")
def _(tmp, env):
    from draftsmith.eval_prompts import EvalPromptsSettings, prepare_eval_prompts

    rows = [{"answer": str(i), "solution": "x"} for i in range(4)]  # no prompt field anywhere
    prepare_eval_prompts(tiny.write_jsonl(tmp / "set_in.jsonl", rows), env["model"], tmp / "out" / "set.jsonl",
                         EvalPromptsSettings(max_prompts=8, max_seq_len=64, max_bad_fraction=1.0))


@case("data-worker-killed", DraftsmithError, "a worker process of this stage ended without a word", *DATA_OUTPUTS)
def _(tmp, env):
    from unittest import mock

    import draftsmith.data

    parent, read = os.getpid(), draftsmith.data.to_row

    def killed_in_a_worker(raw, fmt):  # as the out-of-memory killer leaves a worker: no exception, no message
        if os.getpid() != parent:
            os._exit(9)
        return read(raw, fmt)

    with mock.patch.object(draftsmith.data, "to_row", killed_in_a_worker):
        prepare_dataset([tiny.write_jsonl(tmp / "chat.jsonl", [_chat(i) for i in range(8)])], env["model"],
                        tmp / "out", DataSettings(), workers=2)


@case("data-empty-file", DataError, "holds no rows", *DATA_OUTPUTS)
def _(tmp, env):
    (tmp / "empty.jsonl").write_bytes(b"")
    _prepare(tmp, env, [tiny.write_jsonl(tmp / "good.jsonl", [_chat(i) for i in range(5)]), tmp / "empty.jsonl"])


@case("data-not-utf8", DataError, "re-save the file as UTF-8", *DATA_OUTPUTS)
def _(tmp, env):
    rows = [json.dumps(_chat(i, f"Café crème number {i}?"), ensure_ascii=False) for i in range(6)]
    (tmp / "latin1.jsonl").write_bytes("\n".join(rows).encode("latin-1"))
    _prepare(tmp, env, [tmp / "latin1.jsonl"])


@case("data-broken-lines", DataError, "invalid_json=4", *DATA_OUTPUTS)
def _(tmp, env):
    lines = [json.dumps(_chat(i)) for i in range(8)]
    for i in (1, 3, 5, 7):
        lines[i] = lines[i][: len(lines[i]) // 2]  # cut mid-row, as a crashed writer leaves it
    (tmp / "broken.jsonl").write_text("\n".join(lines) + "\n")
    _prepare(tmp, env, [tmp / "broken.jsonl"])


@case("data-line-of-100-mb", DataError, "line_too_long=1", *DATA_OUTPUTS)
def _(tmp, env):
    path = tmp / "huge.jsonl"
    with path.open("wb") as f:
        for i in range(3):
            f.write(json.dumps(_chat(i)).encode() + b"\n")
        f.write(b'{"messages": [{"role": "user", "content": "' + b"x" * (100 << 20) + b'"}]}\n')
    _prepare(tmp, env, [path])


@case("data-only-system-turns", DataError, "no_assistant_turn=6", *DATA_OUTPUTS)
def _(tmp, env):
    rows = [{"messages": [{"role": "system", "content": f"You are helpful ({i})."}]} for i in range(6)]
    _prepare(tmp, env, [tiny.write_jsonl(tmp / "system.jsonl", rows)])


@case("data-only-an-opening-assistant-turn", DataError, "no assistant turn follows a user or tool turn", *DATA_OUTPUTS)
def _(tmp, env):
    # the bot greets, the user asks, and nothing answers: the greeting is context, not an answer
    rows = [{"conversations": [{"from": "gpt", "value": f"Hi! How can I help? ({i})"},
                               {"from": "human", "value": "What is the weather like?"}]} for i in range(6)]
    _prepare(tmp, env, [tiny.write_jsonl(tmp / "greetings.jsonl", rows)])


@case("data-first-turn-over-max-seq-len", DataError, "too_long_prompt: raise data.max_seq_len", *DATA_OUTPUTS)
def _(tmp, env):
    rows = [_chat(i, " ".join(["What is the weather like today?"] * 20) + f" ({i})") for i in range(6)]
    _prepare(tmp, env, [tiny.write_jsonl(tmp / "long.jsonl", rows)], max_seq_len=32)


@case("data-every-row-filtered", DataError, "no usable rows", *DATA_OUTPUTS)
def _(tmp, env):
    rows = [{"prompt": "x", "completion": "y"}] * 4
    _prepare(tmp, env, [tiny.write_jsonl(tmp / "filtered.jsonl", rows)], max_bad_fraction=1.0)


@case("data-one-usable-row", DataError, "nothing is left to train on", *DATA_OUTPUTS)
def _(tmp, env):
    _prepare(tmp, env, [tiny.write_jsonl(tmp / "one.jsonl", [_chat(0)])])


def _tool_chat(i: int) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
            "messages": [{"role": "user", "content": f"Weather in Paris? ({i})"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                         {"role": "tool", "content": "sunny"},
                         {"role": "assistant", "content": "It is sunny."}]}


@case("data-every-prompt-held-out", DataError, "shares its prompt (the turns before the first answer) with a "
                                               "held-out row", *DATA_OUTPUTS)
def _(tmp, env):
    rows = [_chat(0, user="What is your name?") for _ in range(8)]
    _prepare(tmp, env, [tiny.write_jsonl(tmp / "one_prompt.jsonl", rows)])


@case("data-text-alone", DataError, "no prompt to hold out for evaluation", *DATA_OUTPUTS)
def _(tmp, env):
    rows = [{"text": f"The quick brown fox jumps over the lazy dog ({i})."} for i in range(8)]
    _prepare(tmp, env, [tiny.write_jsonl(tmp / "text.jsonl", rows)], format="text")


@case("data-every-held-out-row-bad", DataError, "no held-out prompt left", *DATA_OUTPUTS)
def _(tmp, env):
    from draftsmith.data import load_conversations, prompt_key, split_heldout

    # tool-call rows, which the tiny target's plain ChatML template cannot render, and a seed that holds them out
    rows = [_chat(i) for i in range(10)] + [{**_tool_chat(i), "id": f"tool{i}"} for i in range(2)]
    source = tiny.write_jsonl(tmp / "mixed.jsonl", rows)
    keys = {row.id: prompt_key(row.messages, row.tools) for row in load_conversations([source])}
    seed = next(s for s in range(200) if split_heldout(keys, DataSettings(seed=s)) <= {"tool0", "tool1"})
    _prepare(tmp, env, [source], seed=seed, max_bad_fraction=0.5)


@case("regenerate-too-many-bad-rows", DataError, "4 of 6 rows (66.7%) are unusable, more than data.max_bad_fraction",
      "out/regenerated.jsonl")
def _(tmp, env):
    from draftsmith.regenerate.settings import RegenerateSettings
    from draftsmith.regenerate.stage import regenerate_responses

    lines = [json.dumps(_chat(i)) for i in range(2)] + ['{"messages": ['] * 4  # cut mid-row
    (tmp / "broken.jsonl").write_text("\n".join(lines) + "\n")
    regenerate_responses([tmp / "broken.jsonl"], env["model"], tmp / "out" / "regenerated.jsonl", tmp / "work",
                         RegenerateSettings(device="cpu", max_new_tokens=4))


@case("regenerate-target-writes-empty-answers", TargetError, "more than data.max_bad_fraction=0.2: prepare_dataset "
      "would drop their conversations", "out/regenerated.jsonl")
def _(tmp, env):
    from draftsmith.regenerate.settings import RegenerateSettings
    from draftsmith.regenerate.stage import regenerate_responses

    # A random target with a vocabulary of 4096 ids and a tokenizer of 384 (weights and tokenizer that
    # do not belong together): most ids it writes decode to nothing.
    model = tiny.build_llama(tmp / "mismatched", vocab_size=4096)
    source = tiny.write_jsonl(tmp / "chats.jsonl", [_chat(i) for i in range(6)])
    regenerate_responses([source], model, tmp / "out" / "regenerated.jsonl", tmp / "work",
                         RegenerateSettings(device="cpu", max_new_tokens=1, model_dtype="float32",
                                            max_bad_fraction=0.2))


@case("data-lone-surrogates", DataError, "invalid_unicode=4", *DATA_OUTPUTS)
def _(tmp, env):
    lines = [json.dumps(_chat(i)) for i in range(6)]
    lines += ['{"messages": [{"role": "user", "content": "cut emoji \\ud83d"}, {"role": "assistant", "content": "ok"}]}'] * 4
    (tmp / "surrogates.jsonl").write_text("\n".join(lines) + "\n")
    _prepare(tmp, env, [tmp / "surrogates.jsonl"])


@case("data-tool-calls-without-a-name", DataError, "invalid_tool_call=4", *DATA_OUTPUTS)
def _(tmp, env):
    broken = _tool_chat(0)
    del broken["messages"][1]["tool_calls"][0]["function"]["name"]
    _prepare(tmp, env, [tiny.write_jsonl(tmp / "calls.jsonl", [_chat(i) for i in range(6)] + [broken] * 4)])


@case("data-template-without-tool-calls", DataError, "does not render the assistant's tool calls", *DATA_OUTPUTS)
def _(tmp, env):
    # The target's plain ChatML template renders content only: the tool calls would vanish.
    _prepare(tmp, env, [tiny.write_jsonl(tmp / "agentic.jsonl", [_chat(i) for i in range(4)]
                                         + [_tool_chat(i) for i in range(6)])])


@case("data-gzip-truncated", DataError, "cannot be decompressed", *DATA_OUTPUTS)
def _(tmp, env):
    import gzip

    rows = "".join(json.dumps(_chat(i)) + "\n" for i in range(300)).encode()
    (tmp / "cut.jsonl.gz").write_bytes(gzip.compress(rows)[:500])
    _prepare(tmp, env, [tmp / "cut.jsonl.gz"])


@case("data-json-not-a-list", DataError, "holds a JSON dict, not a list of rows", *DATA_OUTPUTS)
def _(tmp, env):
    (tmp / "object.json").write_text(json.dumps({"rows": [_chat(0)]}))
    _prepare(tmp, env, [tmp / "object.json"])


@case("data-json-broken", DataError, "is not valid JSON", *DATA_OUTPUTS)
def _(tmp, env):
    (tmp / "broken.json").write_text('[{"messages": [}')
    _prepare(tmp, env, [tmp / "broken.json"])


@case("data-unsupported-file-type", DataError, "unsupported file type '.csv'", *DATA_OUTPUTS)
def _(tmp, env):
    (tmp / "rows.csv").write_text("prompt,answer\nhi,hello\n")
    _prepare(tmp, env, [tmp / "rows.csv"])


@case("data-source-missing", DataError, "does not exist", *DATA_OUTPUTS)
def _(tmp, env):
    _prepare(tmp, env, [tmp / "missing.jsonl"])


@case("data-tokenizer-without-chat-template", DataError, "no chat template", *DATA_OUTPUTS)
def _(tmp, env):
    folder = tiny.build_tokenizer(tmp / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    prepare_dataset([tiny.write_jsonl(tmp / "chat.jsonl", [_chat(i) for i in range(4)])], folder, tmp / "out",
                    DataSettings())


@case("data-results-unwritable", StorageError, "make the folder writable", *DATA_OUTPUTS)
def _(tmp, env):
    source = tiny.write_jsonl(tmp / "good.jsonl", [_chat(i) for i in range(5)])
    with _read_only(tmp / "out"):
        _prepare(tmp, env, [source])


@contextlib.contextmanager
def _read_only(folder: Path):
    """A folder nobody may write to: a read-only tmpfs as root (who ignores permissions), else chmod."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True)
        if mount.returncode != 0:
            pytest.skip("as root, a read-only folder needs a read-only mount, and mount failed")
        try:
            yield folder
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=False)
    else:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)


# ---------------------------------------------------------------------------------------------
# Target model folders: inspect_target (preflight, no weights read) and the extraction load


def _inspect(tmp: Path, folder: Path, **kwargs) -> None:
    write_target_json(tmp / "target.json", folder, **kwargs)


@case("model-without-config", TargetError, "the target folder has no config.json", "target.json")
def _(tmp, env):
    _inspect(tmp, tiny.build_tokenizer(tmp / "m"))


@case("model-config-not-json", TargetError, "config.json is not valid JSON", "target.json")
def _(tmp, env):
    folder = tiny.build_tokenizer(tmp / "m")
    (folder / "config.json").write_text('{"model_type": "llama",')
    _inspect(tmp, folder)


@case("model-without-tokenizer", TargetError, "tokenizer", "target.json")
def _(tmp, env):
    _inspect(tmp, tiny.build_llama(tmp / "m", tokenizer_template=None, num_layers=4))


@case("model-tokenizer-of-another-model", TargetError, "they belong to different models", "target.json")
def _(tmp, env):
    _inspect(tmp, tiny.build_llama(tmp / "m", vocab_size=100, num_layers=4))


@case("model-tokenizer-without-chat-template", TargetError, "no chat template", "target.json")
def _(tmp, env):
    folder = tiny.build_llama(tmp / "m", num_layers=4)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    _inspect(tmp, folder)


@case("model-remote-code-not-trusted", TargetError, "set target.trust_remote_code: true", "target.json")
def _(tmp, env):
    folder = tiny.build_llama(tmp / "m", num_layers=4)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="my_custom_lm", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    _inspect(tmp, folder)


@case("model-pickled-weights-only", TargetError, "weights are pickled (pytorch_model.bin)", "target.json")
def _(tmp, env):
    from safetensors.torch import load_file

    folder = tiny.build_llama(tmp / "m", num_layers=4)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    _inspect(tmp, folder)


@case("model-layer-out-of-range", TargetError, "aux layer ids [8] are out of range", "target.json")
def _(tmp, env):
    _inspect(tmp, env["model"], aux_layer_ids=[2, 8])


@case("model-layer-repeated", TargetError, "repeat a layer", "target.json")
def _(tmp, env):
    _inspect(tmp, env["model"], aux_layer_ids=[2, 2, 3])


@case("model-embedding-not-hidden-width", TargetError, "it projects between them", "target.json")
def _(tmp, env):
    from transformers import OPTConfig, OPTForCausalLM

    # OPT-350m's shape: 32-wide word embeddings projected to 64-wide hidden states (project_in/project_out)
    folder = tiny.build_tokenizer(tmp / "m")
    OPTForCausalLM(OPTConfig(vocab_size=384, hidden_size=64, word_embed_proj_dim=32, ffn_dim=128, num_hidden_layers=4,
                             num_attention_heads=2, max_position_embeddings=512)).save_pretrained(folder)
    _inspect(tmp, folder)


@case("model-lm-head-with-a-bias", TargetError, "adds a bias to its logits", "target.json")
def _(tmp, env):
    from transformers import PhiConfig, PhiForCausalLM

    # Phi-1/1.5/2's head: Linear(hidden, vocab, bias=True)
    folder = tiny.build_tokenizer(tmp / "m")
    PhiForCausalLM(PhiConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=2, max_position_embeddings=512)).save_pretrained(folder)
    _inspect(tmp, folder)


@case("model-too-large-for-the-hf-paths", TargetError, "set regenerate.backend: vllm", "target.json")
def _(tmp, env):
    folder = tmp / "m"
    shutil.copytree(env["model"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=16384, intermediate_size=53248, num_hidden_layers=64, num_attention_heads=128,
                  num_key_value_heads=8, head_dim=128)  # ~210B parameters: 420 GB in bf16
    (folder / "config.json").write_text(json.dumps(config))
    _inspect(tmp, folder, dtype="bfloat16", hf_stages={"regenerate_responses": 1})


@case("model-too-large-for-host-memory", TargetError, "into this machine's memory", "target.json")
def _(tmp, env):
    from unittest import mock

    # device: cpu with extraction on the hf backend; the tiny target's 2 MB (float32) on a 1 MB machine
    with mock.patch.dict(os.environ), mock.patch("draftsmith.placement.host_memory_bytes", lambda: 10**6):
        os.environ.pop("SLURM_JOB_ID", None)
        _inspect(tmp, env["model"], hf_stages={"extract_hidden_states": 0})


@case("device-cuda-without-a-gpu", ConfigError, "device: cuda, but torch sees no CUDA GPU", "target.json")
def _(tmp, env):
    from unittest import mock

    from draftsmith.targets.inspect import hf_stages

    config = {"device": "cuda", "regenerate": {"enabled": False, "backend": "hf"}, "eval": {"backend": "hf"},
              "extraction": {"backend": "hf", "tensor_parallel_size": 1, "device_map": None}}
    with mock.patch.dict(os.environ), mock.patch.object(torch.cuda, "is_available", lambda: False):
        os.environ.pop("SLURM_JOB_ID", None)
        _inspect(tmp, env["model"], hf_stages=hf_stages(config, gpu=True))


def _settings(**changes):
    """check_setup's settings: the demo's on the CPU, with ``changes`` as {"section.key": value}."""
    from draftsmith.preflight import PreflightSettings

    config = {"device": "cpu", "data": {"max_seq_len": 64}, "vocab": {"draft_vocab_size": 100},
              "draft": {"num_layers": 1}, "train": {"batch_tokens": 1024, "ttt_steps": 3},
              "eval": {"max_new_tokens": 48}, "regenerate": {"enabled": False, "max_new_tokens": 48}}
    for key, value in changes.items():
        section, name = key.split(".")
        config[section][name] = value
    return PreflightSettings.from_config(config)


def _check_setup(tmp: Path, env: dict, settings) -> None:
    from unittest import mock

    from draftsmith.preflight import check_setup

    source = tiny.write_jsonl(tmp / "good.jsonl", [_chat(i) for i in range(4)])
    with mock.patch.dict(os.environ):
        os.environ.pop("SLURM_JOB_ID", None)
        check_setup(env["model"], [source], tmp / "preflight.json", settings)


@case("train-batch-too-large-for-memory", ConfigError, "more than the CPU's memory", "preflight.json")
def _(tmp, env):
    # a million-token batch of samples as long as the tiny target's context: beyond the CPU's memory
    _check_setup(tmp, env, _settings(**{"train.batch_tokens": 1_000_000, "data.max_seq_len": 512}))


@case("eval-max-new-tokens-past-context", ConfigError, "cannot follow any prompt within the target's context",
      "preflight.json")
def _(tmp, env):
    _check_setup(tmp, env, _settings(**{"eval.max_new_tokens": 3000}))  # the tiny target has 512 positions


@case("regenerate-max-new-tokens-past-context", ConfigError, "regenerate.max_new_tokens: 600 new tokens",
      "preflight.json")
def _(tmp, env):
    _check_setup(tmp, env, _settings(**{"regenerate.enabled": True, "regenerate.max_new_tokens": 600,
                                     "data.max_seq_len": 512}))


@case("data-max-seq-len-past-context", ConfigError, "data.max_seq_len: samples of up to 2048 tokens run past the "
      "target's context of 512 positions", "preflight.json")
def _(tmp, env):
    _check_setup(tmp, env, _settings(**{"data.max_seq_len": 2048}))  # the schema's default; the target has 512


@case("eval-vllm-target-without-eagle3", TargetError, "does not implement SupportsEagle3", "preflight.json")
def _(tmp, env):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    folder = shutil.copytree(env["model"], tmp / "gemma3")  # vLLM's Gemma3ForCausalLM lacks the interface
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma3ForCausalLM"]}))
    _check_setup(tmp, {**env, "model": folder}, _settings(**{"eval.backend": "vllm"}))


@case("preflight-template-cannot-render-a-kind-of-row", DataError,
      "cannot render the chats with tool definitions, tool calls", "preflight.json")
def _(tmp, env):
    from draftsmith.preflight import check_setup

    # 100 plain chats, then 30 tool-call rows, whose calls the target's plain ChatML template drops
    source = tiny.write_jsonl(tmp / "agentic.jsonl", [_chat(i) for i in range(100)] + [_tool_chat(i) for i in range(30)])
    check_setup(env["model"], [source], tmp / "preflight.json", _settings())


@case("preflight-template-refuses-an-opening-assistant-turn", DataError,
      "the chat template refuses a conversation that opens with an assistant turn", "preflight.json")
def _(tmp, env):
    from draftsmith.preflight import check_setup

    # a template that enforces user/assistant alternation, and one of 31 chats the bot opens with a greeting
    strict = shutil.copytree(env["model"], tmp / "strict")
    tiny.build_tokenizer(strict, "{% for message in messages | rejectattr('role', 'equalto', 'system') %}"
                                 "{% if (message['role'] == 'user') != loop.index0 is even %}"
                                 "{{ raise_exception('Conversation roles must alternate user/assistant/...') }}"
                                 "{% endif %}{% endfor %}" + tiny.CHATML_TEMPLATE)
    greeted = _chat(30)
    greeted["messages"].insert(0, {"role": "assistant", "content": "Hi! How can I help?"})
    source = tiny.write_jsonl(tmp / "sharegpt.jsonl", [*map(_chat, range(30)), greeted])
    check_setup(strict, [source], tmp / "preflight.json", _settings())


@case("preflight-too-many-prompts-past-max-seq-len", DataError,
      "are unusable, more than data.max_bad_fraction=0.2: too_long_prompt=", "preflight.json")
def _(tmp, env):
    from draftsmith.preflight import check_setup

    # 60 chats, every third with a prompt past data.max_seq_len=64 (33%, more than max_bad_fraction), row 1 short
    long = " ".join(["What is the weather like today?"] * 20)
    rows = [_chat(i, f"{long} ({i})" if i % 3 == 1 else None) for i in range(60)]
    check_setup(env["model"], [tiny.write_jsonl(tmp / "long.jsonl", rows)], tmp / "preflight.json", _settings())


@case("preflight-prompts-without-regeneration", DataError,
      "for prompts without answers, set regenerate.enabled: true", "preflight.json")
def _(tmp, env):
    from draftsmith.preflight import check_setup

    # a prompt set, which regeneration would answer: with it off, no row holds an answer to learn from
    rows = [{"messages": [{"role": "user", "content": f"tell me a story ({i})"}]} for i in range(20)]
    check_setup(env["model"], [tiny.write_jsonl(tmp / "prompts.jsonl", rows)], tmp / "preflight.json", _settings())


@case("extraction-out-of-memory", ExtractionError, "lower extraction.batch_tokens", "hs/part-0.json")
def _(tmp, env):
    from unittest import mock

    from transformers import LlamaForCausalLM

    # what the CPU allocator raises when a forward cannot get its memory
    oom = RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 17384949904 bytes. Error code 12 (Cannot allocate memory)")
    train = tiny.write_jsonl(tmp / "train.jsonl", [{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    with mock.patch.object(LlamaForCausalLM, "forward", side_effect=oom):
        extract_part(train, env["target"], 0, ExtractionSettings(device="cpu", min_free_bytes=0, backend="hf"),
                     tmp / "hs", tmp / "hs" / "part-0.json")


@case("gpus-more-than-the-machine", PlacementError, "the job needs 8 GPUs; this machine has 2")
def _(tmp, env):
    saved = {k: os.environ.pop(k, None) for k in ("SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES", DEVICES_ENV)}
    os.environ[DEVICES_ENV] = "0,1"
    try:
        claim_devices(8)
    finally:
        os.environ.pop(DEVICES_ENV)
        os.environ.update({k: v for k, v in saved.items() if v is not None})


@case("model-without-weights", TargetError, "cannot load the target's weights", "hs/part-0.json")
def _(tmp, env):
    import shutil

    folder = tmp / "m"
    shutil.copytree(env["model"], folder, ignore=shutil.ignore_patterns("*.safetensors"))
    _inspect(tmp, folder)  # preflight reads no weights: a config-only folder passes it
    train = tiny.write_jsonl(tmp / "train.jsonl", [{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    extract_part(train, tmp / "target.json", 0, ExtractionSettings(device="cpu", min_free_bytes=0), tmp / "hs",
                 tmp / "hs" / "part-0.json")


# ---------------------------------------------------------------------------------------------
# Later stages


@case("vocab-draft-larger-than-target", ConfigError, "vocab.draft_vocab_size", "mapping.safetensors")
def _(tmp, env):
    train = tiny.write_jsonl(tmp / "train.jsonl", [{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    build_vocab_mapping(train, 384, 500, tmp / "mapping.safetensors", tmp / "stats.json")


@case("vocab-too-small-for-the-data", ConfigError, "covers only", "mapping.safetensors", "stats.json")
def _(tmp, env):
    rows = [{"id": str(i), "input_ids": list(range(i * 10, i * 10 + 10)), "loss_mask": [1] * 10} for i in range(30)]
    build_vocab_mapping(tiny.write_jsonl(tmp / "train.jsonl", rows), 384, 32, tmp / "mapping.safetensors",
                        tmp / "stats.json")


@case("train-jsonl-duplicate-ids", ExtractionError, "sample id 'a' appears twice (lines 1 and 2)", "hs/part-0.json")
def _(tmp, env):
    rows = [{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}] * 2
    extract_part(tiny.write_jsonl(tmp / "train.jsonl", rows), env["target"], 0,
                 ExtractionSettings(device="cpu", min_free_bytes=0), tmp / "hs", tmp / "hs" / "part-0.json")


@case("train-jsonl-row-without-loss-mask", ExtractionError, "a row lacks id, input_ids or loss_mask", "hs/part-0.json")
def _(tmp, env):
    rows = [{"id": "a", "input_ids": [1, 2, 3]}]
    extract_part(tiny.write_jsonl(tmp / "train.jsonl", rows), env["target"], 0,
                 ExtractionSettings(device="cpu", min_free_bytes=0), tmp / "hs", tmp / "hs" / "part-0.json")


@contextlib.contextmanager
def _held_in_another_process(imports: str, lock: str):
    """``with <lock>:`` entered in another process (the orphaned job of a kill -9-ed snakemake, still
    writing when the rerun starts its own) for as long as the block runs."""
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys; {imports}\nwith {lock}:\n print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline() == b"held\n"
        yield
    finally:
        holder.kill()
        holder.wait()


@case("extraction-part-held-by-another-process", ExtractionError, "is writing extraction part 0", "hs/part-0.json")
def _(tmp, env):
    with _held_in_another_process("from draftsmith.extract.shard_writer import part_lock",
                                  f"part_lock({str(tmp / 'hs')!r}, 0)"):
        train = tiny.write_jsonl(tmp / "train.jsonl", [{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
        extract_part(train, env["target"], 0, ExtractionSettings(device="cpu", min_free_bytes=0), tmp / "hs",
                     tmp / "hs" / "part-0.json")


@case("training-held-by-another-process", TrainingError, "is training in", "draft/model.safetensors")
def _(tmp, env):
    from draftsmith.train import TrainSettings, run_training

    with _held_in_another_process("from pathlib import Path; from draftsmith.train.launch import trainer_lock",
                                  f"trainer_lock(Path({str(tmp / 'work')!r}))"):
        run_training(tmp / "hs" / "index.json", tmp / "mapping.safetensors", env["target"], tmp / "draft", tmp / "work",
                     TrainSettings(device="cpu", progress=False))


@case("regeneration-held-by-another-process", TargetError, "is regenerating answers in", "out/regenerated.jsonl")
def _(tmp, env):
    from draftsmith.regenerate.settings import RegenerateSettings
    from draftsmith.regenerate.stage import regenerate_responses

    source = tiny.write_jsonl(tmp / "chats.jsonl", [_chat(i) for i in range(2)])
    with _held_in_another_process("from pathlib import Path; from draftsmith.io import lock_beside, sole_writer; "
                                  "from draftsmith.errors import TargetError",
                                  f"sole_writer(lock_beside(Path({str(tmp / 'work')!r})), 'regenerating', 'x', "
                                  "TargetError)"):
        regenerate_responses([source], env["model"], tmp / "out" / "regenerated.jsonl", tmp / "work",
                             RegenerateSettings(device="cpu", max_new_tokens=4))


@case("writer-outlived-its-snakemake", ExtractionError, "leaves the rule's outputs to that job's rerun",
      "hs/part-0.json")
def _(tmp, env):
    import sys

    from draftsmith.extract.shard_writer import part_lock

    train = tiny.write_jsonl(tmp / "train.jsonl", [{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    with part_lock(tmp / "hs", 0):  # this process: the orphaned writer
        rerun = subprocess.run([sys.executable, "-c", "from draftsmith.extract.shard_writer import part_lock\n"
                                f"with part_lock({str(tmp / 'hs')!r}, 0): pass"],
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert "is writing extraction part 0" in rerun.stderr  # the rerun's job, refused
        extract_part(train, env["target"], 0, ExtractionSettings(device="cpu", min_free_bytes=0), tmp / "hs",
                     tmp / "hs" / "part-0.json")


@case("target-json-damaged", TargetError, "target.json is not JSON", "eval/acceptance.json")
def _(tmp, env):
    from draftsmith.evaluate import EvalSettings, evaluate_draft

    # a target.json cut short on disk: the stages that read it name it, where json.load said nothing of where
    damaged = tmp / "target.json"
    damaged.write_text(Path(env["target"]).read_text()[:200])
    evaluate_draft(tmp / "draft", damaged, tmp / "heldout.jsonl", tmp / "eval" / "acceptance.json",
                   EvalSettings(device="cpu"))


@case("draft-damaged", EvaluationError, "model.safetensors cannot be read as safetensors", "eval/acceptance.json")
def _(tmp, env):
    from draftsmith.draft.config import Eagle3DraftConfig
    from draftsmith.draft.model import Eagle3Draft
    from draftsmith.draft.speculators_format import save_speculators
    from draftsmith.evaluate import EvalSettings, evaluate_draft
    from draftsmith.io import read_json

    # the delivered draft's weights cut short (a full disk, a copy stopped half-way): named before any load
    config = Eagle3DraftConfig.from_target(read_json(env["target"]), draft_vocab_size=64)
    save_speculators(Eagle3Draft(config), tmp / "draft")
    weights = tmp / "draft" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    evaluate_draft(tmp / "draft", env["target"], tmp / "heldout.jsonl", tmp / "eval" / "acceptance.json",
                   EvalSettings(device="cpu"))


@case("evaluation-held-by-another-process", EvaluationError, "is evaluating a draft into", "eval/acceptance.json")
def _(tmp, env):
    from draftsmith.evaluate import EvalSettings, evaluate_draft

    with _held_in_another_process("from pathlib import Path; from draftsmith.io import lock_beside, sole_writer; "
                                  "from draftsmith.errors import EvaluationError",
                                  f"sole_writer(lock_beside(Path({str(tmp / 'eval')!r})), 'evaluating', 'x', "
                                  "EvaluationError)"):
        evaluate_draft(tmp / "draft", env["target"], tmp / "heldout.jsonl", tmp / "eval" / "acceptance.json",
                       EvalSettings(device="cpu"))


def _train(tmp: Path, env: dict, **settings) -> None:
    """train_draft, as its rule calls it, on a store extracted from 8 random rows of the tiny target
    (about 180 tokens)."""
    from draftsmith.extract.hidden_states import merge_parts
    from draftsmith.train import TrainSettings, train_draft

    train = tiny.write_jsonl(tmp / "train.jsonl", tiny.random_train_rows(8))
    extract_part(train, env["target"], 0, ExtractionSettings(device="cpu", min_free_bytes=0), tmp / "hs",
                 tmp / "hs" / "part-0.json")
    merge_parts([tmp / "hs" / "part-0.json"], tmp / "hs" / "index.json")
    build_vocab_mapping(train, 384, 128, tmp / "mapping.safetensors", tmp / "vocab_stats.json")
    train_draft(tmp / "hs" / "index.json", tmp / "mapping.safetensors", env["target"], tmp / "draft", tmp / "work",
                TrainSettings(device="cpu", progress=False, **settings))


@case("train-warmup-longer-than-the-run", ConfigError, "train.warmup_steps is 1000, longer than the run (",
      "draft/model.safetensors")
def _(tmp, env):
    _train(tmp, env, batch_tokens=96, epochs=5, warmup_steps=1000)


@case("train-step-too-large-for-memory", ConfigError, "positions (the largest micro-batch this run packs from the",
      "draft/model.safetensors")
def _(tmp, env):
    from unittest import mock

    # train.batch_tokens a million, on a store of about 180 tokens and a 1 MB machine
    with mock.patch("draftsmith.placement.host_memory_bytes", lambda: 10**6):
        _train(tmp, env, batch_tokens=1_000_000, warmup_steps=0)


@case("preflight-failed-before-a-load", PreflightGateError, "check_setup failed, so this job did not load the target")
def _(tmp, env):
    # check_setup failed beside a job that loads the target (--keep-going, or started beside it)
    with contextlib.chdir(tmp):
        gate = gate_for_run("t")
        mark_planned(gate, True)
        record_verdict(gate, DataError("no usable rows", where="bad.jsonl"))
        wait_for_preflight(gate)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_with_what_where_and_how_to_fix(name, env, tmp_path):
    run, error, says, outputs = CASES[name]
    with pytest.raises(error) as info:
        run(tmp_path, env)
    e = info.value
    assert isinstance(e, DraftsmithError) and e.what and e.where and e.fix, str(e)
    assert says in str(e), str(e)
    for output in outputs:
        assert not (tmp_path / output).exists(), output
    leftovers = [p for p in tmp_path.rglob(".*.tmp") if p.is_file()]
    assert not leftovers, leftovers


def test_the_catalogue_lists_every_case():
    listed = set(re.findall(r"^\| `([a-z0-9-]+)` \|", CATALOGUE.read_text(), flags=re.M))
    assert listed == set(CASES)
    assert len(CASES) >= 25


# ---------------------------------------------------------------------------------------------
# Through snakemake: a non-zero exit, and the failing rule's output absent


@pytest.mark.slow
def test_snakemake_exits_non_zero_and_keeps_no_output_for_bad_inputs(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    model = tiny.build_llama(tmp_path / "model", num_layers=4)
    good = tiny.write_jsonl(tmp_path / "good.jsonl", [_chat(i) for i in range(10)])
    system = tiny.write_jsonl(tmp_path / "system.jsonl",
                              [{"messages": [{"role": "system", "content": f"Be nice ({i})."}]} for i in range(6)])
    base = {"device": "cpu", "target": {"source": "path", "path": str(model)},
            "data": {"sources": [str(good)], "max_seq_len": 64}, "vocab": {"draft_vocab_size": 64}}

    def run(name: str, **patch) -> str:
        config = write_config(workdir, {**base, "run": name, **patch}, f"{name}.yaml")
        result = snakemake(workdir, f"results/{name}/data/train.jsonl", configfile=config, check=False)
        assert result.returncode != 0, result.stdout[-2000:]
        assert not (workdir / "results" / name / "data" / "train.jsonl").exists()
        return result.stdout + result.stderr

    # a config error: nothing runs, nothing is written
    out = run("typo", train={"ttt_stepz": 3})
    assert "train.ttt_stepz: unknown key" in out and not (workdir / "results" / "typo").exists()
    # preflight: layer ids out of range for a 4-layer target; target.json is not written
    out = run("layers", target={**base["target"], "aux_layer_ids": [1, 4]})
    assert "aux layer ids [4] are out of range" in out and "fix:" in out
    assert not (workdir / "results" / "layers" / "target.json").exists()
    assert "aux layer ids [4] are out of range" in (workdir / "logs" / "layers" / "inspect_target.log").read_text()
    # a dataset of system turns only: prepare_dataset fails, no train.jsonl
    out = run("system", data={"sources": [str(system)], "max_seq_len": 64})
    assert "no_assistant_turn=6" in out and "where:" in out and "fix:" in out
    # an unwritable results folder: refused before any job
    with _read_only(workdir / "results" / "ro"):
        out = run("ro")
    assert "the workflow writes to results/ro/" in out
