"""Snakemake entry: render the conversations with the target's chat template into train/heldout rows."""

from pathlib import Path

from draftsmith.data import DataSettings, prepare_dataset
from draftsmith.logs import setup_logging

setup_logging(snakemake.log[0])
prepare_dataset(
    list(snakemake.input.sources),
    snakemake.params.tokenizer,
    Path(snakemake.output.train).parent,
    DataSettings(**snakemake.params.settings),
)
