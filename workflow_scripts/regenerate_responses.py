"""Snakemake entry: replace the training conversations' assistant turns with the target's answers."""

from draftsmith.engines.shared import SharedEngine
from draftsmith.gate import gate_for_run, wait_for_preflight
from draftsmith.logs import setup_logging
from draftsmith.placement import engine_env, engine_placement
from draftsmith.regenerate.settings import RegenerateSettings
from draftsmith.regenerate.stage import regenerate_responses
from draftsmith.targets.inspect import read_target_json

# vLLM may start its engine with multiprocessing "spawn", which runs this file again as
# __mp_main__ in the child, where there is no `snakemake` object: only the job itself runs the body.
if __name__ == "__main__":
    setup_logging(snakemake.log[0])
    wait_for_preflight(gate_for_run(snakemake.config["run"]))  # no load before check_setup passes
    target = read_target_json(snakemake.input.target)
    with engine_placement(snakemake.resources.gpu, engine_env(snakemake.config, snakemake.rule)):
        regenerate_responses(
            snakemake.input.sources,
            target["model_path"],
            snakemake.output.data,
            snakemake.params.work_dir,
            RegenerateSettings.from_config(snakemake.params.config),
            trust_remote_code=target["trust_remote_code"],
            shared_engine=SharedEngine.for_regeneration(snakemake.config, snakemake.input.target),
        )
