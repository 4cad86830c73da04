"""The production example: Kimi-K2.5 (DeepSeek-V3 text model in a multimodal wrapper), planned and
preflighted on a CPU machine from its config alone. How long that takes is measured by
bench/preflight.py (docs/benchmarks.md), not asserted here: a busy machine must not fail a test."""

import json
import subprocess
import sys

import pytest
import yaml

import tiny
from workflow_helpers import ROOT, copy_workflow, planned_jobs, planned_rules, snakemake, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    return tiny.build_kimi_k25_config(tmp_path_factory.mktemp("kimi"))


def test_preflight_resolves_the_wrapper_without_weights(kimi_dir, tmp_path):
    out = tmp_path / "target.json"
    code = ("from draftsmith.targets.inspect import write_target_json; "
            f"write_target_json({str(out)!r}, {str(kimi_dir)!r}, aux_layer_ids=[2, 30, 58], trust_remote_code=True)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)  # timed in bench/preflight.py
    info = json.loads(out.read_text())
    assert info["architecture"] == "KimiK25ForConditionalGeneration" and info["wrapped"] is True
    assert info["text_model_type"] == "deepseek_v3"
    assert info["layers_path"].endswith("language_model.layers")
    assert (info["num_hidden_layers"], info["hidden_size"], info["vocab_size"]) == (61, 7168, 163840)
    assert info["captured_layer_ids"] == [2, 30, 58, 61]
    assert info["num_parameters"] > 1.0e12
    assert info["backends"]["vllm"]["supported"] is True


def test_snakemake_plans_the_example(kimi_dir, tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    config = yaml.safe_load((ROOT / "config" / "examples" / "kimi-k2.5.yaml").read_text())
    data = tiny.write_jsonl(tmp_path / "chats.jsonl", [{"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}])
    config["target"]["path"] = str(kimi_dir)
    config["data"]["sources"] = [str(data)]
    plan = snakemake(workdir, "-n", "--cores", "8", "--resources", "gpu=8", configfile=write_config(workdir, config))
    assert planned_rules(plan) == {
        "inspect_target", "check_setup", "regenerate_responses", "prepare_dataset", "extract_hidden_states",
        "merge_hidden_states", "build_vocab_mapping", "train_draft", "evaluate_draft",
        "plot_training", "plot_evaluation", "estimate_payoff"}
    text = plan.stdout
    assert text.count("rule extract_hidden_states:") == 4  # extraction.parts
    jobs = planned_jobs(plan)
    for rule in ("regenerate_responses", "extract_hidden_states", "evaluate_draft", "train_draft"):
        assert jobs[rule]["resources"]["gpu"] == 8, (rule, jobs[rule])  # each books its 8 GPUs
        assert 1 <= jobs[rule]["threads"] <= 7, (rule, jobs[rule])  # cores left for the CPU stages
    assert jobs["build_vocab_mapping"]["threads"] == 1
    resolved = yaml.safe_load((ROOT / "config" / "examples" / "kimi-k2.5.yaml").read_text())
    assert resolved["regenerate"]["backend"] == resolved["extraction"]["backend"] == resolved["eval"]["backend"] \
        == "vllm"  # every stage that runs the target runs it in vLLM


def test_snakemake_plans_the_gpu_demo(tmp_path):
    """config/examples/demo-gpu.yaml: the embedded demo with every target stage in vLLM on one GPU,
    planned from its config alone (the GPU lane runs it)."""
    workdir = copy_workflow(tmp_path / "wf")
    config = yaml.safe_load((ROOT / "config" / "examples" / "demo-gpu.yaml").read_text())
    assert config["regenerate"]["backend"] == config["extraction"]["backend"] == config["eval"]["backend"] == "vllm"
    plan = snakemake(workdir, "-n", "--cores", "4", "--resources", "gpu=1", configfile=write_config(workdir, config))
    assert planned_rules(plan) == {
        "demo_target", "demo_dataset", "inspect_target", "check_setup", "synthesize_conversations",
        "regenerate_responses", "prepare_dataset",
        "extract_hidden_states", "merge_hidden_states", "build_vocab_mapping", "train_draft", "evaluate_draft",
        "plot_training", "plot_evaluation", "estimate_payoff"}
    jobs = planned_jobs(plan)
    assert all(jobs[rule]["resources"]["gpu"] == 1 for rule in ("synthesize_conversations", "regenerate_responses",
                                                                "extract_hidden_states", "evaluate_draft", "train_draft"))
