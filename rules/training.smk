# Training the EAGLE-3 draft. Checkpoints live in train/state/, outside the rule's outputs, so a
# killed or failed run resumes from its last checkpoint instead of starting over.


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
    params:
        work_dir=f"{RESULTS}/train/state",
        settings={**config["train"], **config["draft"], "seed": config["seed"]},
        device=config["device"],
        code=script_code("train_draft"),
    script:
        "../workflow_scripts/train_draft.py"


rule plot_training:
    input:
        metrics=rules.train_draft.output.metrics,
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
