"""Snakemake entry: the draft vocabulary and its d2t/t2d mapping."""

from draftsmith.io import read_json
from draftsmith.logs import setup_logging
from draftsmith.vocab import build_vocab_mapping

setup_logging(snakemake.log[0])
build_vocab_mapping(
    snakemake.input.train,
    read_json(snakemake.input.target)["vocab_size"],
    snakemake.params.draft_vocab_size,
    snakemake.output.mapping,
    snakemake.output.stats,
    workers=snakemake.threads,
)
