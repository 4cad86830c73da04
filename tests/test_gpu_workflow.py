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

Each stage's seconds (Snakemake's benchmark files) and each job's target loads (its log) are printed,
for docs/gpu-tests.md. On the CPU each of these vLLM paths has its own tests (test_regenerate,
test_vllm_backend, test_vllm_serving, test_evaluate); the whole chain is the GPU lane's.
"""

from __future__ import annotations

import csv
import json
import re

import pytest

from tiny import build_llama
from tiny_vllm import ON_CUDA, build_deepseek_v3_for_platform, vllm_test
from workflow_helpers import snakemake, tiny_workflow, write_config

TARGET_STAGES = ("regenerate_responses", "extract_hidden_states/part-0", "evaluate_draft")
PROMPTS, NEW_TOKENS = 4, 16


def _stage_seconds(workdir) -> dict[str, float]:
    seconds, root = {}, workdir / "benchmarks" / "t"
    for path in sorted(root.rglob("*.tsv")):
        with open(path) as f:
            seconds[str(path.relative_to(root).with_suffix(""))] = float(next(csv.DictReader(f, delimiter="\t"))["s"])
    return seconds


def _target_loads(workdir) -> dict[str, list[str]]:
    """Each job's target loads, as engines.loads logs them ("target load N of this job: ... in S s")."""
    root = workdir / "logs" / "t"
    return {str(path.relative_to(root).with_suffix("")): re.findall(r"target load \d+ of this job: (.*)", path.read_text())
            for path in sorted(root.rglob("*.log"))}


# target builder, its dtype, and whether the HF loop checks vLLM token for token
CASES = {
    "llama": (build_llama, "float32", True),
    # the trial target: DeepSeek's head sizes (on CUDA), 16 routed experts, 6 layers
    "deepseek_v3": (lambda path: build_deepseek_v3_for_platform(path, n_routed_experts=16, num_hidden_layers=6),
                    "bfloat16", False),
}


@vllm_test
@pytest.mark.skipif(not ON_CUDA, reason="the workflow end to end in vLLM is the GPU lane's")
@pytest.mark.parametrize("case", list(CASES))
def test_the_workflow_runs_every_target_stage_in_vllm(tmp_path, case):
    build, dtype, hf_check = CASES[case]
    workdir, config = tiny_workflow(tmp_path)
    model = build(tmp_path / "vllm-target")
    config.update(
        device="cuda", target={"source": "path", "path": str(model), "dtype": dtype},
        regenerate={"enabled": True, "backend": "vllm", "max_new_tokens": NEW_TOKENS, "enforce_eager": True},
        extraction={"backend": "vllm"}, vocab={"draft_vocab_size": 64}, train={"epochs": 2, "batch_tokens": 256},
        eval={"backend": "vllm", "hf_check": hf_check, "enforce_eager": True, "max_prompts": PROMPTS,
              "max_new_tokens": NEW_TOKENS, "k_sweep": [1, 3], "sweep_max_prompts": 2})
    configfile = write_config(workdir, config)
    snakemake(workdir, "--resources", "gpu=1", configfile=configfile, timeout=540)

    acceptance = json.loads((workdir / "results/t/eval/acceptance.json").read_text())
    regenerated = (workdir / "results/t/data/regenerated.jsonl").read_text().splitlines()
    assert len(regenerated) == 40
    loads = _target_loads(workdir)
    assert [len(loads[stage]) for stage in TARGET_STAGES[:2]] == [1, 1]
    assert not loads["check_setup"] and not loads["inspect_target"] and not loads["train_draft"]
    assert all("eager" in what for stage in TARGET_STAGES for what in loads[stage] if "vLLM" in what)
    lossless = acceptance["lossless"]
    if hf_check:
        served = acceptance["vllm"]
        assert served["speculative_config"]["method"] == "eagle3"
        assert served["num_prompts"] > 0 and served["tau"] == pytest.approx(served["hf_loop"]["tau"])
        assert lossless["checked_generations"] > 0 and lossless["numerical_ties"] == []
        assert len(loads["evaluate_draft"]) == 2  # vLLM with the draft, the HF loop's check
    else:
        assert acceptance["reference"] == "vllm_argmax" and acceptance["num_prompts"] == PROMPTS
        assert acceptance["vllm"]["speculative_config"]["method"] == "eagle3"
        assert acceptance["tau"] >= 1 and acceptance["baseline"]["tau"] >= 1
        assert acceptance["tau_by_k"]["k"] == [3] and len(acceptance["acceptance_rate_by_position"]) == 3
        # every served token checked against the target's argmax, every prompt; near-ties are listed
        assert lossless["checked_generations"] == PROMPTS and lossless["checked_tokens"] == acceptance["num_tokens"]
        # one load: vLLM with the draft; no HF load
        assert len(loads["evaluate_draft"]) == 1 and "vLLM" in loads["evaluate_draft"][0]
    print(json.dumps({"case": case, "stage_seconds": _stage_seconds(workdir), "target_loads": loads,
                      "tau": acceptance["tau"], "lossless": lossless}, indent=1))
