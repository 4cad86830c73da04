"""The whole workflow through Snakemake with every stage that runs the target in vLLM (regeneration,
extraction, evaluation with the HF loop's lossless check), on a GPU: a random-init Llama in float32,
so vLLM and the HF loop must agree exactly (as in test_vllm_serving).

Each stage's seconds (Snakemake's benchmark files) and each job's target loads (its log) are printed,
for docs/gpu-tests.md. On the CPU each of these vLLM paths has its own tests (test_regenerate,
test_vllm_backend, test_vllm_serving); the whole chain is the GPU lane's.
"""

from __future__ import annotations

import csv
import json
import re

import pytest

from tiny import build_llama
from tiny_vllm import ON_CUDA, vllm_test
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


@vllm_test
@pytest.mark.skipif(not ON_CUDA, reason="the workflow end to end in vLLM is the GPU lane's")
def test_the_workflow_runs_every_target_stage_in_vllm(tmp_path):
    workdir, config = tiny_workflow(tmp_path)
    model = build_llama(tmp_path / "vllm-target")
    config.update(
        device="cuda", target={"source": "path", "path": str(model), "dtype": "float32"},
        regenerate={"enabled": True, "backend": "vllm", "max_new_tokens": NEW_TOKENS, "enforce_eager": True},
        extraction={"backend": "vllm"}, vocab={"draft_vocab_size": 64}, train={"epochs": 2, "batch_tokens": 256},
        eval={"backend": "vllm", "hf_check": True, "enforce_eager": True, "max_prompts": PROMPTS,
              "max_new_tokens": NEW_TOKENS, "k_sweep": [1, 3], "sweep_max_prompts": 2})
    configfile = write_config(workdir, config)
    snakemake(workdir, "--resources", "gpu=1", configfile=configfile, timeout=540)

    acceptance = json.loads((workdir / "results/t/eval/acceptance.json").read_text())
    served = acceptance["vllm"]
    assert served["speculative_config"]["method"] == "eagle3"
    assert served["prompts_identical_to_vllm_greedy"] == served["num_prompts"] > 0  # vLLM with the draft = greedy
    assert served["tau"] == pytest.approx(served["hf_loop"]["tau"])
    assert acceptance["lossless"]["checked_generations"] > 0 and acceptance["lossless"]["numerical_ties"] == []
    regenerated = (workdir / "results/t/data/regenerated.jsonl").read_text().splitlines()
    assert len(regenerated) == 40

    loads = _target_loads(workdir)
    assert [len(loads[stage]) for stage in TARGET_STAGES[:2]] == [1, 1]
    assert len(loads["evaluate_draft"]) == 3  # vLLM greedy, vLLM with the draft, the HF loop's check
    assert not loads["check_setup"] and not loads["inspect_target"] and not loads["train_draft"]
    assert all("eager" in what for stage in TARGET_STAGES for what in loads[stage] if "vLLM" in what)
    print(json.dumps({"stage_seconds": _stage_seconds(workdir), "target_loads": loads}, indent=1))
