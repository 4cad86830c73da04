"""The settings dataclasses and config/schema.yaml agree: same keys, defaults and types; one error type."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest

from draftsmith.data import DataSettings
from draftsmith.errors import ConfigError
from draftsmith.evaluate import EvalSettings
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.online import OnlineSettings
from draftsmith.payoff import PayoffSettings
from draftsmith.regenerate import RegenerateSettings
from draftsmith.settings import key_schema
from draftsmith.train import TrainSettings, settings_from_dict

SETTINGS = [DataSettings, RegenerateSettings, ExtractionSettings, TrainSettings, OnlineSettings, EvalSettings,
            PayoffSettings]

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
    (lambda: settings_from_dict({"learning_rate": 1e-3}), "train"),
    (lambda: ExtractionSettings.from_config({"batch_size": 4}), "extraction"),
])
def test_a_bad_setting_is_a_config_error_naming_its_key(make, key):
    with pytest.raises(ConfigError) as error:
        make()
    assert f"config key {key}" in str(error.value)
