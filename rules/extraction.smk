# Hidden-state extraction: one job (one engine instance) per part; shards live beside the
# part manifests, out of reach of Snakemake's clean-up of failed jobs, so a rerun resumes.


rule extract_hidden_states:
    input:
        train=rules.prepare_dataset.output.train,
        target=rules.inspect_target.output.target,
    output:
        manifest=f"{RESULTS}/hidden_states/part-{{part}}.json",
    log:
        f"{LOGS}/extract_hidden_states/part-{{part}}.log",
    benchmark:
        f"{BENCH}/extract_hidden_states/part-{{part}}.tsv"
    conda:
        "../envs/vllm.yaml"
    threads: job_threads(target_gpus())
    resources:
        gpu=target_gpus(),
    params:
        config=stage_config(
            "extraction",
            "target.dtype",
            "device",
            leave_out=["extraction.batch_tokens", "extraction.max_model_len", "extraction.device_map"],
        ),
        weights=target_weights(),
        code=script_code("extract_hidden_states"),
    script:
        "../workflow_scripts/extract_hidden_states.py"


rule merge_hidden_states:
    input:
        manifests=expand(f"{RESULTS}/hidden_states/part-{{part}}.json", part=extraction_parts()),
    output:
        index=f"{RESULTS}/hidden_states/index.json",
    log:
        f"{LOGS}/merge_hidden_states.log",
    conda:
        "../envs/trainer.yaml"
    threads: 1
    params:
        code=script_code("merge_hidden_states"),
    script:
        "../workflow_scripts/merge_hidden_states.py"
