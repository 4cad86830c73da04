# Data: the demo conversations, conversations the target writes itself, on-policy regeneration,
# tokenisation with loss masks, draft vocab.


rule demo_dataset:
    output:
        data=f"{RESULTS}/data/demo_conversations.jsonl",
    log:
        f"{LOGS}/demo_dataset.log",
    conda:
        "../envs/trainer.yaml"
    threads: 1
    params:
        code=script_code("demo_dataset"),
    script:
        "../workflow_scripts/demo_dataset.py"


rule synthesize_conversations:
    input:
        config=target_config(),
        tokenizer=target_tokenizer_files(),
        target=rules.inspect_target.output.target,
        exclude=eval_source_prompts(),
    output:
        data=f"{RESULTS}/data/synthesized.jsonl",
        stats=report(
            f"{RESULTS}/data/synthesized.stats.json",
            caption="../report/synthesized_stats.rst",
            category="2. Data",
        ),
    log:
        f"{LOGS}/synthesize_conversations.log",
    benchmark:
        f"{BENCH}/synthesize_conversations.tsv"
    # before regeneration where both wait for the GPU: sampled, it decodes in an engine of its own,
    # and the engine greedy regeneration starts after it stays for capture and evaluation (one
    # load of the target fewer; draftsmith/engines/shared.py)
    priority: 10
    conda:
        "../envs/vllm.yaml"
    threads: job_threads(regenerate_gpus())
    resources:
        gpu=regenerate_gpus(),
    params:
        # the user turns' own settings, and regeneration's for the answers and the engine
        config=stage_config(
            "synthesize",
            "regenerate",
            "seed",
            "target.dtype",
            "device",
            "extraction.tensor_parallel_size",
            "data.max_bad_fraction",
        ),
        work_dir=f"{RESULTS}/data/synthesize_work",
        weights=target_weights(),
        engine=engine_version("regenerate"),
        code=script_code("synthesize_conversations"),
    script:
        "../workflow_scripts/synthesize_conversations.py"


rule regenerate_responses:
    input:
        sources=user_sources(),
        target=rules.inspect_target.output.target,
    output:
        data=f"{RESULTS}/data/regenerated.jsonl",
    log:
        f"{LOGS}/regenerate_responses.log",
    benchmark:
        f"{BENCH}/regenerate_responses.tsv"
    conda:
        "../envs/vllm.yaml"
    threads: job_threads(regenerate_gpus())
    resources:
        gpu=regenerate_gpus(),
    params:
        config=stage_config(
            "regenerate",
            "seed",
            "target.dtype",
            "device",
            "extraction.tensor_parallel_size",
            "data.max_bad_fraction",
        ),
        work_dir=f"{RESULTS}/data/regenerate_work",
        sources_identity=sources_identity(user_sources()),
        weights=target_weights(),
        engine=engine_version("regenerate"),
        # the positions each answer gets where it decodes in the engine capture and evaluation share
        shared_context=regeneration_context(config),
        code=script_code("regenerate_responses"),
    script:
        "../workflow_scripts/regenerate_responses.py"


rule prepare_dataset:
    input:
        sources=conversations_for_training(),
        target=rules.inspect_target.output.target,
    output:
        train=f"{RESULTS}/data/train.jsonl",
        heldout=f"{RESULTS}/data/heldout.jsonl",
        stats=report(
            f"{RESULTS}/data/stats.json",
            caption="../report/data_stats.rst",
            category="2. Data",
        ),
    log:
        f"{LOGS}/prepare_dataset.log",
    benchmark:
        f"{BENCH}/prepare_dataset.tsv"
    conda:
        "../envs/trainer.yaml"
    threads: total_cores()
    params:
        config=stage_config("data", "seed", "regenerate.enabled", leave_out=["data.sources"]),
        sources_identity=sources_identity(conversations_for_training()),
        code=script_code("prepare_dataset"),
    script:
        "../workflow_scripts/prepare_dataset.py"


rule build_vocab_mapping:
    input:
        train=rules.prepare_dataset.output.train,
        target=rules.inspect_target.output.target,
    output:
        mapping=f"{RESULTS}/vocab/mapping.safetensors",
        stats=report(
            f"{RESULTS}/vocab/stats.json",
            caption="../report/vocab_stats.rst",
            category="2. Data",
        ),
    log:
        f"{LOGS}/build_vocab_mapping.log",
    conda:
        "../envs/trainer.yaml"
    threads: threads_beside_gpu_jobs()
    params:
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        code=script_code("build_vocab_mapping"),
    script:
        "../workflow_scripts/build_vocab_mapping.py"
