"""Snakemake entry: the weight-free preflight checks of the data sources, vocab and engines."""

from pathlib import Path

from draftsmith.logs import setup_logging
from draftsmith.preflight import PreflightSettings, check_setup

setup_logging(snakemake.log[0])
check_setup(
    Path(snakemake.input.config).parent,
    list(snakemake.input.sources),
    snakemake.output.report,
    PreflightSettings.from_config(snakemake.params.config),
)
