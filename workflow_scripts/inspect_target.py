"""Snakemake entry: preflight the target (no weights loaded) and write target.json."""

from pathlib import Path

from draftsmith.config import uses_gpu
from draftsmith.logs import setup_logging
from draftsmith.quick_exit import end_job
from draftsmith.targets.inspect import hf_stages, write_target_json

setup_logging(snakemake.log[0])
write_target_json(
    snakemake.output.target,
    Path(snakemake.input.config).parent,
    aux_layer_ids=snakemake.params.aux_layer_ids,
    trust_remote_code=snakemake.params.trust_remote_code,
    layers_path=snakemake.params.layers_path,
    # read from the config, not params: a backend switched elsewhere must not rerun preflight and
    # with it every stage downstream
    dtype=snakemake.config["target"]["dtype"],
    hf_stages=hf_stages(snakemake.config, gpu=uses_gpu(snakemake.config["device"])),
)
end_job()
