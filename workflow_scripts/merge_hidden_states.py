"""Snakemake entry: merge the extraction parts' manifests into hidden_states/index.json."""

from draftsmith.extract.extract import merge
from draftsmith.logs import setup_logging

setup_logging(snakemake.log[0])
merge(snakemake.input.manifests, snakemake.output.index)
