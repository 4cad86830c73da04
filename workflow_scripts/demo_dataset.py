"""Snakemake entry: the demo conversations, from the chatterbot-corpus package."""

from draftsmith.demo import write_chatterbot_demo
from draftsmith.logs import setup_logging

setup_logging(snakemake.log[0])
write_chatterbot_demo(snakemake.output.data)
