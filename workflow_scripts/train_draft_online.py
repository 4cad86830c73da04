"""Snakemake entry: train the draft online, the engine on the first GPUs of the job, the trainer on the rest."""

from pathlib import Path

from draftsmith.extract.settings import ExtractionSettings
from draftsmith.gate import gate_for_run, wait_for_preflight
from draftsmith.logs import setup_logging
from draftsmith.online import OnlineSettings, run_online_training, split_devices
from draftsmith.placement import engine_env, engine_placement
from draftsmith.settings import with_untracked
from draftsmith.train import TrainSettings, launch_from_config

# vLLM may start its engine with multiprocessing "spawn", which runs this file again as
# __mp_main__ in the child, where there is no `snakemake` object: only the job itself runs the body.
if __name__ == "__main__":
    setup_logging(snakemake.log[0])
    wait_for_preflight(gate_for_run(snakemake.config["run"]))  # no load before check_setup passes
    params = snakemake.params
    config = with_untracked(params.config, snakemake.config, TrainSettings.UNTRACKED + ExtractionSettings.UNTRACKED)
    with engine_placement(snakemake.resources.gpu, engine_env(snakemake.config, snakemake.rule)) as claim:
        engine_devices, trainer_devices = split_devices(claim.devices, params.engine_gpus)
        run_online_training(
            snakemake.input.train,
            snakemake.input.target,
            snakemake.input.mapping,
            Path(snakemake.output.config).parent,
            params.work_dir,
            TrainSettings.from_config(config),
            ExtractionSettings.from_config(config),
            OnlineSettings.from_config(config),
            devices=launch_from_config(config)["devices"],
            engine_devices=engine_devices,
            trainer_devices=trainer_devices,
            log_path=snakemake.log[0],
            metrics_out=snakemake.output.metrics,
            summary_out=snakemake.output.summary,
        )
