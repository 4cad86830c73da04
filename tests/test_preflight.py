"""Preflight without weights or regenerated data: data sources, chat template, vocab, engine."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

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


PROMPTS = [{"messages": [{"role": "user", "content": f"tell me a story {i}"}]} for i in range(20)]
EMPTY_ANSWERS = [{"messages": [{"role": "user", "content": f"Hello {i}"}, {"role": "assistant", "content": ""}]}
                 for i in range(20)]


@pytest.mark.parametrize(("rows", "reason"), [(PROMPTS, "no_assistant_turn"), (EMPTY_ANSWERS, "empty_turn")],
                         ids=["prompts-alone", "empty-answers"])
def test_answers_the_target_writes_pass_with_regeneration_on_and_are_refused_off_with_their_fix(
        target, tmp_path, rows, reason):
    """With regeneration on, the target answers a conversation that ends with a user turn and writes an
    empty answer: such rows are judged as it reads them. Off, prepare_dataset refuses them, and the fix
    names their reason and regeneration, not the rows' format."""
    source = tiny.write_jsonl(tmp_path / "prompts.jsonl", rows)
    report = check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64, regenerate_enabled=True))
    (checked,) = report["sources"]
    assert checked["rows_read"] == 1 and checked["bad_rows"] == {}
    assert checked["spread"]["rows_sampled"] == 20 and checked["spread"]["unusable"] == {}
    assert checked["sample"]["loss_tokens"] == 1  # the end of the answer's turn: its text is the target's to write
    with pytest.raises(DataError) as error:
        check_setup(target, [source], tmp_path / "off.json", _settings(draft_vocab_size=64))
    e = error.value
    assert f"none of the first 20 rows of {source} is usable: {{'{reason}': 20}}" in e.what
    assert e.fix.startswith(f"{reason}: ") and "regenerate.enabled: true" in e.fix, e.fix
    assert "data.format" not in e.fix, e.fix


def test_prompts_alone_past_max_seq_len_are_refused_with_regeneration_on(target, tmp_path):
    """Rows the target answers are judged as prepare_dataset will judge their answered conversations:
    60% of the prompts longer than data.max_seq_len are refused, as answered rows would be."""
    rows = [{"messages": [{"role": "user", "content": f"{LONG_PROMPT if i % 5 in (1, 2, 3) else 'Hello'} ({i})"}]}
            for i in range(60)]
    source = tiny.write_jsonl(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(DataError) as error:
        check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64, max_seq_len=48,
                                                                     regenerate_enabled=True))
    assert re.search(r"too_long_prompt=\d+ of the 32 rendered", error.value.what), error.value.what
    assert "raise data.max_seq_len from 48" in error.value.fix


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


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_serving_of_a_class_without_eagle3_is_refused_before_training(target, tmp_path):
    """vLLM runs Gemma 3 but its class cannot feed an EAGLE-3 speculator: eval.backend: vllm is refused
    at preflight (not after training); extraction through vLLM stays allowed."""
    source = tiny.write_jsonl(tmp_path / "chats.jsonl", CHATS)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma3ForCausalLM"]}))
    with pytest.raises(TargetError) as error:
        check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64, eval_backend="vllm"))
    assert "does not implement SupportsEagle3" in str(error.value) and error.value.where == "eval.backend"
    assert "eval.backend: hf" in error.value.fix
    check_setup(target, [source], tmp_path / "p.json",
                _settings(draft_vocab_size=64, extraction_backend="vllm", eval_backend="hf"))


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


