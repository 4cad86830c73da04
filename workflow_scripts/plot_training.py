"""Snakemake entry: training loss and per-TTT-step accuracy curves."""

from draftsmith.logs import setup_logging
from draftsmith.plots import plot_training

setup_logging(snakemake.log[0])
plot_training(snakemake.input.metrics, snakemake.output.curves)
