"""Configuration checks that run before any job: the schema, then rules the schema cannot express."""

from __future__ import annotations

import math
import os
from pathlib import Path

import jsonschema
import yaml

from draftsmith.engines.cpu_bfloat16 import forced_by_environment
from draftsmith.errors import ConfigError
from draftsmith.settings import allowed
from draftsmith.sources import source_problem


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def schema_errors(config: dict, schema: dict) -> list[str]:
    """One line per problem, naming the key and what is allowed there."""
    lines = []
    validator = jsonschema.Draft202012Validator(schema)
    for error in sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path))):
        key = _key(error.absolute_path)
        if error.validator == "additionalProperties":
            known = sorted(error.schema.get("properties", {}))
            unknown = sorted(set(error.instance) - set(known))
            for name in unknown:
                where = f"{key}.{name}" if error.absolute_path else name
                lines.append(f"{where}: unknown key; allowed here: {', '.join(known)}")
        else:
            lines.append(f"{key}: {error.message}; allowed: {allowed(error.schema)}")
    return lines


def non_finite_numbers(config, path=()) -> list[str]:
    """One line per NaN or infinity in the config: JSON Schema's range checks are false for NaN and
    hold for infinity, so YAML's ``.nan`` and ``.inf`` would pass them and fail mid-run instead."""
    if isinstance(config, dict):
        return [line for key, value in config.items() for line in non_finite_numbers(value, (*path, key))]
    if isinstance(config, list):
        return [line for i, value in enumerate(config) for line in non_finite_numbers(value, (*path, i))]
    if isinstance(config, float) and not math.isfinite(config):
        return [f"{_key(path)}: {config} is not a finite number; give a number"]
    return []


def semantic_errors(config: dict) -> list[str]:
    """Checks across keys, once the schema has filled in defaults."""
    lines = []
    target = config["target"]
    if target["source"] == "path" and not target["path"]:
        lines.append("target.path: required when target.source is 'path' (a Hugging Face model folder)")
    if target["source"] == "demo" and target["path"]:
        lines.append("target.path: set, but target.source is 'demo'; set target.source: path to use it")
    if target["path"] and not Path(target["path"]).is_dir():
        lines.append(f"target.path: {target['path']!r} is not a folder")
    elif target["source"] == "path" and target["path"] and not (Path(target["path"]) / "config.json").is_file():
        lines.append(f"target.path: {target['path']!r} has no config.json; point it at a Hugging Face model "
                     "folder (config.json, tokenizer, safetensors weights)")
    extraction = config["extraction"]
    if extraction["backend"] == "hf" and extraction["tensor_parallel_size"] > 1 and not extraction["device_map"]:
        lines.append("extraction.tensor_parallel_size: > 1 with the hf backend needs extraction.device_map: auto "
                     "(layers spread over the GPUs), or use extraction.backend: vllm")
    try:  # read where each CPU stage resolves target.dtype: auto; a typo would stop them one by one
        forced_by_environment()
    except ConfigError as e:
        lines.append(f"{e.what} (the environment): {e.fix}")
    aux = target["aux_layer_ids"]
    if aux is not None and len(set(aux)) != len(aux):
        lines.append(f"target.aux_layer_ids: {aux} repeats a layer; list each layer once")
    listed: dict[str, str] = {}
    for source in config["data"]["sources"]:
        problem = None if source in ("demo", "self") else source_problem(source)
        if problem:
            lines.append(f"data.sources: {source!r} {problem}")
        same = os.path.realpath(source) if source not in ("demo", "self") else source
        if same in listed:  # its rows would all train twice
            lines.append(f"data.sources: {source!r} is the source {listed[same]!r} again; list each source once")
        listed.setdefault(same, source)
    names = [source["name"] for source in config["eval"]["sources"]]
    for i, source in enumerate(config["eval"]["sources"]):
        if source["name"] == "heldout" or names.count(source["name"]) > 1:
            lines.append(f"eval.sources[{i}].name: {source['name']!r} is "
                         + ("the held-out split's name" if source["name"] == "heldout" else "used twice")
                         + "; give each prompt set a name of its own")
        problem = source_problem(source["path"])
        if problem:
            lines.append(f"eval.sources[{i}].path: {source['path']!r} {problem}")
    lines += setting_conflicts(config)
    for folder in ("results", "logs", "benchmarks"):
        problem = unwritable(Path(folder) / config["run"])
        if problem:
            lines.append(f"run: the workflow writes to {folder}/{config['run']}/, but {problem}; make it writable "
                         "(or run the workflow from a folder you can write to)")
    return lines


def normalize_paths(config: dict) -> None:
    """Spell the config's paths one way (``one_spelling``): the rules' parameters hold them, so two
    spellings of one file would rerun every stage that reads it."""
    data, target = config["data"], config["target"]
    data["sources"] = [s if s in ("demo", "self") else one_spelling(s) for s in data["sources"]]
    for source in config["eval"]["sources"]:
        source["path"] = one_spelling(source["path"])
    if target["path"]:
        target["path"] = one_spelling(target["path"])