def test_a_job_ended_early_keeps_its_log_and_console_and_exits_0(tmp_path):
    """The preflight's jobs skip the interpreter's teardown (draftsmith.quick_exit): what they logged
    and printed is all there, the status is 0, and the teardown (an atexit hook here) never runs."""
    script = tmp_path / "job.py"
    script.write_text(
        "import atexit, logging, sys\n"
        "from draftsmith.logs import setup_logging\n"
        "from draftsmith.quick_exit import end_job\n"
        f"setup_logging({str(tmp_path / 'job.log')!r})\n"
        "atexit.register(lambda: print('torn down'))\n"
        "logging.getLogger('draftsmith').info('the last line of the log')\n"
        "print('printed, not yet flushed', end='')\n"
        "end_job()\n"
        "print('never reached')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "printed, not yet flushed"
    assert "the last line of the log" in (tmp_path / "job.log").read_text()
    assert "the last line of the log" in done.stderr


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
    """check_setup checks the vLLM any stage runs; target.json says what vLLM can capture, so
    inspect_target (and every stage after it) follows the vLLM only when extraction uses it."""
    import subprocess

    from workflow_helpers import SNAKEMAKE, path_first

    workdir, config = tiny_workflow(tmp_path)
    # another vLLM release, as importlib.metadata sees it first on the path
    fake = tmp_path / "site" / "vllm-0.99.0.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.99.0\n")
    env = path_first(tmp_path / "site", workdir)
    for sections, reruns in (({"eval": {"backend": "vllm"}}, {"check_setup"}),
                             ({"extraction": {"backend": "vllm"}}, {"inspect_target", "check_setup"}),
                             ({}, set())):  # no stage uses vLLM: its version is no reason to rerun
        configfile = write_config(workdir, {**config, "vocab": {"draft_vocab_size": 64}, **sections})
        snakemake(workdir, "preflight", configfile=configfile)
        plan = subprocess.run([SNAKEMAKE, "-n", "--cores", "1", "preflight", f"--configfile={configfile}"],
                              cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
        assert plan.returncode == 0, plan.stderr[-3000:]
        assert planned_rules(plan) == reruns, (sections, plan.stdout[-3000:])


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


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _agentic(i: int) -> dict:
    """A row whose assistant calls a tool: the plain ChatML template drops the call."""
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": f"Weather in Paris? ({i})"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": f"It is sunny ({i})."}]}


def _write_source(kind: str, path, rows: list[dict]):
    """``rows`` as a data source of ``kind``: jsonl, jsonl.gz, json, parquet (row groups of 10 rows)
    or a save_to_disk folder."""
    import gzip

    if kind == "jsonl":
        return tiny.write_jsonl(path.with_suffix(".jsonl"), rows)
    if kind == "jsonl.gz":
        target = path.with_suffix(".jsonl.gz")
        target.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
        return target
    if kind == "json":
        target = path.with_suffix(".json")
        target.write_text(json.dumps(rows))
        return target
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_struct_array(pa.array(rows))  # the columns of every row, not only of the first
    if kind == "parquet":
        pq.write_table(table, path.with_suffix(".parquet"), row_group_size=10)
        return path.with_suffix(".parquet")
    import datasets

    datasets.Dataset(table).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "json", "parquet", "save_to_disk"])
def test_a_kind_of_row_the_template_cannot_render_is_refused_wherever_it_is(target, tmp_path, kind):
    """100 plain chats, then 30 tool-call rows (23%): the first rows render, prepare_dataset would drop
    every tool-call row as template_error within data.max_bad_fraction; preflight samples the whole
    source and refuses, naming one of the rows."""
    source = _write_source(kind, tmp_path / "agentic", [CHATS[i % 4] for i in range(100)]
                           + [_agentic(i) for i in range(30)])
    with pytest.raises(DataError) as error:
        check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64))
    e = error.value
    assert "cannot render the chats with tool definitions, tool calls, tool results" in e.what, str(e)
    assert "30 of the 130 rows sampled" in e.what and "template_error" in e.what
    line = int(re.search(r"(?::|\[row )(\d+)", e.where.removeprefix(str(source))).group(1))
    assert 100 <= line <= 130 and e.where.startswith(str(source)), e.where  # a tool-call row: 101-130 or 100-129
    assert "tool-use chat template" in e.fix
    assert not (tmp_path / "p.json").exists()


def test_a_million_row_source_is_sampled_to_its_end_without_being_read_whole(target, chatml_tools_tokenizer,
                                                                             tmp_path, monkeypatch):
    """A million rows, the last 2% with tool calls: a template that renders them passes reading about
    a megabyte of the file; one that cannot is refused, naming the line of one of them."""
    chat = b'{"messages": [{"role": "user", "content": "row %d"}, {"role": "assistant", "content": "fine"}]}\n'
    agentic = (json.dumps(_agentic(0)).replace("(0)", "(%d)") + "\n").encode()
    path = tmp_path / "million.jsonl"
    with path.open("wb") as f:
        f.write(b"".join(chat % i for i in range(980_000)))
        f.write(b"".join(agentic % (i, i) for i in range(980_000, 1_000_000)))
    tools = shutil.copytree(chatml_tools_tokenizer, tmp_path / "tools")
    shutil.copy(target / "config.json", tools / "config.json")
    before = _bytes_read()
    report = check_setup(tools, [path], tmp_path / "p.json", _settings(draft_vocab_size=64))
    assert _bytes_read() - before < path.stat().st_size / 20
    assert sum(report["sources"][0]["spread"]["kinds"].values()) >= 250

    with pytest.raises(DataError) as error:
        check_setup(target, [path], tmp_path / "p.json", _settings(draft_vocab_size=64))
    assert "cannot render the chats with tool definitions" in str(error.value)
    line = int(error.value.where.split(":")[-1].split()[0])
    assert 980_001 <= line <= 1_000_000, error.value.where
    assert b"tool_calls" in path.read_bytes().split(b"\n")[line - 1]  # the line named is a row that failed
    # further into a file than lines are counted, the row is named by the byte it starts at
    monkeypatch.setattr("draftsmith.source_sample.LINE_COUNT_BYTES", 1 << 20)
    with pytest.raises(DataError) as error:
        check_setup(target, [path], tmp_path / "p.json", _settings(draft_vocab_size=64))
    offset = int(error.value.where.split(" at byte ")[1].split()[0].replace(",", ""))
    with path.open("rb") as f:
        f.seek(offset - 1)
        assert f.read(1) == b"\n" and b"tool_calls" in f.readline()


