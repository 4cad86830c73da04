"""Config validation: every kind of mistake stops the run before any job, naming the key."""

import copy
import os
from pathlib import Path

import pytest
import yaml

from draftsmith.config import check_config, check_semantics, schema_errors
from draftsmith.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "config" / "schema.yaml"


@pytest.fixture(scope="module")
def schema():
    return yaml.safe_load(SCHEMA.read_text())


@pytest.fixture
def demo_config():
    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())


def test_shipped_configs_are_valid(schema, demo_config):
    assert schema_errors(demo_config, schema) == []
    for example in (ROOT / "config" / "examples").glob("*.yaml"):
        assert schema_errors(yaml.safe_load(example.read_text()), schema) == [], example


@pytest.mark.parametrize(
    "patch, expected",
    [
        ({"target": {"sorce": "demo"}}, "target.sorce: unknown key; allowed here: aux_layer_ids, dtype"),
        ({"trainn": {}}, "trainn: unknown key; allowed here:"),
        ({"train": {"ttt_decay": 2}}, "train.ttt_decay: 2 is greater than the maximum of 1; allowed: number > 0 and ≤ 1"),
        ({"train": {"ttt_steps": "three"}}, "train.ttt_steps: 'three' is not of type 'integer'"),
        ({"extraction": {"dtype": "int4"}}, "extraction.dtype: 'int4' is not one of"),
        ({"data": {"heldout_fraction": 0}}, "data.heldout_fraction: 0 is less than or equal to the minimum of 0"),
        ({"data": {"heldout_fraction": 1}}, "data.heldout_fraction: 1 is greater than or equal to the maximum of 1"),
        ({"vocab": {"draft_vocab_size": 1}}, "vocab.draft_vocab_size: 1 is less than the minimum of 32"),
        ({"run": "../escape"}, "run: '../escape' does not match"),
        ({"target": {"aux_layer_ids": [-1]}}, "target.aux_layer_ids.0: -1 is less than the minimum of 0"),
        # YAML's .nan passes every range check and .inf a minimum: both would fail mid-run
        ({"train": {"epochs": float("nan")}}, "train.epochs: nan is not a finite number; give a number"),
        ({"data": {"heldout_fraction": float("nan")}}, "data.heldout_fraction: nan is not a finite number"),
        ({"train": {"max_grad_norm": float("inf")}}, "train.max_grad_norm: inf is not a finite number"),
    ],
)
def test_schema_errors_name_the_key_and_what_is_allowed(demo_config, patch, expected):
    config = copy.deepcopy(demo_config)
    for section, value in patch.items():
        if isinstance(value, dict) and isinstance(config.get(section), dict):
            config[section].update(value)
        else:
            config[section] = value
    with pytest.raises(ConfigError) as info:
        check_config(config, SCHEMA, ["my.yaml"])
    message = str(info.value)
    assert expected in message
    assert "my.yaml" in message


def test_all_problems_are_reported_at_once(demo_config):
    demo_config["train"]["lr"] = -1
    demo_config["eval"]["k"] = 99
    with pytest.raises(ConfigError) as info:
        check_config(demo_config, SCHEMA)
    assert "train.lr" in str(info.value) and "eval.k" in str(info.value)


def _defaults(schema):
    """The config Snakemake's validate would fill in from the schema for an empty config."""
    from snakemake.utils import validate

    config = {}
    validate(config, str(SCHEMA))
    return config


def test_semantic_checks(schema, tmp_path):
    config = _defaults(schema)
    config["target"]["source"] = "path"
    with pytest.raises(ConfigError, match="target.path: required"):
        check_semantics(config)
    config["target"]["path"] = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="is not a folder"):
        check_semantics(config)
    config["target"]["path"] = str(tmp_path)
    config["target"]["aux_layer_ids"] = [2, 2]
    with pytest.raises(ConfigError, match="repeats a layer"):
        check_semantics(config)
    config["target"]["aux_layer_ids"] = None
    config["data"]["sources"] = [str(tmp_path / "nope.jsonl")]
    with pytest.raises(ConfigError, match="does not exist"):
        check_semantics(config)
    (tmp_path / "chats.jsonl").write_text('{"messages": []}\n')
    config["data"]["sources"] = [str(tmp_path / "chats.jsonl"), f"{tmp_path}/./chats.jsonl"]
    with pytest.raises(ConfigError, match=r"'.*/\./chats.jsonl' is the source '.*/chats.jsonl' again; list each"):
        check_semantics(config)


