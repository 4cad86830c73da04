"""Snakemake entry: conversations the target writes itself, user turns and answers (data.sources: [self])."""

from pathlib import Path

from draftsmith.gate import gate_for_run, wait_for_preflight
from draftsmith.io import read_json
from draftsmith.logs import setup_logging
from draftsmith.placement import engine_env, engine_placement
from draftsmith.regenerate.settings import RegenerateSettings
from draftsmith.synthesize import SynthesizeSettings, synthesize_conversations

# vLLM may start its engine with multiprocessing "spawn", which runs this file again as
# __mp_main__ in the child, where there is no `snakemake` object: only the job itself runs the body.
if __name__ == "__main__":
    setup_logging(snakemake.log[0])
    wait_for_preflight(gate_for_run(snakemake.config["run"]))  # no load before check_setup passes
    target = read_json(snakemake.input.target)
    with engine_placement(snakemake.resources.gpu, engine_env(snakemake.config, snakemake.rule)):
        synthesize_conversations(
            Path(snakemake.input.config).parent,
            snakemake.output.data,
            snakemake.output.stats,
            snakemake.params.work_dir,
            SynthesizeSettings.from_config(snakemake.params.config),
            RegenerateSettings.from_config(snakemake.params.config),
            exclude=list(snakemake.input.exclude),
            trust_remote_code=bool(target.get("trust_remote_code", False)),
        )
