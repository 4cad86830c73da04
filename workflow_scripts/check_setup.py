"""Snakemake entry: the weight-free preflight checks of the data sources, vocab and engines."""

from pathlib import Path

from draftsmith.logs import setup_logging
from draftsmith.preflight import check_setup

setup_logging(snakemake.log[0])
check_setup(
    Path(snakemake.input.config).parent,
    list(snakemake.input.sources),
    snakemake.output.report,
    format=snakemake.params.format,
    max_seq_len=snakemake.params.max_seq_len,
    draft_vocab_size=snakemake.params.draft_vocab_size,
    engines=snakemake.params.engines,
    sizes=snakemake.params.sizes,
)
