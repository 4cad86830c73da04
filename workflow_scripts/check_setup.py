"""Snakemake entry: the weight-free preflight checks of the data sources, vocab and engines; its
verdict opens or shuts the gate that jobs loading the target wait at (draftsmith/gate.py)."""

from pathlib import Path

from draftsmith.gate import deciding, gate_for_run
from draftsmith.logs import setup_logging
from draftsmith.preflight import PreflightSettings, check_setup
from draftsmith.quick_exit import end_job
from draftsmith.targets.inspect import read_target_json

setup_logging(snakemake.log[0])
with deciding(gate_for_run(snakemake.config["run"])):
    check_setup(
        Path(snakemake.input.config).parent,
        list(snakemake.input.sources),
        snakemake.output.report,
        PreflightSettings.from_config(snakemake.params.config),
        self_written=snakemake.params.self_written,
        target=read_target_json(snakemake.input.target),
    )
end_job()
