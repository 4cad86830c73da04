"""Settings from one source: ``config/schema.yaml`` holds every config key's type, range and default.

The settings dataclasses of the stages (``DataSettings``, ``RegenerateSettings``,
``ExtractionSettings``, ``TrainSettings``, ``EvalSettings``) declare each field that is a config
key as ``from_schema("section.key")``: its default is read from the schema, and
``check_settings`` checks its value against the same schema, so Python callers (``bench/``,
tests) and the workflow get the same defaults and the same checks. Fields that are not config
keys (Python-only knobs) are checked by their class, through ``bad_setting``: every settings
error is a ``ConfigError`` naming ``section.key``.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from draftsmith.errors import ConfigError

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "config" / "schema.yaml"

# Constants several stages share, defined once.
BACKENDS = ("hf", "vllm")  # engines that run the target: transformers, or vLLM at tensor parallelism
PROGRESS_INTERVAL_S = 30.0  # tqdm redraws at most this often, so a rule's log stays small


@functools.cache
def load_schema(path: Path = SCHEMA_PATH) -> dict:
    """The workflow's JSON Schema (cached: read once per process)."""
    return yaml.safe_load(Path(path).read_text(encoding="utf-8"))


def key_schema(key: str) -> dict:
    """The schema of one dotted config key, e.g. ``train.lr``."""
    node = load_schema()
    for part in key.split("."):
        try:
            node = node["properties"][part]
        except KeyError:
            raise ConfigError(f"{key} is not a key of {SCHEMA_PATH.name}", where=str(SCHEMA_PATH),
                              fix="name a key the schema defines") from None
    return node


def schema_default(key: str) -> Any:
    """The schema's default for ``key`` (a list becomes a tuple: settings are frozen)."""
    value = key_schema(key)["default"]
    return tuple(value) if isinstance(value, list) else value


def from_schema(key: str) -> Any:
    """A dataclass field for config key ``key``: the schema's default, remembered for the checks."""
    return dataclasses.field(default=schema_default(key), metadata={"schema": key})


def allowed(schema: dict) -> str:
    """What a schema allows, in words: ``one of 'hf', 'vllm'`` or ``integer ≥ 1``."""
    if "enum" in schema:
        return "one of " + ", ".join(map(repr, schema["enum"]))
    bounds = []
    for word, op in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<")):
        if word in schema:
            bounds.append(f"{op} {schema[word]}")
    kind = schema.get("type", "")
    kind = " or ".join(kind) if isinstance(kind, list) else kind
    if kind == "array" and "items" in schema:
        kind = f"a list of ({allowed(schema['items'])})"
    return " ".join(filter(None, [kind, " and ".join(bounds)])) or f"see {SCHEMA_PATH.name}"


def bad_setting(key: str, value: Any, want: str) -> ConfigError:
    """The one error for a setting out of its range: names ``section.key``, the value, what is allowed."""
    return ConfigError(f"{key} is {value!r}; it must be {want}", where=f"config key {key}",
                       fix=f"set {key} to {want} (types, ranges and defaults: config/{SCHEMA_PATH.name})")


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def check_settings(settings: Any) -> None:
    """Check each field of a settings dataclass that is a config key against that key's schema."""
    for f in dataclasses.fields(settings):
        key = f.metadata.get("schema")
        if key is None:
            continue
        value = getattr(settings, f.name)
        schema = key_schema(key)
        if not jsonschema.Draft202012Validator(schema).is_valid(_plain(value)):
            raise bad_setting(key, value, allowed(schema))


def settings_from(cls: type, values: dict[str, Any], section: str) -> Any:
    """``cls(**values)``, with a key ``cls`` does not know as a ConfigError naming ``section``."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {section} settings {unknown}", where=f"config key {section}",
                          fix=f"use only {sorted(known)}")
    return cls(**values)