def _bytes_read() -> int:
    """Bytes this process has read from files so far (Linux: /proc/self/io)."""
    return int(re.search(r"^rchar: (\d+)", Path("/proc/self/io").read_text(), flags=re.M).group(1))


def test_the_sample_and_its_kinds_are_reported(chatml_tools_tokenizer, tmp_path, monkeypatch):
    folder = shutil.copytree(chatml_tools_tokenizer, tmp_path / "tools")
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 384}))
    source = tiny.write_jsonl(tmp_path / "mixed.jsonl", [CHATS[i % 4] for i in range(100)]
                              + [_agentic(i) for i in range(30)] + [{"broken": True}])
    report = check_setup(folder, [source], tmp_path / "p.json", _settings(draft_vocab_size=64))
    spread = report["sources"][0]["spread"]
    assert spread["rows_sampled"] == 131 and spread["whole_source"] and spread["bad_rows"] == {"unknown_format": 1}
    assert spread["kinds"] == {"plain chats": 100, "chats with tool definitions, tool calls, tool results, "
                                                   "several answers": 30}
    assert spread["rendered"] == 32 and spread["no_loss_within_max_seq_len"] == 0
    monkeypatch.setattr("draftsmith.preflight.RENDER_SECONDS", 0)  # a slow template: one row of each kind
    report = check_setup(folder, [source], tmp_path / "p.json", _settings(draft_vocab_size=64))
    assert report["sources"][0]["spread"]["rendered"] == 2


