# The target model: the embedded demo model, and the preflight that reads no weights and no
# regenerated data (inspect_target, then check_setup for the data sources, vocab and engines).


rule demo_target:
    output:
        config=f"{RESULTS}/target/config.json",
    log:
        f"{LOGS}/demo_target.log",
    benchmark:
        f"{BENCH}/demo_target.tsv"
    conda:
        "../envs/trainer.yaml"
    threads: 2
    params:
        folder=lambda wildcards, output: os.path.dirname(output.config),
        cache_dir="resources",
        code=script_code("demo_target"),
    script:
        "../workflow_scripts/demo_target.py"


rule inspect_target:
    input:
        config=target_config(),
        tokenizer=target_tokenizer_files(),
    output:
        target=report(
            f"{RESULTS}/target.json",
            caption="../report/target.rst",
            category="1. Target",
        ),
    log:
        f"{LOGS}/inspect_target.log",
    conda:
        # the environment of the rules that run the target, so target.json records the support
        # of the vLLM they will run, not of the trainer's (which has none)
        "../envs/vllm.yaml"
    threads: 1
    params:
        aux_layer_ids=config["target"]["aux_layer_ids"],
        trust_remote_code=config["target"]["trust_remote_code"],
        layers_path=config["target"]["layers_path"],
        files=target_files_identity(),
        engine=engine_version("extraction"),
        code=script_code("inspect_target"),
    script:
        "../workflow_scripts/inspect_target.py"


rule check_setup:
    input:
        # for the tokenizer class AutoTokenizer picks: loading that class alone spares this job the
        # seconds of importing torch (docs/benchmarks.md, "Preflight and planning")
        target=rules.inspect_target.output.target,
        config=target_config(),
        tokenizer=target_tokenizer_files(),
        sources=user_sources(),
    output:
        report=f"{RESULTS}/preflight.json",
    log:
        f"{LOGS}/check_setup.log",
    # seconds, and it stops a run whose data or engine would fail hours later: first when it can
    priority: 50
    conda:
        # where the engine rules run: the vLLM it checks is the one they will use
        "../envs/vllm.yaml"
    threads: 1
    params:
        # how the sources are read, the draft vocabulary, each stage's backend, and the sizes
        # draftsmith.fits checks (a batch that cannot fit the trainer, generation past the context)
        config=stage_config(
            "data.format",
            "data.max_seq_len",
            "data.max_bad_fraction",
            "regenerate.enabled",
            "vocab.draft_vocab_size",
            "device",
            "draft.num_layers",
            "train.batch_tokens",
            "train.ttt_steps",
            "eval.max_new_tokens",
            "regenerate.max_new_tokens",
            "extraction.backend",
            "eval.backend",
            "regenerate.backend",
        ),
        sources_identity=sources_identity(user_sources()),
        self_written=self_written_turns(),
        engine=engine_version(),
        code=script_code("check_setup"),
    script:
        "../workflow_scripts/check_setup.py"
