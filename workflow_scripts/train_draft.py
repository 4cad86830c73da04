"""Snakemake entry: train the EAGLE-3 draft (torchrun when train.devices or train.nodes > 1)."""

from pathlib import Path

from draftsmith.logs import setup_logging
from draftsmith.placement import engine_placement
from draftsmith.settings import with_untracked
from draftsmith.train import TrainSettings, launch_from_config, run_training

setup_logging(snakemake.log[0])
config = with_untracked(snakemake.params.config, snakemake.config, TrainSettings.UNTRACKED)
launch = launch_from_config(config)
# The GPUs of this node: train.devices of the gpu = devices x nodes the job booked.
with engine_placement(min(snakemake.resources.gpu, launch["devices"])):
    run_training(
        snakemake.input.index,
        snakemake.input.mapping,
        snakemake.input.target,
        Path(snakemake.output.config).parent,
        snakemake.params.work_dir,
        TrainSettings.from_config(config),
        **launch,
        log_path=snakemake.log[0],
        metrics_out=snakemake.output.metrics,
        summary_out=snakemake.output.summary,
    )
