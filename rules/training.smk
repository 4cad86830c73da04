# Training the EAGLE-3 draft. Checkpoints live in train/state/, outside the rule's outputs, so a
# killed or failed run resumes from its last checkpoint instead of starting over. Offline, the
# draft trains on the extracted store; online (train.mode), one job runs the engine beside the
# trainer and the states pass through a bounded window in train/state/window/.


if config["train"]["mode"] == "online":

    rule train_draft_online:
        input:
            train=rules.prepare_dataset.output.train,
            mapping=rules.build_vocab_mapping.output.mapping,
            target=rules.inspect_target.output.target,
        output:
            config=f"{RESULTS}/draft/config.json",
            weights=f"{RESULTS}/draft/model.safetensors",
            metrics=f"{RESULTS}/train/metrics.jsonl",
            summary=report(
                f"{RESULTS}/train/summary.json",
                caption="../report/train_summary.rst",
                category="3. Training",
            ),
        log:
            f"{LOGS}/train_draft_online.log",
        benchmark:
            f"{BENCH}/train_draft_online.tsv"
        conda:
            "../envs/vllm.yaml"
        threads: job_threads(online_gpus())
        resources:
            gpu=online_gpus(),
        params:
            work_dir=f"{RESULTS}/train/state",
            config=stage_config(
                "train",
                "draft",
                "seed",
                "device",
                "extraction",
                "target.dtype",
                "online",
                leave_out=[
                    "train.checkpoint_every",
                    "train.rdzv_port",
                    "extraction.batch_tokens",
                    "extraction.max_model_len",
                    "extraction.device_map",
                ],
            ),
            engine_gpus=target_gpus(),
            weights=target_weights(),
            code=script_code("train_draft_online"),
        script:
            "../workflow_scripts/train_draft_online.py"

else:

    rule train_draft:
        input:
            index=rules.merge_hidden_states.output.index,
            mapping=rules.build_vocab_mapping.output.mapping,
            target=rules.inspect_target.output.target,
        output:
            config=f"{RESULTS}/draft/config.json",
            weights=f"{RESULTS}/draft/model.safetensors",
            metrics=f"{RESULTS}/train/metrics.jsonl",
            summary=report(
                f"{RESULTS}/train/summary.json",
                caption="../report/train_summary.rst",
                category="3. Training",
            ),
        log:
            f"{LOGS}/train_draft.log",
        benchmark:
            f"{BENCH}/train_draft.tsv"
        conda:
            "../envs/trainer.yaml"
        threads: job_threads(train_gpus())
        resources:
            gpu=train_gpus(),
            # SLURM's node count (the slurm executor's --nodes), so train.nodes alone asks for them
            nodes=config["train"]["nodes"],
        params:
            work_dir=f"{RESULTS}/train/state",
            config=stage_config(
                "train", "draft", "seed", "device", leave_out=["train.checkpoint_every", "train.rdzv_port"]
            ),
            code=script_code("train_draft"),
        script:
            "../workflow_scripts/train_draft.py"


rule plot_training:
    input:
        metrics=f"{RESULTS}/train/metrics.jsonl",
    output:
        curves=report(
            f"{RESULTS}/train/training_curves.png",
            caption="../report/training_curves.rst",
            category="3. Training",
        ),
    log:
        f"{LOGS}/plot_training.log",
    conda:
        "../envs/trainer.yaml"
    threads: 1
    params:
        code=script_code("plot_training"),
    script:
        "../workflow_scripts/plot_training.py"
