"""The settings dataclasses and config/schema.yaml agree: same keys, defaults and types; one error type."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import re
import types
import typing
from pathlib import Path

import pytest
import yaml

from draftsmith.data import DataSettings
from draftsmith.errors import ConfigError
from draftsmith.eval_prompts import EvalPromptsSettings
from draftsmith.evaluate import EvalSettings
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.online import OnlineSettings
from draftsmith.payoff import PayoffSettings
from draftsmith.preflight import PreflightSettings
from draftsmith.regenerate.settings import RegenerateSettings
from draftsmith.settings import key_schema
from draftsmith.synthesize import SynthesizeSettings
from draftsmith.train import TrainSettings, launch_from_config

SETTINGS = [PreflightSettings, DataSettings, EvalPromptsSettings, RegenerateSettings, ExtractionSettings,
            TrainSettings, OnlineSettings, EvalSettings, PayoffSettings, SynthesizeSettings]

JSON_TYPES = {int: {"integer"}, float: {"number"}, bool: {"boolean"}, str: {"string"}, type(None): {"null"},
              tuple: {"array"}, list: {"array"}}


def _json_types(annotation) -> set[str]:
    """The JSON Schema types a field's annotation allows (``int | None`` -> integer, null)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return set().union(*(_json_types(a) for a in typing.get_args(annotation)))
    return JSON_TYPES[typing.get_origin(annotation) or annotation]


def _schema_types(schema: dict) -> set[str]:
    if "enum" in schema:
        return {"null" if v is None else {str: "string", int: "integer"}[type(v)] for v in schema["enum"]}
    kind = schema["type"]
    return {kind} if isinstance(kind, str) else set(kind)


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("cls", SETTINGS, ids=lambda c: c.__name__)
def test_every_setting_that_is_a_config_key_has_the_schema_default_and_type(cls):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f.metadata.get("schema")
        if key is None:
            # a Python-only setting must not shadow a config key of its section
            assert f.name not in key_schema(cls.SECTION)["properties"], (
                f"{cls.__name__}.{f.name} is the config key {cls.SECTION}.{f.name}: declare it from_schema")
            continue
        schema = key_schema(key)
        assert _plain(f.default) == schema["default"], f"{cls.__name__}.{f.name}: default differs from {key}"
        assert _json_types(hints[f.name]) == _schema_types(schema), f"{cls.__name__}.{f.name}: type differs from {key}"
        if key.startswith(cls.SECTION + "."):
            assert key == f"{cls.SECTION}.{f.name}", f"{cls.__name__}.{f.name} reads {key}"


@pytest.mark.parametrize("cls", SETTINGS, ids=lambda c: c.__name__)
def test_every_config_key_of_a_section_is_a_setting_or_said_why_not(cls):
    section = set(key_schema(cls.SECTION)["properties"])
    covered = {f.metadata["schema"][len(cls.SECTION) + 1:] for f in dataclasses.fields(cls)
               if f.metadata.get("schema", "").startswith(cls.SECTION + ".")}
    assert section - covered == set(cls.NOT_SETTINGS), f"{cls.SECTION}: keys neither settings nor NOT_SETTINGS"


@pytest.mark.parametrize("make, key", [
    (lambda: DataSettings(heldout_fraction=0.0), "data.heldout_fraction"),
    (lambda: DataSettings(format="csv"), "data.format"),
    (lambda: PreflightSettings(eval_backend="sglang"), "eval.backend"),
    (lambda: PreflightSettings.from_config({"data": {"max_len": 4}}), "data.max_len"),
    (lambda: EvalPromptsSettings(max_bad_fraction=2.0), "data.max_bad_fraction"),
    (lambda: RegenerateSettings(top_p=0), "regenerate.top_p"),
    (lambda: ExtractionSettings(dtype="int4"), "extraction.dtype"),
    (lambda: ExtractionSettings(model_dtype="int8"), "target.dtype"),
    (lambda: ExtractionSettings(max_samples=0), "extraction.max_samples"),
    (lambda: TrainSettings(warmup_steps=-1), "train.warmup_steps"),
    (lambda: TrainSettings(attention="xformers"), "train.attention"),
    (lambda: TrainSettings(seed=-1), "seed"),
    (lambda: EvalSettings(k_sweep=(0, 2)), "eval.k_sweep"),
    (lambda: EvalSettings(backend="sglang"), "eval.backend"),
    (lambda: OnlineSettings(cache_fraction=1.5), "online.cache_fraction"),
    (lambda: TrainSettings.from_config({"train": {"learning_rate": 1e-3}}), "train.learning_rate"),
    (lambda: ExtractionSettings.from_config({"extraction": {"batch_size": 4}}), "extraction.batch_size"),
    (lambda: EvalSettings.from_config({"device": "tpu"}), "device"),
])
def test_a_bad_setting_is_a_config_error_naming_its_key(make, key):
    with pytest.raises(ConfigError) as error:
        make()
    assert f"config key {key}" in str(error.value)


