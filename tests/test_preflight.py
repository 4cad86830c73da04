"""Preflight without weights or regenerated data: data sources, chat template, vocab, engine."""

from __future__ import annotations

import json
import shutil

import pytest

import tiny
from draftsmith.errors import ConfigError, DataError, TargetError
from draftsmith.gate import PreflightGateError, mark_planned, record_verdict, wait_for_preflight
from draftsmith.preflight import PreflightSettings, check_setup
from workflow_helpers import planned_rules, snakemake, tiny_workflow, write_config

CHATS = [{"messages": [{"role": "user", "content": f"Hello {i}"},
                       {"role": "assistant", "content": f"Fine, thanks {i}."}]} for i in range(4)]


@pytest.fixture
def target(chatml_tokenizer, tmp_path):
    """A target folder with a config and a tokenizer, and no weights at all."""
    folder = shutil.copytree(chatml_tokenizer, tmp_path / "target")
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 384}))
    return folder


def _settings(**fields) -> PreflightSettings:
    """check_setup's settings at the schema's defaults, with ``fields``; the fit checks need a
    target's shape, which these targets (a config and a tokenizer) leave out."""
    return PreflightSettings(check_fits=False, **fields)


def test_a_good_setup_passes_and_says_what_it_checked(target, tmp_path):
    source = tiny.write_jsonl(tmp_path / "chats.jsonl", [{"broken": True}, *CHATS])
    report = check_setup(target, [source], tmp_path / "preflight.json", _settings(draft_vocab_size=64, extraction_backend="hf"))
    (checked,) = report["sources"]
    assert checked["rows_read"] == 2 and checked["bad_rows"] == {"unknown_format": 1}
    assert 0 < checked["sample"]["loss_tokens"] < checked["sample"]["tokens"]
    assert json.loads((tmp_path / "preflight.json").read_text()) == report


def test_a_source_without_usable_rows_is_named(target, tmp_path):
    source = tiny.write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}] * 3)
    with pytest.raises(DataError) as error:
        check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64))
    assert "bad.jsonl" in str(error.value) and "unknown_format" in str(error.value)
    with pytest.raises(DataError, match="does not exist"):
        check_setup(target, [tmp_path / "missing.jsonl"], tmp_path / "p.json", _settings(draft_vocab_size=64))


def test_a_draft_vocab_larger_than_the_target_is_refused(target, tmp_path):
    source = tiny.write_jsonl(tmp_path / "chats.jsonl", CHATS)
    with pytest.raises(ConfigError, match="vocab.draft_vocab_size 32000 is larger"):
        check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=32000))


def test_an_untested_vllm_is_refused_for_the_stages_that_use_it(target, tmp_path, monkeypatch):
    source = tiny.write_jsonl(tmp_path / "chats.jsonl", CHATS)
    monkeypatch.setattr("draftsmith.targets.vllm_support.installed_vllm_version", lambda: "0.10.1")
    with pytest.raises(TargetError) as error:
        check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64, extraction_backend="vllm", eval_backend="hf"))
    assert "outside the supported releases" in str(error.value) and "extraction.backend" in str(error.value)
    check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64, extraction_backend="hf"))


@pytest.mark.slow
def test_preflight_with_regeneration_on_needs_no_weights_and_no_regenerated_data(tmp_path):
    workdir, config = tiny_workflow(tmp_path)
    config.update(regenerate={"enabled": True, "max_new_tokens": 8}, vocab={"draft_vocab_size": 64})
    configfile = write_config(workdir, config)
    plan = snakemake(workdir, "-n", "preflight", configfile=configfile)
    assert planned_rules(plan) == {"inspect_target", "check_setup"}
    (tmp_path / "model" / "model.safetensors").unlink()  # preflight never reads the weights
    snakemake(workdir, "preflight", configfile=configfile)
    assert (workdir / "results/t/preflight.json").exists()
    assert not (workdir / "results/t/data/regenerated.jsonl").exists()


def test_the_gate_holds_a_load_until_check_setup_passes_and_stops_it_when_check_setup_fails(tmp_path):
    gate = tmp_path / "results" / "t" / "preflight.gate.json"
    wait_for_preflight(gate)  # no check_setup in this run's plan: no gate, no wait
    mark_planned(gate, True)
    waits = []

    def check_setup_passes_while_we_wait(seconds):
        waits.append(seconds)
        if len(waits) == 3:
            record_verdict(gate, None)

    wait_for_preflight(gate, poll_seconds=0.5, sleep=check_setup_passes_while_we_wait)
    assert waits == [0.5, 0.5, 0.5] and not gate.exists()

    mark_planned(gate, True)
    record_verdict(gate, DataError("no usable rows", where="bad.jsonl:1"))
    with pytest.raises(PreflightGateError) as error:
        wait_for_preflight(gate, sleep=lambda s: pytest.fail("a failed verdict must not wait"))
    assert "DataError: no usable rows" in str(error.value) and "bad.jsonl:1" in str(error.value)

    mark_planned(gate, False)  # the next plan has check_setup current: the old verdict goes
    assert not gate.exists()
    mark_planned(gate, True)
    now = iter(range(0, 10_000, 100))
    with pytest.raises(PreflightGateError, match="no verdict in 3600 s"):
        wait_for_preflight(gate, sleep=lambda s: None, clock=lambda: next(now))


