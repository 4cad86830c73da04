"""Snakemake entry: speculative decoding of the held-out prompts with the trained draft and a baseline."""

from pathlib import Path

from draftsmith.engines.shared import SharedEngine
from draftsmith.evaluate import EvalSettings, evaluate_draft
from draftsmith.gate import gate_for_run, wait_for_preflight
from draftsmith.logs import setup_logging
from draftsmith.placement import engine_env, engine_placement

# vLLM may start its engine with multiprocessing "spawn", which runs this file again as
# __mp_main__ in the child, where there is no `snakemake` object: only the job itself runs the body.
if __name__ == "__main__":
    setup_logging(snakemake.log[0])
    wait_for_preflight(gate_for_run(snakemake.config["run"]))  # no load before check_setup passes
    with engine_placement(snakemake.resources.gpu, engine_env(snakemake.config, snakemake.rule)):
        evaluate_draft(
            Path(snakemake.input.draft).parent,
            snakemake.input.target,
            snakemake.input.heldout,
            snakemake.output.acceptance,
            EvalSettings.from_config(snakemake.params.config),
            sources=dict(zip(snakemake.params.sources, snakemake.input.sources, strict=True)),
            shared_engine=SharedEngine.from_config(snakemake.config, snakemake.input.target),
        )
