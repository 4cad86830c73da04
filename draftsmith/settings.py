"""Settings from one source: ``config/schema.yaml`` holds every config key's type, range and default.

The settings dataclasses of the stages (``PreflightSettings``, ``DataSettings``,
``EvalPromptsSettings``, ``RegenerateSettings``, ``ExtractionSettings``, ``TrainSettings``,
``OnlineSettings``, ``EvalSettings``, ``PayoffSettings``) are ``StageSettings`` and declare each field that is a config key as ``from_schema("section.key")``
(a key of another section too: ``device``, ``target.dtype``, ``seed``): its default is read from the
schema, and ``check_settings`` checks its value against the same schema, so Python callers
(``bench/``, tests) and the workflow get the same defaults and the same checks. Every stage's
settings are built one way from the config, ``X.from_config(config)``, each field from its dotted
key. Fields that are not config keys (Python-only knobs) are checked by their class, through
``bad_setting``: every settings error is a ``ConfigError`` naming ``section.key``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

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


def config_value(config: Mapping, key: str) -> Any:
    """The value of the dotted ``key`` in ``config``, or the schema's default where ``config``
    leaves it out (as the workflow's validation fills it in); a list becomes a tuple."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return schema_default(key)
        node = node[part]
    return tuple(node) if isinstance(node, list) else node


def with_untracked(tracked: Mapping, config: Mapping, keys: Sequence[str]) -> dict:
    """A rule's tracked config parameter with the dotted ``keys`` put back from the workflow's
    ``config`` (a key the config leaves out stays out: ``config_value`` gives its default)."""
    merged = copy.deepcopy(dict(tracked))
    for key in keys:
        *parents, last = key.split(".")
        source: Any = config
        into = merged
        for name in parents:
            source = source.get(name, {}) if isinstance(source, Mapping) else {}
            into = into.setdefault(name, {})
        if isinstance(source, Mapping) and last in source:
            into[last] = copy.deepcopy(source[last])
    return merged


def data_format(config: Mapping) -> str:
    """The format the raw data sources' reader and prepare_dataset read in: data.format, or auto
    when regeneration is on (regenerate_responses reads the sources in any known format and writes
    messages rows for prepare_dataset). The one place this rule lives: ``PreflightSettings`` and
    ``DataSettings`` both take their ``format`` from it."""
    return "auto" if config_value(config, "regenerate.enabled") else config_value(config, "data.format")


class StageSettings:
    """What every stage's settings dataclass shares: built from the config one way (``from_config``).

    A subclass names its config section (``SECTION``), the keys of that section it does not take
    and why (``NOT_SETTINGS``), and any key it reads besides its fields' (``ALSO_READS``), so a
    rule can hand it exactly the config it reads (``config_keys``). ``UNTRACKED``: the keys its
    rule's script reads that change how the stage runs, not what it computes (how often to
    checkpoint; a batch size, which at most moves a bf16 state by its rounding, and which the
    stage's own cache key leaves out, so its kept work is reused either way): the rule leaves
    them out of its tracked parameter, and the script puts them back from the workflow's config
    (``with_untracked``), so changing one reruns nothing.
    """

    SECTION: ClassVar[str]
    NOT_SETTINGS: ClassVar[dict[str, str]] = {}
    ALSO_READS: ClassVar[tuple[str, ...]] = ()
    UNTRACKED: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def config_keys(cls) -> list[str]:
        """Every dotted config key ``from_config`` reads."""
        return [f.metadata["schema"] for f in dataclasses.fields(cls) if "schema" in f.metadata] + list(cls.ALSO_READS)

    @classmethod
    def from_config(cls, config: Mapping) -> Self:
        """The settings from a config (the workflow's, or the part of it a rule passes): each field
        that is a config key from that key, a key the config leaves out at its schema default.
        A key of the section the schema does not know is a ConfigError (a typo in a Python caller's dict)."""
        section: Any = config
        for part in cls.SECTION.split("."):
            section = section.get(part, {}) if isinstance(section, Mapping) else {}
        known = key_schema(cls.SECTION)["properties"]
        for name in section:
            if name not in known:
                raise ConfigError(f"unknown {cls.SECTION} setting {name!r}", where=f"config key {cls.SECTION}.{name}",
                                  fix=f"use only {sorted(known)} (config/{SCHEMA_PATH.name})")
        return cls(**{f.name: config_value(config, f.metadata["schema"])
                      for f in dataclasses.fields(cls) if "schema" in f.metadata})

    def section_values(self) -> dict[str, Any]:
        """The fields that are keys of the stage's own section, by name: what a stage records of its
        settings (acceptance.json) and keys its caches by; the keys it reads from elsewhere (device,
        target.dtype, seed) each stage records itself, where and how they matter."""
        prefix = self.SECTION + "."
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("schema", "").startswith(prefix)}
