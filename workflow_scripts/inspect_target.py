"""Snakemake entry: preflight the target (no weights loaded) and write target.json."""

from pathlib import Path

from draftsmith.logs import setup_logging
from draftsmith.targets.inspect import write_target_json

setup_logging(snakemake.log[0])
write_target_json(
    snakemake.output.target,
    Path(snakemake.input.config).parent,
    aux_layer_ids=snakemake.params.aux_layer_ids,
    trust_remote_code=snakemake.params.trust_remote_code,
    layers_path=snakemake.params.layers_path,
    dtype=snakemake.params.dtype,
    hf_stages=snakemake.params.hf_stages,
)
