"""Snakemake entry: render the conversations with the target's chat template into train/heldout rows."""

from pathlib import Path

from draftsmith.data import DataSettings, prepare_dataset
from draftsmith.logs import setup_logging
from draftsmith.targets.inspect import read_target_json

setup_logging(snakemake.log[0])
prepare_dataset(
    list(snakemake.input.sources),
    read_target_json(snakemake.input.target)["model_path"],
    Path(snakemake.output.train).parent,
    DataSettings.from_config(snakemake.params.config),
    workers=snakemake.threads,
)
