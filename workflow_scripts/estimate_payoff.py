"""Snakemake entry: the decode speedup the measured acceptance would give on the configured server."""

from pathlib import Path

from draftsmith.logs import setup_logging
from draftsmith.payoff import PayoffSettings, estimate_payoff
from draftsmith.plots import plot_payoff

setup_logging(snakemake.log[0])
estimate_payoff(
    snakemake.input.acceptance,
    snakemake.input.target,
    Path(snakemake.input.draft).parent,
    snakemake.output.payoff,
    PayoffSettings.from_config(snakemake.params.config),
)
plot_payoff(snakemake.output.payoff, snakemake.output.plot)
