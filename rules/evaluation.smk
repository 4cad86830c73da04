# Evaluation: speculative decoding of held-out prompts with the target and the trained draft,
# checked token for token against plain greedy decoding, beside a prompt-lookup baseline.


rule evaluate_draft:
    input:
        draft=f"{RESULTS}/draft/config.json",
        target=rules.inspect_target.output.target,
        heldout=rules.prepare_dataset.output.heldout,
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
        settings=config["eval"],
        dtype=config["target"]["dtype"],
        device=config["device"],
        tensor_parallel_size=eval_tensor_parallel_size(),
        weights=target_weights(),
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
    log:
        f"{LOGS}/plot_evaluation.log",
    conda:
        "../envs/trainer.yaml"
    threads: 1
    params:
        code=script_code("plot_evaluation"),
    script:
        "../workflow_scripts/plot_evaluation.py"