def test_nested_command_line_values_get_their_types(demo_config):
    # `snakemake --config 'train={ttt_steps: 2}'` hands the nested 2 over as the string "2".
    demo_config["train"] = {"ttt_steps": "2", "lr": "1e-4", "max_steps": "null"}
    demo_config["target"]["aux_layer_ids"] = ["1", "3"]
    check_config(demo_config, SCHEMA)
    assert demo_config["train"] == {"ttt_steps": 2, "lr": 1e-4, "max_steps": None}
    assert demo_config["target"]["aux_layer_ids"] == [1, 3]
    demo_config["run"] = "123"  # a string field stays a string
    check_config(demo_config, SCHEMA)
    assert demo_config["run"] == "123"


def test_settings_that_cannot_work_together_are_refused(schema, tmp_path):
    config = _defaults(schema)
    config["data"]["max_seq_len"] = 2048
    config["train"]["batch_tokens"] = 1024
    config["extraction"]["max_model_len"] = 512
    with pytest.raises(ConfigError) as info:
        check_semantics(config)
    message = str(info.value)
    assert "train.batch_tokens: 1024 is smaller than data.max_seq_len (2048)" in message
    assert "set train.batch_tokens >= 2048" in message
    assert "extraction.max_model_len: 512 is smaller than data.max_seq_len" in message
    config["train"]["batch_tokens"] = 2048
    config["extraction"]["max_model_len"] = None
    check_semantics(config)
    config["regenerate"].update(enabled=True, max_new_tokens=4096)
    with pytest.raises(ConfigError, match="regenerate.max_new_tokens: 4096 is not below data.max_seq_len"):
        check_semantics(config)


def test_data_sources_are_checked_by_type_and_content(schema, tmp_path):
    import gzip

    config = _defaults(schema)
    good = tmp_path / "d.jsonl.gz"
    good.write_bytes(gzip.compress(b'{"text": "x"}\n'))
    fake = tmp_path / "e.jsonl.gz"
    fake.write_text('{"text": "x"}\n')
    csv = tmp_path / "f.csv"
    csv.write_text("a,b\n")
    config["data"]["sources"] = [str(good)]
    check_semantics(config)
    config["data"]["sources"] = [str(good), str(fake), str(csv)]
    with pytest.raises(ConfigError) as info:
        check_semantics(config)
    assert "e.jsonl.gz' is named .jsonl.gz but is not gzip-compressed" in str(info.value)
    assert "f.csv' unsupported file type '.csv'" in str(info.value)


ODD_VALUES = ["x", "", -1, 0, 1, 2.5, 10**12, None, True, [], [1, 1], {}, {"a": 1}]


def _leaves(schema: dict, path: tuple = ()):
    for key, sub in schema.get("properties", {}).items():
        if sub.get("type") == "object":
            yield from _leaves(sub, (*path, key))
        else:
            yield (*path, key)


def test_fuzz_every_key_with_odd_values_gives_a_config_error_or_passes(schema, tmp_path, monkeypatch):
    """Any value at any key: the config check passes it or raises a ConfigError, never another exception."""
    from snakemake.utils import validate

    from draftsmith.data import DataSettings
    from draftsmith.errors import DraftsmithError

    monkeypatch.chdir(tmp_path)
    base = _defaults(schema)
    base["data"]["sources"] = []
    checked = 0
    for key in _leaves(schema):
        for value in ODD_VALUES:
            config = copy.deepcopy(base)
            parent = config
            for part in key[:-1]:
                parent = parent[part]
            parent[key[-1]] = value
            try:
                check_config(config, SCHEMA, ["fuzz.yaml"])
                validate(config, str(SCHEMA))
                check_semantics(config, ["fuzz.yaml"])
                DataSettings(**{k: v for k, v in config["data"].items() if k != "sources"}, seed=config["seed"])
            except DraftsmithError:
                pass
            checked += 1
    assert checked > 500


