"""Snakemake entry: acceptance by draft position and τ against k, for the draft and the baseline."""

from draftsmith.logs import setup_logging
from draftsmith.plots import plot_evaluation

setup_logging(snakemake.log[0])
plot_evaluation(snakemake.input.acceptance, snakemake.output.by_position, snakemake.output.tau_vs_k,
                snakemake.output.prompt_sets)