# ---------------------------------------------------------------------------------------------
# One way from the config: X.from_config, fed by the rule's stage_config(...)

ROOT = Path(__file__).resolve().parents[1]
# the settings each rule's workflow script builds with X.from_config(snakemake.params.config)
RULE_SETTINGS = {
    "check_setup": [PreflightSettings],
    "prepare_dataset": [DataSettings],
    "prepare_eval_prompts": [EvalPromptsSettings],
    "regenerate_responses": [RegenerateSettings],
    "synthesize_conversations": [SynthesizeSettings, RegenerateSettings],
    "extract_hidden_states": [ExtractionSettings],
    "train_draft": [TrainSettings],
    "train_draft_online": [TrainSettings, ExtractionSettings, OnlineSettings],
    "evaluate_draft": [EvalSettings],
    "estimate_payoff": [PayoffSettings],
}


def _stage_config_calls() -> dict[str, tuple[list[str], list[str]]]:
    """rule -> the keys and leave_out of its ``config=stage_config(...)`` parameter, read from rules/*.smk."""
    calls = {}
    for smk in (ROOT / "rules").glob("*.smk"):
        for block in re.split(r"^\s*rule ", smk.read_text(), flags=re.M)[1:]:
            found = re.search(r"config=(stage_config\(.*?\))", block, flags=re.S)
            if found:
                call = ast.parse(found.group(1), mode="eval").body
                leave_out = next((ast.literal_eval(k.value) for k in call.keywords if k.arg == "leave_out"), [])
                calls[block.split(":", 1)[0].strip()] = ([ast.literal_eval(a) for a in call.args], leave_out)
    return calls