@pytest.mark.slow
def test_a_refused_preflight_says_what_where_and_fix_and_keeps_the_traceback_in_the_log(tmp_path, monkeypatch):
    """Each preflight job refused through snakemake: the console shows the error's what, where and fix
    and no traceback; the job's log keeps the traceback (a chained one for a folder that is not a
    save_to_disk folder); inspect_target leaves what it learned beside the target.json it did not
    write, and check_setup, which reads target.json, waits for a target that passes."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    workdir, config = tiny_workflow(tmp_path)
    # the tiny target's config grown to 34B parameters (preflight reads no weights): 137 GB in float32,
    # more than this machine's memory for extraction on the hf backend
    model_config = tmp_path / "model" / "config.json"
    fitting = model_config.read_text()
    model_config.write_text(json.dumps({**json.loads(fitting), "hidden_size": 8192, "intermediate_size": 32768,
                                        "num_hidden_layers": 40, "head_dim": 1024}))
    (tmp_path / "not_a_dataset").mkdir()
    config["data"]["sources"] = [str(tmp_path / "not_a_dataset")]
    config.update(vocab={"draft_vocab_size": 64}, extraction={"backend": "hf"}, train={"batch_tokens": 256})
    configfile = write_config(workdir, config)
    run = snakemake(workdir, "--keep-going", "preflight", configfile=configfile, check=False)
    console = run.stdout + run.stderr
    assert run.returncode != 0
    refused = "results/t/target.refused.json"
    for says in ("TargetError: the target's weights take", f"(layers, quantization, weight bytes) is in {refused}",
                 "where:", "fix:"):
        assert says in console, console[-6000:]
    assert "Traceback" not in console, console[-6000:]
    assert "Traceback" in (workdir / "logs/t/inspect_target.log").read_text()
    assert not (workdir / "results/t/target.json").exists() and not (workdir / "logs/t/check_setup.log").exists()
    assert json.loads((workdir / refused).read_text())["num_hidden_layers"] == 40

    model_config.write_text(fitting)  # the target fits: check_setup runs and refuses the data source
    run = snakemake(workdir, "preflight", configfile=configfile, check=False)
    console = run.stdout + run.stderr
    assert run.returncode != 0
    for says in ("DataError: ", "is a folder but not one written by datasets' save_to_disk", "where:", "fix:"):
        assert says in console, console[-6000:]
    assert "Traceback" not in console, console[-6000:]
    check_setup_log = (workdir / "logs/t/check_setup.log").read_text()
    assert "Traceback" in check_setup_log and "The above exception was the direct cause" in check_setup_log


def test_check_setup_given_target_json_imports_no_torch_and_loads_autotokenizers_class(llama_dir, tmp_path):
    """The workflow's check_setup reads inspect_target's description: the tokenizer class AutoTokenizer
    picked is loaded alone, and neither torch nor transformers' model code is imported (seconds of a
    check that takes one); a class this transformers lacks goes back through AutoTokenizer."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from draftsmith.chat import load_tokenizer
    from draftsmith.targets.inspect import write_target_json

    description = write_target_json(tmp_path / "target.json", llama_dir)
    chosen = AutoTokenizer.from_pretrained(llama_dir)
    assert description["tokenizer_class"] == f"{type(chosen).__module__}.{type(chosen).__name__}"
    for recorded in (description["tokenizer_class"], "transformers.NoSuchTokenizer"):
        loaded = load_tokenizer(llama_dir, recorded)
        assert type(loaded) is type(chosen) and loaded("Hello there")["input_ids"] == chosen("Hello there")["input_ids"]

    source = tiny.write_jsonl(tmp_path / "chats.jsonl", CHATS)
    code = f"""
import sys
from draftsmith.preflight import PreflightSettings, check_setup
from draftsmith.targets.inspect import read_target_json
settings = PreflightSettings(device="cpu", draft_vocab_size=64, extraction_backend="hf", eval_backend="hf", max_seq_len=512)
check_setup({str(llama_dir)!r}, [{str(source)!r}], {str(tmp_path / "preflight.json")!r}, settings,
            target=read_target_json({str(tmp_path / "target.json")!r}))
print(sorted(m for m in ("torch", "transformers.modeling_utils", "transformers.models.auto.auto_factory")
             if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr
    assert json.loads((tmp_path / "preflight.json").read_text())["train_memory"]


# ---------------------------------------------------------------------------------------------
# The sample judged as prepare_dataset judges the file: rows too long for data.max_seq_len, and
# every kind of row the chat template refuses, counted in one accounting wherever row 1 falls

LONG_PROMPT = " ".join(["Hello there, how are you doing today? What is the weather like?"] * 8)


def _chat(i: int, long: bool = False) -> dict:
    """A chat whose prompt fits data.max_seq_len=48 of the ChatML tokenizer, or (``long``) runs past it."""
    return {"messages": [{"role": "user", "content": f"{LONG_PROMPT if long else 'Hello'} ({i})"},
                         {"role": "assistant", "content": f"Fine, thanks {i}."}]}


def _long_rows(first_long: bool) -> list[dict]:
    """60 chats, 24 of them (40%) with a prompt longer than 48 tokens; row 1 one of those or not."""
    long = [i % 5 in (0, 2) for i in range(60)] if first_long else [i % 5 in (1, 3) for i in range(60)]
    return [_chat(i, is_long) for i, is_long in enumerate(long)]


@pytest.mark.parametrize("first_long", [False, True], ids=["row-1-short", "row-1-long"])
def test_too_many_prompts_past_max_seq_len_are_refused_wherever_row_1_falls(target, tmp_path, first_long):
    """prepare_dataset would drop 40% of the rows as too_long_prompt, more than data.max_bad_fraction=0.2:
    preflight refuses with the same verdict, counts and fix whether row 1 is one of them or not."""
    source = tiny.write_jsonl(tmp_path / "chats.jsonl", _long_rows(first_long))
    with pytest.raises(DataError) as error:
        check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64, max_seq_len=48))
    e = error.value
    found = re.search(r"about (\d+) of the 60 rows sampled across .*chats\.jsonl \((\d+\.\d)%\) are unusable, "
                      r"more than data\.max_bad_fraction=0\.2", e.what)
    assert found, e.what
    assert 18 <= int(found.group(1)) <= 30 and 30 <= float(found.group(2)) <= 50, e.what
    rendered = re.search(r"too_long_prompt=(\d+) of the (\d+) rendered", e.what)
    assert rendered and int(rendered.group(2)) == 32 and 10 <= int(rendered.group(1)) <= 16, e.what
    assert "an estimate from 60 sampled rows" in e.what
    line = int(re.search(r"chats\.jsonl:(\d+) \(too_long_prompt", e.where).group(1))
    assert LONG_PROMPT in (tmp_path / "chats.jsonl").read_text().splitlines()[line - 1]
    assert re.search(r"raise data\.max_seq_len from 48 to at least \d+", e.fix), e.fix
    assert "raise data.max_bad_fraction" in e.fix and "shorten" in e.fix
    assert not (tmp_path / "p.json").exists()
    # the limit is the config's: allowed more bad rows, preflight passes and says how many it saw
    report = check_setup(target, [source], tmp_path / "p.json",
                         _settings(draft_vocab_size=64, max_seq_len=48, max_bad_fraction=0.6))
    spread = report["sources"][0]["spread"]
    assert spread["no_loss_within_max_seq_len"] == int(rendered.group(1)) and spread["rendered"] == 32


def test_a_few_prompts_past_max_seq_len_are_counted_in_a_warning(target, tmp_path, caplog):
    """6 of 60 rows (10%) too long, row 1 among them: within data.max_bad_fraction, so preflight passes,
    and its log says how many of the rows it rendered prepare_dataset will drop."""
    rows = [_chat(i, long=i % 10 == 0) for i in range(60)]
    source = tiny.write_jsonl(tmp_path / "chats.jsonl", rows)
    with caplog.at_level("WARNING", logger="draftsmith.preflight"):
        report = check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64, max_seq_len=48))
    spread = report["sources"][0]["spread"]
    assert 1 <= spread["no_loss_within_max_seq_len"] <= 6 and spread["unusable"]["too_long_prompt"] >= 1
    assert re.search(r"too_long_prompt=\d+ of the 32 rendered", caplog.text), caplog.text
    assert "within data.max_bad_fraction=0.2" in caplog.text and f"{source}:1 (too_long_prompt" in caplog.text
    assert report["sources"][0]["sample"]["tokens"] > 48  # row 1 is described, not refused



def test_a_share_over_the_limit_within_the_samples_noise_is_a_warning(target, tmp_path, caplog):
    """1,000 chats, a quarter of them (drawn at random) too long: 8 of the 32 rendered of the 257 sampled,
    25% against data.max_bad_fraction=0.2, which 32 rows cannot tell from 20%: preflight warns that
    prepare_dataset may stop, with the counts and the fix, and does not refuse."""
    import random

    draw = random.Random(3)
    source = _write_source("json", tmp_path / "chats", [_chat(i, long=draw.random() < 0.25) for i in range(1000)])
    with caplog.at_level("WARNING", logger="draftsmith.preflight"):
        report = check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64, max_seq_len=48))
    assert report["sources"][0]["spread"]["unusable_share"] == 0.25
    assert "too_long_prompt=8 of the 32 rendered (an estimate from 257 sampled rows" in caplog.text, caplog.text
    assert "more than data.max_bad_fraction=0.2" in caplog.text and "prepare_dataset may stop" in caplog.text
    assert "raise data.max_seq_len from 48 to at least" in caplog.text


# A template that refuses the system role, as Gemma's does
NO_SYSTEM_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _system_rows(first_system: bool) -> list[dict]:
    """60 chats, 12 (20%) with a system turn: 8 with one answer, 4 with two (another kind of row)."""
    def row(i: int) -> dict:
        turns = [{"role": "user", "content": f"Hello {i}"}, {"role": "assistant", "content": f"Fine {i}."}]
        if i % 5 == 0:
            turns = [{"role": "system", "content": "Be brief."}, *turns]
            if i % 3 == 0:
                turns += [{"role": "user", "content": "And?"}, {"role": "assistant", "content": "Done."}]
        return {"messages": turns}
    return [row(i if first_system else i + 1) for i in range(60)]


@pytest.mark.parametrize("first_system", [False, True], ids=["row-1-plain", "row-1-system"])
def test_every_kind_of_row_the_template_refuses_is_counted(target, tmp_path, first_system):
    """A template that refuses system turns: both kinds of row that have one are named, each with its count
    and an example, and all 12 of the 60 rows (20%) are counted, whether row 1 is one of them or not."""
    no_system = shutil.copytree(target, tmp_path / "no_system")
    tiny.build_tokenizer(no_system, NO_SYSTEM_TEMPLATE)
    source = tiny.write_jsonl(tmp_path / "chats.jsonl", _system_rows(first_system))
    with pytest.raises(DataError) as error:
        check_setup(no_system, [source], tmp_path / "p.json", _settings(draft_vocab_size=64))
    e = error.value
    assert "System role not supported" in e.what
    assert "the chats with a system turn: 8 of the 8 rendered fail" in e.what, e.what
    assert "the chats with a system turn, several answers: 4 of the 4 rendered fail" in e.what, e.what
    assert "8 of the 60 rows sampled (13%)" in e.what and "4 of the 60 rows sampled (7%)" in e.what
    assert "rows of these kinds are 12 of the 60 rows sampled across the file (20%)" in e.what, e.what
    assert "template_error" in e.what
    examples = dict(re.findall(r"chats\.jsonl:(\d+) \(the chats with a system turn(, several answers)?\)", e.where))
    text = (tmp_path / "chats.jsonl").read_text().splitlines()
    assert len(examples) == 2 and all('"system"' in text[int(n) - 1] for n in examples), e.where
    assert all(('"And?"' in text[int(n) - 1]) == bool(several) for n, several in examples.items()), e.where
    assert first_system == ("1" in examples)
    assert "render these rows, or remove them from the source" in e.fix


GREETING = [{"from": "gpt", "value": "Hi! How can I help?"}]
# Refuses turns that do not alternate user/assistant from a user turn, as strict templates do.
ALTERNATING_TEMPLATE = (
    "{% for message in messages | rejectattr('role', 'equalto', 'system') %}"
    "{% if (message['role'] == 'user') != loop.index0 is even %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% endfor %}" + tiny.CHATML_TEMPLATE
)


def _sharegpt(i: int, greeting: bool = False) -> dict:
    turns = [{"from": "human", "value": f"Hello {i}"}, {"from": "gpt", "value": f"Fine {i}."},
             {"from": "human", "value": "And?"}, {"from": "gpt", "value": "Done."}]
    return {"conversations": [*GREETING, *turns] if greeting else turns}


def test_a_source_with_a_row_the_bot_opens_passes(target, tmp_path):
    """30 chats and one the bot opens with a greeting (as ShareGPT dumps do): the greeting is context,
    the answers after it train, so the source passes; a row with nothing but the greeting before a
    user turn is a bad row that says so."""
    source = tiny.write_jsonl(tmp_path / "sharegpt.jsonl", [*map(_sharegpt, range(30)), _sharegpt(30, greeting=True)])
    report = check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64))
    spread = report["sources"][0]["spread"]
    assert spread["kinds"]["chats with several answers, an assistant turn first"] == 1
    assert spread["unusable"] == {} and spread["rendered"] == 31

    greeting_only = {"conversations": [*GREETING, {"from": "human", "value": "Bye"}]}
    source = tiny.write_jsonl(tmp_path / "more.jsonl", [*map(_sharegpt, range(30)), greeting_only])
    report = check_setup(target, [source], tmp_path / "p.json", _settings(draft_vocab_size=64))
    assert report["sources"][0]["spread"]["bad_rows"] == {"no_assistant_turn": 1}
    with pytest.raises(DataError) as error:  # alone, the row's own reason is the refusal
        check_setup(target, [tiny.write_jsonl(tmp_path / "only.jsonl", [greeting_only])], tmp_path / "p.json",
                    _settings(draft_vocab_size=64))
    assert "no assistant turn follows a user or tool turn" in error.value.where, error.value.where
    assert "cannot render" not in str(error.value)


def test_a_template_that_refuses_a_row_the_bot_opens_is_named_for_it(target, tmp_path):
    strict = shutil.copytree(target, tmp_path / "strict")
    tiny.build_tokenizer(strict, ALTERNATING_TEMPLATE)
    source = tiny.write_jsonl(tmp_path / "sharegpt.jsonl", [*map(_sharegpt, range(30)), _sharegpt(30, greeting=True)])
    with pytest.raises(DataError) as error:
        check_setup(strict, [source], tmp_path / "p.json", _settings(draft_vocab_size=64))
    e = error.value
    assert "the chats with several answers, an assistant turn first in" in e.what, e.what
    assert "1 of the 1 rendered fail (the chat template refuses a conversation that opens with an assistant turn" in e.what
    assert "Conversation roles must alternate" in e.what and e.where.startswith(f"{source}:31")
    assert "drop the assistant turns before the first user turn" in e.fix
