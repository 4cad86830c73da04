"""Snakemake entry: extract one part's hidden states (resuming complete shards) and write its manifest."""

from pathlib import Path

from draftsmith.engines.shared import SharedEngine
from draftsmith.extract.extract import extract_part
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.gate import gate_for_run, wait_for_preflight
from draftsmith.logs import setup_logging
from draftsmith.placement import engine_env, engine_placement
from draftsmith.settings import with_untracked

# vLLM may start its engine with multiprocessing "spawn", which runs this file again as
# __mp_main__ in the child, where there is no `snakemake` object: only the job itself runs the body.
if __name__ == "__main__":
    setup_logging(snakemake.log[0])
    wait_for_preflight(gate_for_run(snakemake.config["run"]))  # no load before check_setup passes
    with engine_placement(snakemake.resources.gpu, engine_env(snakemake.config, snakemake.rule)):
        extract_part(
            snakemake.input.train,
            snakemake.input.target,
            int(snakemake.wildcards.part),
            ExtractionSettings.from_config(
                with_untracked(snakemake.params.config, snakemake.config, ExtractionSettings.UNTRACKED)
            ),
            store_root=Path(snakemake.output.manifest).parent,
            manifest_path=snakemake.output.manifest,
            shared_engine=SharedEngine.from_config(snakemake.config, snakemake.input.target),
        )
