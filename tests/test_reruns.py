"""The caching promise, module by module: after a patch to any draftsmith module, `snakemake -n`
plans exactly the rules docs/reruns.md names for it (those whose script imports the module, and
what depends on them), and running them recomputes: a patched trainer trains a different draft
from step 0, a patched capture rewrites the shards, and nothing upstream of the patch runs."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from draftsmith.fingerprint import package_modules
from draftsmith.io import read_json
from workflow_helpers import ROOT, planned_rules, snakemake, tiny_workflow, write_config

RESULTS = "results/t"
# Rules only the embedded demo has (its model and conversations come from packages).
DEMO_ONLY = {"demo_target", "demo_dataset"}


def _rerun_table_script():
    spec = importlib.util.spec_from_file_location("rerun_table", ROOT / "scripts" / "rerun_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _committed_table() -> dict[str, set[str]]:
    rows = re.findall(r"^\| `([\w.]+)` \| (.*) \|$", (ROOT / "docs" / "reruns.md").read_text(), flags=re.M)
    return {module: set(re.findall(r"`(\w+)`", rules)) for module, rules in rows}


def test_each_rule_fingerprints_the_script_it_runs():
    """A rule's code parameter names its own script: rule X runs workflow_scripts/X.py and takes
    script_code("X"), so no rule can fingerprint code other than what it runs."""
    for smk in sorted((ROOT / "rules").glob("*.smk")):
        for rule, body in re.findall(r"^[ \t]*rule (\w+):\n((?:[ \t]+.*\n|\n)*)", smk.read_text(), flags=re.M):
            script = re.search(r'script:\s*\n\s*"\.\./workflow_scripts/(\w+)\.py"', body)
            if script is None:
                continue
            assert script.group(1) == rule, f"{smk.name}: rule {rule} runs {script.group(1)}.py"
            assert f'code=script_code("{rule}")' in body, f"{smk.name}: rule {rule} lacks its code fingerprint"


@pytest.mark.slow
def test_the_committed_rerun_table_is_current():
    script = _rerun_table_script()
    assert (ROOT / "docs" / "reruns.md").read_text() == script.render(script.rerun_rows()), \
        "docs/reruns.md is stale: run .venv/bin/python scripts/rerun_table.py"


def test_the_table_lists_every_module():
    assert set(_committed_table()) == set(package_modules())


# ---------------------------------------------------------------------------------------------
# The tiny workflow, regeneration on, run once; then one patch at a time


PATCH = "\n_RERUN_PATCH = 1\n"  # code: a comment changes no fingerprint


def _patch(workdir: Path, module: str, text: str = PATCH) -> Path:
    file = workdir / Path(*module.split(".")).with_suffix(".py")
    if not file.exists():
        file = workdir / Path(*module.split(".")) / "__init__.py"
    file.write_text(file.read_text() + text)
    return file


def test_a_run_without_the_workflow_profile_is_refused_before_any_job(tmp_path):
    """Without profiles/default Snakemake's code trigger is on, and a comment edit would rerun a
    stage: such a run stops before its first job, saying what took the profile's place."""
    workdir, config = tiny_workflow(tmp_path)
    config.update(vocab={"draft_vocab_size": 64})
    configfile = write_config(workdir, config)
    done = snakemake(workdir, "preflight", "--workflow-profile", "none", configfile=configfile, check=False)
    assert done.returncode != 0
    assert "Snakemake's rerun triggers include 'code'" in done.stderr, done.stderr[-3000:]
    assert not (workdir / "results/t/target.json").exists()
    # a profile of the user's own in ./default, which Snakemake reads before profiles/default
    (workdir / "default").mkdir()
    (workdir / "default" / "config.yaml").write_text("printshellcmds: true\n")
    done = snakemake(workdir, "preflight", configfile=configfile, check=False)
    assert done.returncode != 0
    assert "Snakemake read ./default as the workflow profile" in done.stderr, done.stderr[-3000:]
    assert not (workdir / "results/t/target.json").exists()
    (workdir / "default" / "config.yaml").unlink()
    (workdir / "default").rmdir()
    snakemake(workdir, "preflight", configfile=configfile)  # with the profile: runs
    assert (workdir / "results/t/target.json").exists()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The whole tiny workflow, regeneration on, run to the end once."""
    workdir, config = tiny_workflow(tmp_path_factory.mktemp("reruns"))
    config.update(
        regenerate={"enabled": True, "max_new_tokens": 6, "batch_size": 16},
        vocab={"draft_vocab_size": 64},
        extraction={"shard_tokens": 256, "batch_tokens": 256},
        train={"max_steps": 6, "epochs": 1, "batch_tokens": 128, "checkpoint_every": 3, "warmup_steps": 1},
        eval={"max_prompts": 2, "max_new_tokens": 6, "k_sweep": [1, 2], "sweep_max_prompts": 1},
    )
    configfile = write_config(workdir, config)
    snakemake(workdir, configfile=configfile)
    assert planned_rules(snakemake(workdir, "-n", configfile=configfile)) == set()
    return workdir, configfile


@pytest.mark.slow
def test_a_patch_to_each_module_reruns_exactly_the_rules_in_the_table(finished):
    workdir, configfile = finished
    # The table of this workflow (a target of its own: no demo rules), from its rule graph ...
    table = {module: set(rules) for module, rules in _rerun_table_script().rerun_rows(workdir, configfile).items()}
    # ... is the committed one wherever the demo's own rules play no part
    committed = _committed_table()
    present = planned_rules(snakemake(workdir, "-n", "--forceall", configfile=configfile))
    for module, rules in committed.items():
        if not rules & DEMO_ONLY:
            assert table[module] == rules & present, module
    wrong = {}
    for module in package_modules():
        file = _patch(workdir, module)
        original = file.read_text()[: -len(PATCH)]
        try:
            planned = planned_rules(snakemake(workdir, "-n", configfile=configfile))
        finally:
            file.write_text(original)
        if planned != table[module]:
            wrong[module] = {"planned": sorted(planned), "expected": sorted(table[module])}
    assert not wrong, wrong
    assert planned_rules(snakemake(workdir, "-n", configfile=configfile)) == set()
    file = _patch(workdir, "draftsmith.vocab", "\n# a comment edit reruns nothing\n")
    try:
        assert planned_rules(snakemake(workdir, "-n", configfile=configfile)) == set()
    finally:
        file.write_text(file.read_text()[: -len("\n# a comment edit reruns nothing\n")])


def _reversed_keys(value):
    if isinstance(value, dict):
        return {key: _reversed_keys(value[key]) for key in reversed(list(value))}
    return value


@pytest.mark.slow
def test_the_same_config_with_its_keys_in_another_order_and_its_paths_spelt_otherwise_reruns_nothing(finished):
    workdir, configfile = finished
    config = yaml.safe_load(configfile.read_text())
    source = Path(config["data"]["sources"][0])
    config["data"]["sources"] = [f"{source.parent}/./../{source.parent.name}/{source.name}"]  # the same file
    config["target"]["path"] = os.path.relpath(config["target"]["path"], workdir) + "/"  # ../model/
    reordered = workdir / "reordered.yaml"
    reordered.write_text(yaml.safe_dump(_reversed_keys(config), sort_keys=False))
    assert reordered.read_text() != configfile.read_text()
    assert planned_rules(snakemake(workdir, "-n", configfile=reordered)) == set()


def test_keys_that_change_no_output_and_a_comment_in_a_workflow_script_rerun_nothing(finished):
    """How often training checkpoints, its rendezvous port and extraction's batch size, context and
    device map change nothing a stage writes (the shards' key leaves the last three out): rerunning
    extraction would reuse every shard and then train the draft again from step 0. A workflow script
    newer than its rule's outputs with a comment added, or rewritten as it was (git checkout), reruns
    nothing either; a change to its code reruns its rule."""
    workdir, configfile = finished
    config = yaml.safe_load(configfile.read_text())
    config["train"] |= {"checkpoint_every": 2, "rdzv_port": 29511}
    config["extraction"] |= {"batch_tokens": 128, "max_model_len": 512, "device_map": "auto"}
    untracked = write_config(workdir, config, "untracked.yaml")
    assert planned_rules(snakemake(workdir, "-n", configfile=untracked)) == set()

    script = workdir / "workflow_scripts" / "train_draft.py"
    original = script.read_text()
    try:
        script.write_text(original + "# a comment edit reruns nothing\n")
        assert planned_rules(snakemake(workdir, "-n", configfile=configfile)) == set()
        script.write_text(original + "_RERUN_PATCH = 1\n")
        assert "train_draft" in planned_rules(snakemake(workdir, "-n", configfile=configfile))
    finally:
        script.write_text(original)  # newer than the outputs, the code as it was
    assert planned_rules(snakemake(workdir, "-n", configfile=configfile)) == set()


def test_evaluation_switched_to_vllm_reruns_the_preflight_and_the_evaluation_alone(finished):
    """Trying vLLM serving after an evaluation in the HF loop: neither the data nor the hidden states
    nor the draft depend on which backend evaluates it."""
    workdir, configfile = finished
    config = yaml.safe_load(configfile.read_text())
    config["eval"] = {**config.get("eval", {}), "backend": "vllm"}
    planned = planned_rules(snakemake(workdir, "-n", configfile=write_config(workdir, config, "vllm_eval.yaml")))
    assert "evaluate_draft" in planned
    assert planned <= {"check_setup", "evaluate_draft", "estimate_payoff", "plot_evaluation"}


def _mtimes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_patched_trainer_trains_again_from_step_0_and_nothing_upstream_runs(finished):
    workdir, configfile = finished
    results = workdir / RESULTS
    before = load_file(results / "draft" / "model.safetensors")
    upstream = _mtimes(results / "hidden_states") | _mtimes(results / "data")
    # the math: a draft initialised from another seed learns other weights
    _patch(workdir, "draftsmith.train.loop", "\n_SEED_SHIFT = 1\n_seed = torch.manual_seed\n"
           "torch.manual_seed = lambda s: _seed(s + _SEED_SHIFT)\n")
    assert planned_rules(snakemake(workdir, "-n", configfile=configfile)) == \
        {"train_draft", "evaluate_draft", "plot_training", "plot_evaluation", "estimate_payoff"}
    snakemake(workdir, configfile=configfile)
    after = load_file(results / "draft" / "model.safetensors")
    assert any(not before[k].equal(after[k]) for k in before), "the patched trainer wrote the old weights"
    summary = read_json(results / "train" / "summary.json")
    assert summary["resumed_from_step"] == 0 and "training code" in summary["resume"]
    assert "training code (draftsmith.train and its imports) changed" in \
        (workdir / "logs" / "t" / "train_draft.log").read_text()
    assert _mtimes(results / "hidden_states") | _mtimes(results / "data") == upstream

    # --forcerun with the same code trains again instead of re-saving the last checkpoint
    snakemake(workdir, "--forcerun", "train_draft", "--until", "train_draft", configfile=configfile)
    summary = read_json(results / "train" / "summary.json")
    assert summary["resumed_from_step"] == 0 and "finished run" in summary["resume"]


@pytest.mark.slow
def test_a_patched_capture_rewrites_the_shards_and_nothing_upstream_runs(finished):
    workdir, configfile = finished
    results = workdir / RESULTS
    shards = {k: v for k, v in _mtimes(results / "hidden_states").items() if "/shard-" in k}
    assert shards
    data = _mtimes(results / "data")
    _patch(workdir, "draftsmith.extract.extract", "\nCAPTURE_PATCH = 1\n")
    planned = planned_rules(snakemake(workdir, "-n", configfile=configfile))
    assert planned == {"extract_hidden_states", "merge_hidden_states", "train_draft", "evaluate_draft",
                       "plot_training", "plot_evaluation", "estimate_payoff"}
    snakemake(workdir, configfile=configfile)
    rewritten = {k: v for k, v in _mtimes(results / "hidden_states").items() if "/shard-" in k}
    assert rewritten.keys() == shards.keys() and all(rewritten[k] != shards[k] for k in shards), \
        "shards were reused after a capture patch"
    assert _mtimes(results / "data") == data


@pytest.mark.slow
def test_weights_swapped_in_place_rerun_the_stages_that_run_them(finished):
    import torch
    from safetensors.torch import save_file

    workdir, configfile = finished
    model = Path(read_json(workdir / RESULTS / "target.json")["model_path"])
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("layers.0.mlp.up_proj.weight"))
    tensors[name] = torch.randn_like(tensors[name])  # same names, shapes and size: other weights
    save_file(tensors, weights, metadata={"format": "pt"})
    planned = planned_rules(snakemake(workdir, "-n", configfile=configfile))
    assert {"regenerate_responses", "extract_hidden_states", "evaluate_draft"} <= planned
    assert not planned & {"inspect_target", "check_setup"}


@pytest.mark.slow
def test_a_draft_trained_alone_is_evaluated_next_and_a_deleted_one_trained_again(finished):
    """Training alone after a change (``--until train_draft``, or a retrain whose run stopped after
    it) writes config.json byte for byte as before and other weights: the next run evaluates them.
    A draft a failed retrain left deleted (Snakemake removes a failed job's outputs) is trained
    again, though the evaluation files after it are still there."""
    workdir, configfile = finished
    snakemake(workdir, configfile=configfile)  # what the tests before left to redo
    config = yaml.safe_load(configfile.read_text())
    config["train"]["lr"] = 1e-2
    other = write_config(workdir, config, name="other_lr.yaml")
    draft = workdir / RESULTS / "draft"
    shape = (draft / "config.json").read_bytes()
    snakemake(workdir, "--until", "train_draft", configfile=other)
    assert (draft / "config.json").read_bytes() == shape
    assert {"evaluate_draft", "estimate_payoff"} <= planned_rules(snakemake(workdir, "-n", configfile=other))
    snakemake(workdir, configfile=other)
    for name in ("config.json", "model.safetensors"):
        (draft / name).unlink()
    assert "train_draft" in planned_rules(snakemake(workdir, "-n", configfile=other))


@pytest.mark.slow
def test_a_source_replaced_by_an_older_file_reruns_the_rules_that_read_it(tmp_path):
    """Snakemake compares modification times only: a data source replaced by an older file (mv,
    cp -p, rsync -t) or a save_to_disk folder written again would leave the old train.jsonl to train
    the draft. The rules that read the raw sources take their identity by stat as a parameter, so
    exactly those rules and what follows them rerun, with regeneration off and on."""
    import os
    import shutil

    import datasets

    import tiny

    workdir, config = tiny_workflow(tmp_path)
    chats = Path(config["data"]["sources"][0])
    hour_ago = chats.stat().st_mtime - 3600

    def older(name: str, rows: list) -> Path:  # another version of a source, written an hour ago
        path = tiny.write_jsonl(tmp_path / name, rows)
        os.utime(path, (hour_ago, hour_ago))
        return path

    old_chats = older("old_chats.jsonl", [{"messages": [{"role": "user", "content": f"Good day number {i}"},
                                                        {"role": "assistant", "content": f"Good day {i}."}]}
                                          for i in range(40)])
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"text": f"Plain text number {i}."} for i in range(8)]).save_to_disk(saved)
    questions = tiny.write_jsonl(tmp_path / "questions.jsonl", [{"question": f"What is {i} + {i}?"} for i in range(3)])
    old_questions = older("old_questions.jsonl", [{"question": f"What is {i} times {i}?"} for i in range(3)])
    config["data"]["sources"].append(str(saved))
    config["eval"] = {"sources": [{"name": "sums", "path": str(questions)}]}
    configs = {}
    for run, regenerate in (("off", False), ("on", True)):
        configs[run] = write_config(workdir, {**config, "run": run, "vocab": {"draft_vocab_size": 64},
                                              "regenerate": {"enabled": regenerate, "max_new_tokens": 4}}, f"{run}.yaml")

    def targets(run: str) -> list[str]:
        results = f"results/{run}"
        return [f"{results}/preflight.json", f"{results}/vocab/mapping.safetensors",
                f"{results}/data/eval_sources/sums.jsonl"]

    def planned() -> dict[str, set[str]]:
        return {run: planned_rules(snakemake(workdir, "-n", *targets(run), configfile=configfile))
                for run, configfile in configs.items()}

    def settle() -> None:
        for run, configfile in configs.items():
            snakemake(workdir, *targets(run), configfile=configfile)
        assert planned() == {"off": set(), "on": set()}

    settle()
    readers = {"off": {"check_setup", "prepare_dataset", "build_vocab_mapping"},
               "on": {"check_setup", "regenerate_responses", "prepare_dataset", "build_vocab_mapping"}}
    shutil.copy2(old_chats, chats)  # cp -p: the older version back, modification time and all
    assert chats.stat().st_mtime < (workdir / "results/off/data/train.jsonl").stat().st_mtime
    assert planned() == readers
    settle()
    datasets.Dataset.from_list([{"text": f"Other text number {i}."} for i in range(8)]).save_to_disk(saved)
    assert planned() == readers
    settle()
    os.replace(old_questions, questions)  # mv
    assert planned() == {"off": {"prepare_eval_prompts"}, "on": {"prepare_eval_prompts"}}


@pytest.mark.slow
def test_a_chat_template_replaced_by_an_older_file_reruns_the_preflight_and_the_data(tmp_path):
    """The chat template renders every training row: one replaced in place by an older file (mv,
    cp -p, rsync -t) must rerun the preflight and prepare_dataset, not leave train.jsonl rendered
    by the old template while the stages that run the weights rerun around it."""
    import os

    from transformers import AutoTokenizer

    import tiny

    workdir, config = tiny_workflow(tmp_path)
    configfile = write_config(workdir, {**config, "vocab": {"draft_vocab_size": 64}})
    targets = ["results/t/preflight.json", "results/t/data/train.jsonl"]
    snakemake(workdir, *targets, configfile=configfile)
    assert planned_rules(snakemake(workdir, "-n", *targets, configfile=configfile)) == set()

    model = Path(config["target"]["path"])
    newer = tiny.build_tokenizer(tmp_path / "newer", template=tiny.CHATML_TEMPLATE.replace("\n", " says:\n", 1))
    hour_ago = (workdir / "results/t/data/train.jsonl").stat().st_mtime - 3600
    for file in newer.iterdir():
        os.utime(file, (hour_ago, hour_ago))
        os.replace(file, model / file.name)  # mv: the new template, an old modification time
    assert AutoTokenizer.from_pretrained(model).chat_template != tiny.CHATML_TEMPLATE
    assert {"inspect_target", "check_setup", "prepare_dataset"} <= \
        planned_rules(snakemake(workdir, "-n", *targets, configfile=configfile))