def one_spelling(path: str) -> str:
    """``path`` relative to the working directory when it lies under it (``./x.jsonl``, ``a/../x`` and
    ``/abs/workdir/x`` all as ``x``: a project folder renamed on its file system keeps its results; a
    copy reruns what reads files inside it, whose status-change times are new), else
    absolute (``../data/x`` and ``/abs/data/x`` alike). Symbolic links are kept as written, and a
    ``..`` after one too: the file it leads to is not the one the spelling without both names."""
    absolute = os.path.abspath(path)
    if os.path.realpath(absolute) != os.path.realpath(path):
        return os.path.join(os.getcwd(), path)  # as written, from the working directory (os.path.join keeps an absolute path)
    relative = os.path.relpath(absolute)
    return absolute if relative == os.pardir or relative.startswith(os.pardir + os.sep) else relative


def setting_conflicts(config: dict) -> list[str]:
    """Combinations of keys that each pass the schema but cannot work together, or would waste the
    run (each line names the keys and the fix)."""
    lines = []
    data, train, extraction = config["data"], config["train"], config["extraction"]
    if train["batch_tokens"] < data["max_seq_len"]:
        # A sample is never split across micro-batches: a longer one would be cut to the batch,
        # training on its first batch_tokens positions only.
        lines.append(f"train.batch_tokens: {train['batch_tokens']} is smaller than data.max_seq_len "
                     f"({data['max_seq_len']}), so longer samples would be cut to the batch and most of their "
                     f"answer never trained; set train.batch_tokens >= {data['max_seq_len']} or lower data.max_seq_len")
    regenerate = config["regenerate"]
    if regenerate["enabled"] and regenerate["max_new_tokens"] >= data["max_seq_len"]:
        lines.append(f"regenerate.max_new_tokens: {regenerate['max_new_tokens']} is not below data.max_seq_len "
                     f"({data['max_seq_len']}): an answer that long could never be trained whole (samples are cut "
                     f"to max_seq_len); lower it or raise data.max_seq_len")
    synthesize = config["synthesize"]
    if "self" in data["sources"] and synthesize["max_prompt_tokens"] >= data["max_seq_len"]:
        lines.append(f"synthesize.max_prompt_tokens: {synthesize['max_prompt_tokens']} is not below data.max_seq_len "
                     f"({data['max_seq_len']}): a request the target writes that long leaves no room for its answer "
                     "(prepare_dataset drops it as too_long_prompt); lower it or raise data.max_seq_len")
    if train["mode"] == "online":
        if extraction["parts"] > 1:
            lines.append(f"extraction.parts: {extraction['parts']} with train.mode: online, which runs one engine "
                         "beside the trainer; set extraction.parts: 1 (or train.mode: offline)")
        if train["nodes"] > 1:
            lines.append(f"train.nodes: {train['nodes']} with train.mode: online, whose engine and trainer share one "
                         "node and its window; set train.nodes: 1 (or train.mode: offline)")
    max_model_len = extraction["max_model_len"]
    if max_model_len is not None and max_model_len < data["max_seq_len"]:
        lines.append(f"extraction.max_model_len: {max_model_len} is smaller than data.max_seq_len ({data['max_seq_len']}), "
                     f"so the engine would refuse the longer samples; set it to at least {data['max_seq_len']} "
                     "(or null: the longest sample)")
    return lines


def unwritable(folder: Path) -> str | None:
    """Why ``folder`` cannot be created or written to, or None; creates nothing (dry runs stay dry)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):  # also false on a read-only file system, even for root
        return f"{existing.resolve()} is not writable"
    return None


def _types(schema: dict) -> set[str]:
    kind = schema.get("type", [])
    return {kind} if isinstance(kind, str) else set(kind)


def coerce_command_line_values(config: dict, schema: dict) -> None:
    """Give nested values from ``snakemake --config key={a: 1}`` their YAML types.

    Snakemake parses nested --config values with YAML's base loader, so ``1`` arrives as the
    string ``"1"``; where the schema does not allow a string, read it as YAML instead.
    """
    properties = schema.get("properties", {})
    for key, value in config.items():
        sub = properties.get(key)
        if sub is None:
            continue
        if isinstance(value, dict):
            coerce_command_line_values(value, sub)
        elif isinstance(value, list) and "items" in sub:
            config[key] = [_coerce(v, sub["items"]) for v in value]
        else:
            config[key] = _coerce(value, sub)


def _coerce(value, schema: dict):
    if not isinstance(value, str) or "string" in _types(schema) or "enum" in schema:
        return value
    for number in (int, float):  # YAML 1.1 reads "1e-4" as a string
        try:
            return number(value)
        except ValueError:
            pass
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def cuda_present() -> bool:
    """Whether this machine has an NVIDIA GPU, decided without importing torch (the workflow plans
    jobs with it; on a cluster's login node set device: cuda instead)."""
    return Path("/dev/nvidiactl").exists()


def uses_gpu(device: str) -> bool:
    """Whether the run's ``device`` setting puts the target's stages on GPUs."""
    return device == "cuda" or (device == "auto" and cuda_present())


def check_config(config: dict, schema_path: str | Path, config_files: list[str] | None = None) -> None:
    """Raise ConfigError listing every problem, or return (command-line strings given their types)."""
    schema = yaml.safe_load(Path(schema_path).read_text(encoding="utf-8"))
    coerce_command_line_values(config, schema)
    problems = schema_errors(config, schema) + non_finite_numbers(config)
    where = ", ".join(map(str, config_files or [])) or None
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems), where=where,
                          fix=f"correct the keys above (types, ranges and defaults: {schema_path})")


def check_semantics(config: dict, config_files: list[str] | None = None) -> None:
    problems = semantic_errors(config)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems),
                          where=", ".join(map(str, config_files or [])) or None, fix="correct the keys above")
