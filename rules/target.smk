# The target model: the embedded demo model, and the preflight that reads no weights.


rule demo_target:
    output:
        config=f"{RESULTS}/target/config.json",
    params:
        folder=lambda wildcards, output: os.path.dirname(output.config),
        cache_dir="resources",
        code=code("draftsmith.demo"),
    log:
        f"{LOGS}/demo_target.log",
    benchmark:
        f"{BENCH}/demo_target.tsv"
    threads: 2
    conda:
        "../envs/trainer.yaml"
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
    params:
        aux_layer_ids=config["target"]["aux_layer_ids"],
        trust_remote_code=config["target"]["trust_remote_code"],
        layers_path=config["target"]["layers_path"],
        code=code("draftsmith.targets.inspect"),
    log:
        f"{LOGS}/inspect_target.log",
    threads: 1
    conda:
        # the environment of the rules that run the target, so target.json records the support
        # of the vLLM they will run, not of the trainer's (which has none)
        "../envs/vllm.yaml"
    script:
        "../workflow_scripts/inspect_target.py"
