"""Honest caching, checked through real `snakemake` runs of the first stages on a tiny target."""

import os

import pytest

from workflow_helpers import copy_workflow, planned_jobs, planned_rules, snakemake, tiny_workflow, write_config

pytestmark = pytest.mark.slow

PREFLIGHT_TARGETS = ["results/t/target.json", "results/t/vocab/mapping.safetensors"]


@pytest.fixture
def workflow(tmp_path):
    workdir, config = tiny_workflow(tmp_path)
    config["vocab"] = {"draft_vocab_size": 64}
    return workdir, write_config(workdir, config)


def test_caching_follows_inputs_params_and_code(workflow):
    workdir, config = workflow

    plan = snakemake(workdir, "-n", *PREFLIGHT_TARGETS, configfile=config)
    assert planned_rules(plan) == {"inspect_target", "prepare_dataset", "build_vocab_mapping"}
    assert "reason: Missing output files" in plan.stdout
    # On the CPU the data stages take every core of --cores 2.
    jobs = planned_jobs(plan)
    assert jobs["prepare_dataset"]["threads"] == jobs["build_vocab_mapping"]["threads"] == 2

    snakemake(workdir, *PREFLIGHT_TARGETS, configfile=config)
    assert (workdir / "results/t/target.json").exists()
    # Jobs' torch threads sleep while they wait (the Snakefile's default), and the log says so.
    wait_policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    assert f"OMP_WAIT_POLICY={wait_policy}" in (workdir / "logs/t/prepare_dataset.log").read_text()
    again = snakemake(workdir, "-n", *PREFLIGHT_TARGETS, configfile=config)
    assert planned_rules(again) == set(), again.stdout
    assert "Nothing to be done" in again.stdout + again.stderr
    # The data stages' outputs are the same for any number of workers, so the cores given are no
    # part of their cache key: another --cores reruns nothing.
    assert "with 2 worker processes" in (workdir / "logs/t/prepare_dataset.log").read_text()
    assert planned_rules(snakemake(workdir, "-n", "--cores", "1", *PREFLIGHT_TARGETS, configfile=config)) == set()

    # A parameter of one stage reruns that stage (and its dependents) only.
    changed = snakemake(workdir, "-n", *PREFLIGHT_TARGETS, "--config", "vocab={draft_vocab_size: 32}",
                        configfile=config)
    assert planned_rules(changed) == {"build_vocab_mapping"}

    # A comment edit reruns nothing; editing the code of one stage reruns that stage and its
    # dependents, nothing upstream.
    with (workdir / "draftsmith" / "data.py").open("a") as f:
        f.write("\n# a comment\n")
    assert planned_rules(snakemake(workdir, "-n", *PREFLIGHT_TARGETS, configfile=config)) == set()
    with (workdir / "draftsmith" / "data.py").open("a") as f:
        f.write("\n_EDIT = 1\n")
    edited = snakemake(workdir, "-n", *PREFLIGHT_TARGETS, configfile=config)
    assert planned_rules(edited) == {"prepare_dataset", "build_vocab_mapping"}

    with (workdir / "draftsmith" / "vocab.py").open("a") as f:
        f.write("\n_EDIT = 1\n")
    snakemake(workdir, *PREFLIGHT_TARGETS, configfile=config)
    assert planned_rules(snakemake(workdir, "-n", *PREFLIGHT_TARGETS, configfile=config)) == set()


def test_bad_config_stops_before_any_job(workflow):
    workdir, config = workflow
    result = snakemake(workdir, "-n", "--config", "train={ttt_stepz: 3}", configfile=config, check=False)
    assert result.returncode != 0
    assert "train.ttt_stepz: unknown key" in result.stdout + result.stderr
    assert not (workdir / "results").exists()


def test_the_demo_plans_in_a_working_directory_of_its_own(tmp_path):
    """``snakemake -d elsewhere`` without --configfile: the demo's config is read beside the Snakefile
    (it was looked for under the working directory), and the artifacts go to the working directory."""
    workdir = copy_workflow(tmp_path / "wf")
    elsewhere = tmp_path / "elsewhere"
    plan = snakemake(workdir, "-n", "-d", str(elsewhere))
    assert {"demo_target", "demo_dataset", "train_draft", "evaluate_draft"} <= planned_rules(plan)
    snakemake(workdir, "-d", str(elsewhere), "results/demo/data/demo_conversations.jsonl")
    assert (elsewhere / "results/demo/data/demo_conversations.jsonl").stat().st_size
    assert not (workdir / "results").exists()
