"""Snakemake entry: one evaluation prompt set (eval.sources) rendered with the target's chat template."""

from draftsmith.eval_prompts import EvalPromptsSettings, prepare_eval_prompts
from draftsmith.logs import setup_logging
from draftsmith.targets.inspect import read_target_json

setup_logging(snakemake.log[0])
prepare_eval_prompts(
    snakemake.input.source,
    read_target_json(snakemake.input.target)["model_path"],
    snakemake.output.prompts,
    EvalPromptsSettings.from_config(snakemake.params.config),
)