@pytest.mark.slow
def test_no_job_that_loads_the_target_starts_a_load_after_the_preflight_failed(tmp_path):
    """A preflight that fails beside a job that loads the target (regeneration here; extraction,
    evaluation and online training wait at the same gate), with --keep-going so Snakemake itself
    stops nothing: the job waits for the verdict and ends without loading the target."""
    workdir, config = tiny_workflow(tmp_path)
    config.update(regenerate={"enabled": True, "max_new_tokens": 8}, vocab={"draft_vocab_size": 64})
    bad = tiny.write_jsonl(tmp_path / "bad.jsonl", [{"unknown": i} for i in range(40)])
    configfile = write_config(workdir, {**config, "data": {**config["data"], "sources": [str(bad)]}})
    run = snakemake(workdir, "--keep-going", configfile=configfile, check=False)
    assert run.returncode != 0
    assert "Error in rule check_setup" in run.stdout + run.stderr
    regeneration = (workdir / "logs/t/regenerate_responses.log").read_text()
    assert "check_setup failed, so this job did not load the target" in regeneration
    assert "no usable rows" in regeneration or "unknown_format" in regeneration  # the preflight's own words
    assert "target load" not in regeneration
    assert not (workdir / "results/t/data/regenerated.jsonl").exists()

    good = write_config(workdir, config, name="good.yaml")  # fixed: the gate opens, the run goes through
    snakemake(workdir, "preflight", "results/t/data/regenerated.jsonl", configfile=good)
    assert not (workdir / "results/t/preflight.gate.json").exists()
    assert "target load 1" in (workdir / "logs/t/regenerate_responses.log").read_text()


@pytest.mark.slow
def test_another_vllm_reruns_preflight_when_a_stage_uses_it(tmp_path):
    import os
    import subprocess

    from workflow_helpers import SNAKEMAKE

    workdir, config = tiny_workflow(tmp_path)
    config.update(vocab={"draft_vocab_size": 64}, eval={"backend": "vllm"})
    configfile = write_config(workdir, config)
    snakemake(workdir, "preflight", configfile=configfile)
    # another vLLM release, as importlib.metadata sees it first on the path
    fake = tmp_path / "site" / "vllm-0.99.0.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.99.0\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{workdir}"}
    plan = subprocess.run([SNAKEMAKE, "-n", "--cores", "1", "preflight", f"--configfile={configfile}"], cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert planned_rules(plan) == {"inspect_target", "check_setup"}
    config["eval"] = {"backend": "hf"}  # no stage uses vLLM: its version is no reason to rerun
    configfile = write_config(workdir, config)
    snakemake(workdir, "preflight", configfile=configfile)
    plan = subprocess.run([SNAKEMAKE, "-n", "--cores", "1", "preflight", f"--configfile={configfile}"], cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=300)
    assert planned_rules(plan) == set(), plan.stdout[-3000:]


def test_compressed_and_agentic_sources_are_checked_at_preflight(chatml_tools_tokenizer, chatml_tokenizer, tmp_path):
    import gzip

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    agentic = {"tools": tools, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
    source = tmp_path / "agentic.jsonl.gz"
    source.write_bytes(gzip.compress((json.dumps(agentic) + "\n").encode()))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 384}
    for name, tokenizer in (("tools", chatml_tools_tokenizer), ("plain", chatml_tokenizer)):
        folder = shutil.copytree(tokenizer, tmp_path / name)
        (folder / "config.json").write_text(json.dumps(config))
        if name == "tools":
            report = check_setup(folder, [source], tmp_path / "p.json", _settings(draft_vocab_size=64))
            assert report["sources"][0]["sample"]["loss_tokens"] > 0
        else:  # a template that drops tool calls is caught before any job that costs
            with pytest.raises(DataError, match="does not render the assistant's tool calls"):
                check_setup(folder, [source], tmp_path / "p.json", _settings(draft_vocab_size=64))


def test_a_damaged_target_config_is_named_not_a_traceback(target, tmp_path):
    (target / "config.json").write_text('{"model_type": "llama",')
    source = tiny.write_jsonl(tmp_path / "chats.jsonl", CHATS)
    with pytest.raises(TargetError, match="config.json is not valid JSON") as error:
        check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64))
    assert error.value.fix