def _within(key: str, prefixes: list[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def test_each_rule_passes_every_config_key_its_settings_read():
    calls = _stage_config_calls()
    assert set(calls) == set(RULE_SETTINGS)
    for rule, classes in RULE_SETTINGS.items():
        keys, leave_out = calls[rule]
        script = (ROOT / "workflow_scripts" / f"{rule}.py").read_text()
        for cls in classes:
            assert f"{cls.__name__}.from_config(" in script, f"{rule}.py does not build {cls.__name__} from the config"
            for key in cls.config_keys():
                if key in cls.UNTRACKED:  # read from the workflow's config, left out of the tracked parameter
                    assert _within(key, leave_out), f"{rule} tracks {key}, which {cls.__name__} calls untracked"
                    assert f"{cls.__name__}.UNTRACKED" in script, f"{rule}.py does not put back {key}"
                else:
                    assert _within(key, keys) and not _within(key, leave_out), f"{rule} does not pass {key} ({cls.__name__})"


def test_from_config_reads_each_field_from_its_key_and_the_schema_default_where_the_config_is_silent():
    config = {"eval": {"k": 3, "k_sweep": [1, 3], "payoff": {"gpu": "h100"}, "sources": []}, "device": "cpu",
              "target": {"dtype": "float32"}, "extraction": {"tensor_parallel_size": 4}}
    settings = EvalSettings.from_config(config)
    assert settings == EvalSettings(k=3, k_sweep=(1, 3), model_dtype="float32", device="cpu", tensor_parallel_size=4)
    assert DataSettings.from_config({"data": {"format": "conversations"}, "seed": 5}) == DataSettings(format="conversations", seed=5)
    # regenerated conversations are messages rows, whatever the sources were
    assert DataSettings.from_config({"data": {"format": "conversations"}, "regenerate": {"enabled": True}}).format == "auto"
    # preflight reads the sources as the stage after it will: regeneration reads any format
    for enabled, fmt in ((False, "conversations"), (True, "auto")):
        preflight = PreflightSettings.from_config({"data": {"format": "conversations"},
                                                   "regenerate": {"enabled": enabled, "backend": "vllm"}})
        assert preflight.format == fmt
    assert preflight.engines(synthesizing=False) == {"extraction": "hf", "eval": "hf", "regenerate": "vllm"}
    without = PreflightSettings.from_config({"regenerate": {"backend": "vllm"}, "eval": {"backend": "vllm"}})
    assert without.engines(synthesizing=False) == {"extraction": "hf", "eval": "vllm"}
    # the target writing its own conversations runs regeneration's engine, regeneration on or off
    assert without.engines(synthesizing=True) == {"extraction": "hf", "eval": "vllm", "regenerate": "vllm"}
    payoff = PayoffSettings.from_config({"extraction": {"tensor_parallel_size": 4}, "target": {"dtype": "float32"}})
    assert payoff.tensor_parallel_size == 4 and payoff.weight_bytes == 4


def test_acceptance_json_records_the_eval_section_alone():
    """The device, dtype and tensor parallel size EvalSettings carries stay out of acceptance.json's settings."""
    settings = EvalSettings(k=3, k_sweep=(1, 3), device="cpu", model_dtype="float32", tensor_parallel_size=2)
    assert settings.section_values() == {"backend": "hf", "hf_check": False, "separate_engines": False, "enforce_eager": False, "k": 3, "k_sweep": (1, 3), "max_prompts": 64,
                                         "max_new_tokens": 128, "ngram_max": 3, "sweep_max_prompts": 16}


# config/config.yaml's train section at b842bc9: the demo's own has moved on since (epochs, loss)
DEMO_TRAIN_AT_B842BC9 = {"ttt_steps": 3, "epochs": 3, "batch_tokens": 1024, "lr": 1.0e-3, "warmup_steps": 20,
                         "checkpoint_every": 100}


def _demo_config(train: dict) -> dict:
    from snakemake.utils import validate

    config = {**yaml.safe_load((ROOT / "config" / "config.yaml").read_text()), "train": dict(train)}
    validate(config, str(ROOT / "config" / "schema.yaml"))  # the schema's defaults filled in, as the workflow does
    return {**config, "device": "cpu"}


def test_cache_keys_are_those_of_the_settings_before_they_carried_the_device(monkeypatch):
    """The stages' cache keys, their code part pinned, equal the keys computed at b842bc9, where
    device, dtype, seed and tensor parallel size reached the stages as loose arguments: carrying
    them in the settings reuses the regeneration chunks, extraction shards and checkpoints of
    existing runs (their code part changes with the code, as always)."""
    import draftsmith.extract.extract
    import draftsmith.train.checkpoints
    from draftsmith.extract.extract import part_fingerprint
    from draftsmith.regenerate.stage import regeneration_fingerprint
    from draftsmith.train.checkpoints import checkpoint_key

    monkeypatch.setattr("draftsmith.fingerprint.code_fingerprint", lambda *modules: "CODE")
    model = {"files": {"config.json": "abc"}}
    monkeypatch.setattr(draftsmith.extract.extract, "weights_identity", lambda path: model)
    monkeypatch.setattr(draftsmith.train.checkpoints, "sha256_file", lambda path: "FILE")
    monkeypatch.setattr("draftsmith.targets.vllm_install.installed_vllm_version", lambda: "0.33.0")
    before = {  # regeneration_fingerprint(..., seed=7, dtype="float32", device="cpu", tensor_parallel_size=2 or 1);
        # vLLM's keys since they carry its release (targets.vllm_install.engine_release)
        ("hf", 0.0): "638591d74d4e8ba1a083be9ed83344a3043dbcab2ad3da2002b95de831f5fe13",
        ("vllm", 0.0): "8c38bd4e2fe6d72540a65ab198399f6168dd809e7dfe0822fa2f2191547efc33",
        ("hf", 0.7): "654e77fab90c54b1459a29a1677f68820042bdb9e1b75f6456610acea6c4dbd7",
        ("vllm", 0.7): "b3b19798532c8d2ea3898b7771dec54579ce25edf335e589058c30e3f799eedc",
    }
    for (backend, temperature), key in before.items():
        settings = RegenerateSettings.from_config({
            "regenerate": {"backend": backend, "temperature": temperature}, "seed": 7, "target": {"dtype": "float32"},
            "device": "cpu", "extraction": {"tensor_parallel_size": 2}})
        assert regeneration_fingerprint(settings, model=model, sources=[]) == key, (backend, temperature)

    target = {"model_path": "/m", "layers_path": "model.layers", "captured_layer_ids": [1, 2], "hidden_size": 4}
    shards = [[{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}]]
    assert part_fingerprint(target, shards, ExtractionSettings.from_config({"device": "cpu"})) == \
        "8d8a0ab0514ecfaf18e006ac4bf428c54938907962dde29fc6d31fd78dae15d4"

    config = _demo_config(DEMO_TRAIN_AT_B842BC9)
    settings = TrainSettings.from_config(config)
    key = checkpoint_key(settings, Path("i"), Path("m"), target, 2)
    assert key["target"] == "9956d7233b700cf1"
    # train.packing, train.hard_label_weight, train.loss_on and train.feature_noise joined the
    # settings that change the weights; without them, the key is the one before
    joined = ("packing", "hard_label_weight", "loss_on", "feature_noise")
    without = {k: v for k, v in settings.math_dict().items() if k not in joined}
    assert hashlib.sha256(json.dumps({"math": without, "micro_batches_per_step": 2}, sort_keys=True,
                                     default=str).encode()).hexdigest()[:16] == "09e7d61d4de89e9d"
    assert key["settings"] == "ccdf0f3eaff212c0"  # the demo retrains when a setting joins the key
    assert launch_from_config(config) == {"devices": 1, "nodes": 1, "rdzv_port": 29400}
