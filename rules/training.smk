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
    params:
        work_dir=f"{RESULTS}/train/state",
        settings={**config["train"], "seed": config["seed"]},
        device=config["device"],
        code=script_code("train_draft"),
    log:
        f"{LOGS}/train_draft.log",
    benchmark:
        f"{BENCH}/train_draft.tsv"
    threads: job_threads(train_gpus())
    resources:
        gpu=train_gpus(),
    conda:
        "../envs/trainer.yaml"
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
    params:
        code=script_code("plot_training"),
    log:
        f"{LOGS}/plot_training.log",
    threads: 1
    conda:
        "../envs/trainer.yaml"
    script:
        "../workflow_scripts/plot_training.py"
