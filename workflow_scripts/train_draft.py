"""Snakemake entry: train the EAGLE-3 draft (torchrun when train.devices or train.nodes > 1)."""

from pathlib import Path

from draftsmith.logs import setup_logging
from draftsmith.placement import engine_placement
from draftsmith.train import run_training, settings_and_launch

setup_logging(snakemake.log[0])
settings, launch = settings_and_launch({**snakemake.params.settings,
                                        "device": snakemake.params.get("device", "auto")})
# The GPUs of this node: train.devices of the gpu = devices x nodes the job booked.
with engine_placement(min(snakemake.resources.gpu, snakemake.params.settings["devices"])):
    run_training(
        snakemake.input.index,
        snakemake.input.mapping,
        snakemake.input.target,
        Path(snakemake.output.config).parent,
        snakemake.params.work_dir,
        settings,
        **launch,
        log_path=snakemake.log[0],
        metrics_out=snakemake.output.metrics,
        summary_out=snakemake.output.summary,
    )
