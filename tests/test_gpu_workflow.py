"""The whole workflow through Snakemake with every stage that runs the target in vLLM (regeneration,
extraction, evaluation), on a GPU, for two targets:

- a random-init Llama in float32, evaluated with the HF loop's lossless check beside vLLM
  (``eval.hf_check``): vLLM and the HF loop must agree exactly, as in test_vllm_serving;
- a random-init DeepSeek-V3 (MLA with DeepSeek's head sizes, routed experts behind the ``noaux_tc``
  router) in bfloat16, evaluated in vLLM alone, as a DeepSeek-V3 or Kimi-K2.5 deployment is (the HF
  loop cannot hold such a target): one engine, every served token checked against the target's own
  argmax from that engine's logits, the n-gram baseline replayed on the same text. A random-init
  MoE's router sits near ties, which bfloat16 tips either way, so the HF loop is no exact reference
  for it.

The target's engines stay warm between jobs (``warm_target``): regeneration (eager) loads the engine
capture and evaluation then attach to (``draftsmith.engines.shared``), with the trained draft loaded
into its speculator slot, so the run loads the target once; a rerun of ``evaluate_draft`` afterwards
loads nothing. Each
stage's seconds (Snakemake's benchmark files), each job's target loads and where each warm engine's
start went (its log) are printed, for docs/gpu-tests.md. On the CPU each of these vLLM paths has its own tests (test_regenerate,
test_vllm_backend, test_vllm_serving, test_evaluate); the whole chain is the GPU lane's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiny_vllm import ON_CUDA, vllm_test
from workflow_helpers import (
    VLLM_CASES,
    VLLM_PROMPTS,
    engine_starts,
    snakemake,
    stage_seconds,
    target_loads,
    vllm_workflow,
)

TARGET_STAGES = ("regenerate_responses", "extract_hidden_states/part-0", "evaluate_draft")


@pytest.fixture
def engines(tmp_path, monkeypatch):
    """The test's own registry of warm engines (its jobs inherit it), every engine stopped after."""
    from draftsmith.engines import registry

    monkeypatch.setenv("DRAFTSMITH_ENGINE_DIR", str(tmp_path / "engines"))
    yield
    for engine in registry.list_engines():
        registry.stop_engine(Path(engine["folder"]))


@vllm_test
@pytest.mark.skipif(not ON_CUDA, reason="the workflow end to end in vLLM is the GPU lane's")
@pytest.mark.parametrize("case", list(VLLM_CASES))
def test_the_workflow_runs_every_target_stage_in_vllm(tmp_path, case, engines):
    workdir, configfile, config = vllm_workflow(tmp_path, case)
    hf_check = config["eval"]["hf_check"]
    snakemake(workdir, "--resources", "gpu=1", configfile=configfile, timeout=540)

    acceptance = json.loads((workdir / "results/t/eval/acceptance.json").read_text())
    regenerated = (workdir / "results/t/data/regenerated.jsonl").read_text().splitlines()
    assert len(regenerated) == 40
    loads = {job: [what for what, _ in found] for job, found in target_loads(workdir).items()}
    assert [len(loads[stage]) for stage in TARGET_STAGES[:2]] == [1, 0]  # capture attached to regeneration's engine
    assert "attached to the warm target engine" in (workdir / "logs/t/extract_hidden_states/part-0.log").read_text()
    assert not loads["check_setup"] and not loads["inspect_target"] and not loads["train_draft"]
    assert all("eager" in what for stage in TARGET_STAGES for what in loads[stage] if "vLLM" in what)
    lossless = acceptance["lossless"]
    if hf_check:
        served = acceptance["vllm"]
        assert served["speculative_config"]["method"] == "eagle3"
        assert served["num_prompts"] > 0 and served["tau"] == pytest.approx(served["hf_loop"]["tau"])
        assert lossless["checked_generations"] > 0 and lossless["numerical_ties"] == []
        # the HF loop's load alone: vLLM's engine is the capture engine, the draft loaded into its slot
        assert len(loads["evaluate_draft"]) == 1 and loads["evaluate_draft"][0].startswith("transformers")
    else:
        assert acceptance["reference"] == "vllm_argmax" and acceptance["num_prompts"] == VLLM_PROMPTS
        assert acceptance["vllm"]["speculative_config"]["method"] == "eagle3"
        assert acceptance["tau"] >= 1 and acceptance["baseline"]["tau"] >= 1
        assert acceptance["tau_by_k"]["k"] == [3] and len(acceptance["acceptance_rate_by_position"]) == 3
        # every served token checked against the target's argmax, every prompt; near-ties are listed
        assert lossless["checked_generations"] == VLLM_PROMPTS and lossless["checked_tokens"] == acceptance["num_tokens"]
        assert loads["evaluate_draft"] == []  # no load: the capture engine, the draft loaded into its slot
    evaluation = (workdir / "logs/t/evaluate_draft.log").read_text()
    assert "attached to the warm target engine" in evaluation and "into the speculator slot" in evaluation
    first = {"stage_seconds": stage_seconds(workdir), "target_loads": target_loads(workdir),
             "engine_starts": engine_starts(workdir)}
    # the evaluation again (after a patch, say): the warm engine, the draft loaded again, no load of the target
    snakemake(workdir, "--resources", "gpu=1", "--forcerun", "evaluate_draft", "--until", "evaluate_draft",
              configfile=configfile, timeout=300)
    again = target_loads(workdir)["evaluate_draft"]
    assert [what for what, _ in again if "vLLM" in what] == []
    assert json.loads((workdir / "results/t/eval/acceptance.json").read_text())["tau"] == acceptance["tau"]
    print(json.dumps({"case": case, **first, "rerun_evaluate_draft": {"seconds": stage_seconds(workdir)["evaluate_draft"],
                                                                      "target_loads": again},
                      "tau": acceptance["tau"], "lossless": lossless}, indent=1))
