"""Snakemake entry: train the EAGLE-3 draft (torchrun when train.devices or train.nodes > 1)."""

from pathlib import Path

from draftsmith.logs import setup_logging
from draftsmith.train import run_training, settings_from_dict

setup_logging(snakemake.log[0])
values = dict(snakemake.params.settings)
launch = {key: values.pop(key) for key in ("devices", "nodes", "rdzv_port") if key in values}
device = snakemake.params.get("device", "auto")
run_training(
    snakemake.input.index,
    snakemake.input.mapping,
    snakemake.input.target,
    Path(snakemake.output.config).parent,
    snakemake.params.work_dir,
    settings_from_dict({**values, "device": device}),
    **launch,
    log_path=snakemake.log[0],
    metrics_out=snakemake.output.metrics,
    summary_out=snakemake.output.summary,
)
