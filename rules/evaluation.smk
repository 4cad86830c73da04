# Evaluation: speculative decoding of held-out prompts (and of each eval.sources prompt set) with
# the target and the trained draft, checked token for token against plain greedy decoding, beside a
# prompt-lookup baseline; then the decode speedup those acceptance rates would give on a server.


rule evaluate_draft:
    input:
        draft=f"{RESULTS}/draft/config.json",
        # the weights too: a retrain leaves config.json byte for byte as it was, and Snakemake does
        # not rerun for a newer small input whose checksum it finds unchanged
        weights=f"{RESULTS}/draft/model.safetensors",
        target=rules.inspect_target.output.target,
        heldout=rules.prepare_dataset.output.heldout,
        sources=eval_source_prompts(),
    output:
        acceptance=report(
            f"{RESULTS}/eval/acceptance.json",
            caption="../report/acceptance.rst",
            category="4. Evaluation",
        ),
    log:
        f"{LOGS}/evaluate_draft.log",
    benchmark:
        f"{BENCH}/evaluate_draft.tsv"
    conda:
        "../envs/vllm.yaml"
    threads: job_threads(eval_gpus())
    resources:
        gpu=eval_gpus(),
    params:
        # the eval section less its inputs (sources) and the payoff estimate's own section, so a
        # change to those does not rerun the evaluation
        config=stage_config(
            "eval",
            "target.dtype",
            "device",
            "extraction.tensor_parallel_size",
            leave_out=["eval.sources", "eval.payoff"],
        ),
        sources=list(eval_sources()),
        weights=target_weights(),
        engine=engine_version("eval"),
        code=script_code("evaluate_draft"),
    script:
        "../workflow_scripts/evaluate_draft.py"


rule plot_evaluation:
    input:
        acceptance=rules.evaluate_draft.output.acceptance,
    output:
        by_position=report(
            f"{RESULTS}/eval/acceptance_by_position.png",
            caption="../report/acceptance_by_position.rst",
            category="4. Evaluation",
        ),
        tau_vs_k=report(
            f"{RESULTS}/eval/tau_vs_k.png",
            caption="../report/tau_vs_k.rst",
            category="4. Evaluation",
        ),
        prompt_sets=report(
            f"{RESULTS}/eval/prompt_sets.png",
            caption="../report/prompt_sets.rst",
            category="4. Evaluation",
        ),
    log:
        f"{LOGS}/plot_evaluation.log",
    conda:
        "../envs/trainer.yaml"
    threads: 1
    params:
        code=script_code("plot_evaluation"),
    script:
        "../workflow_scripts/plot_evaluation.py"


rule prepare_eval_prompts:
    input:
        source=eval_source_path,
        target=rules.inspect_target.output.target,
    output:
        prompts=f"{RESULTS}/data/eval_sources/{{name}}.jsonl",
        stats=f"{RESULTS}/data/eval_sources/{{name}}.stats.json",
    log:
        f"{LOGS}/prepare_eval_prompts/{{name}}.log",
    conda:
        "../envs/trainer.yaml"
    threads: 1
    params:
        config=stage_config("eval.max_prompts", "data.max_seq_len", "data.max_bad_fraction"),
        source_identity=eval_source_identity,
        code=script_code("prepare_eval_prompts"),
    script:
        "../workflow_scripts/prepare_eval_prompts.py"


rule estimate_payoff:
    input:
        acceptance=rules.evaluate_draft.output.acceptance,
        target=rules.inspect_target.output.target,
        draft=f"{RESULTS}/draft/config.json",
    output:
        payoff=report(
            f"{RESULTS}/eval/payoff.json",
            caption="../report/payoff.rst",
            category="4. Evaluation",
        ),
        plot=report(
            f"{RESULTS}/eval/payoff.png",
            caption="../report/payoff_plot.rst",
            category="4. Evaluation",
        ),
    log:
        f"{LOGS}/estimate_payoff.log",
    conda:
        "../envs/trainer.yaml"
    threads: 1
    params:
        config=stage_config("eval.payoff", "extraction.tensor_parallel_size", "target.dtype"),
        code=script_code("estimate_payoff"),
    script:
        "../workflow_scripts/estimate_payoff.py"