def test_online_mode_runs_one_engine_on_one_node(schema):
    config = _defaults(schema)
    config["train"].update(mode="online", nodes=2)
    config["extraction"]["parts"] = 2
    with pytest.raises(ConfigError) as info:
        check_semantics(config)
    message = str(info.value)
    assert "extraction.parts: 2 with train.mode: online" in message and "set extraction.parts: 1" in message
    assert "train.nodes: 2 with train.mode: online" in message
    config["train"]["nodes"], config["extraction"]["parts"] = 1, 1
    check_semantics(config)


SIZE_KEYS = ("device", "data.max_seq_len", "vocab.draft_vocab_size", "draft.num_layers", "train.batch_tokens",
             "train.ttt_steps", "eval.max_new_tokens", "regenerate.enabled", "regenerate.max_new_tokens",
             "extraction.batch_tokens", "regenerate.batch_size")
BAD_SIZES = (0, -1, 1, 2, 3000, 10**6, 10**12, 2**63, 1.5, float("nan"), "cuda", "x", None, True, [], {})


def test_fuzz_bad_sizes_end_in_a_draftsmith_error_through_the_config_check_and_preflight(schema, tmp_path,
                                                                                         monkeypatch):
    """Random bad values for the numeric and enum keys draftsmith.fits reads: the config check, then
    (where it passes) preflight's fit checks against a 512-position target on a 1 TB CPU, refuse with
    a DraftsmithError or pass, never another exception."""
    import random

    from snakemake.utils import validate

    from draftsmith.errors import DraftsmithError
    from draftsmith.fits import check_context, check_train_fits
    from draftsmith.preflight import PreflightSettings

    monkeypatch.chdir(tmp_path)
    base = _defaults(schema)
    base["data"]["sources"] = []
    text = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "vocab_size": 384, "max_position_embeddings": 4096}  # the defaults' samples fit
    rng = random.Random(28)
    outcomes = {"refused": 0, "passed": 0}
    for _ in range(300):
        config = copy.deepcopy(base)
        for key in rng.sample(SIZE_KEYS, rng.randint(1, 3)):
            section, _, name = key.partition(".")
            if name:
                config[section][name] = rng.choice(BAD_SIZES)
            else:
                config[section] = rng.choice(BAD_SIZES)
        try:
            check_config(config, SCHEMA, ["fuzz.yaml"])
            validate(config, str(SCHEMA))
            check_semantics(config, ["fuzz.yaml"])
            settings = PreflightSettings.from_config(config)
            check_context(text, settings)
            check_train_fits(text, settings, ("sdpa", 10**12))
        except DraftsmithError:
            outcomes["refused"] += 1
            continue
        outcomes["passed"] += 1
    assert outcomes["refused"] > 100 and outcomes["passed"] > 0, outcomes


def test_a_path_is_spelt_one_way_relative_under_the_working_directory_and_absolute_outside_it(tmp_path,
                                                                                             monkeypatch):
    from draftsmith.config import one_spelling

    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    monkeypatch.chdir(project)
    for spelling in ("data/x.jsonl", "./data/x.jsonl", "data/../data/x.jsonl", str(project / "data" / "x.jsonl")):
        assert one_spelling(spelling) == "data/x.jsonl", spelling
    outside = str(tmp_path / "model")
    for spelling in ("../model", "../model/", "../project/../model", outside):
        assert one_spelling(spelling) == outside, spelling
    assert one_spelling(str(project)) == "."
    # a ".." after a symbolic link leads where the link's target's parent is: never collapsed away
    elsewhere = tmp_path / "elsewhere" / "sub"
    elsewhere.mkdir(parents=True)
    (tmp_path / "elsewhere" / "x.jsonl").write_text("{}\n")
    (project / "data" / "x.jsonl").write_text("{}\n")  # the file a collapsed spelling would name instead
    (project / "link").symlink_to(elsewhere)
    spelt = one_spelling("link/../x.jsonl")
    assert os.path.realpath(spelt) == str((tmp_path / "elsewhere" / "x.jsonl").resolve()), spelt
    assert one_spelling("link/x.jsonl") == "link/x.jsonl"
