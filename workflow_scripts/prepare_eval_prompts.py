"""Snakemake entry: one evaluation prompt set (eval.sources) rendered with the target's chat template."""

from draftsmith.data import prepare_eval_prompts
from draftsmith.logs import setup_logging
from draftsmith.targets.inspect import read_target_json

setup_logging(snakemake.log[0])
prepare_eval_prompts(
    snakemake.input.source,
    read_target_json(snakemake.input.target)["model_path"],
    snakemake.output.prompts,
    max_prompts=snakemake.params.max_prompts,
    max_seq_len=snakemake.params.max_seq_len,
    max_bad_fraction=snakemake.params.max_bad_fraction,
)
