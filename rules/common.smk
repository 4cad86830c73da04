# Helpers for every stage: paths, config lookups, resources, code fingerprints.

import copy
import os
from pathlib import Path

from snakemake.exceptions import WorkflowError

from draftsmith.config import uses_gpu
from draftsmith.engines.registry import say_warm_engines
from draftsmith.engines.shared import regeneration_context
from draftsmith.fingerprint import script_fingerprint
from draftsmith.gate import gate_for_run, mark_planned
from draftsmith.preflight import PreflightSettings
from draftsmith.targets.identity import files_fingerprint, weights_fingerprint
from draftsmith.targets.vllm_install import installed_vllm_version
from draftsmith.workflow_hooks import cancel_scheduler_timers, check_workflow_profile

RUN = config["run"]
RESULTS = f"results/{RUN}"
LOGS = f"logs/{RUN}"
BENCH = f"benchmarks/{RUN}"


onstart:
    # Before any job starts, the profile that keeps a comment edit from rerunning a stage is in effect
    # (draftsmith/workflow_hooks.py); here, since Snakemake sets its rerun triggers only after it
    # has read the Snakefile.
    check_workflow_profile({t.name.lower() for t in workflow.rerun_triggers}, Path.cwd(), Path(workflow.basedir))
    # When this plan runs check_setup, the jobs that load the target wait
    # for its verdict (draftsmith/gate.py; docs/design.md says why this is no file edge).
    mark_planned(gate_for_run(RUN), any(job.rule.name == "check_setup" for job in workflow.dag.needrun_jobs()))


onsuccess:
    say_warm_engines()
    cancel_scheduler_timers()


onerror:
    # a failed job's engine stays warm for the rerun: say so
    say_warm_engines()
    cancel_scheduler_timers()


def stage_config(*keys, leave_out=()):
    """The part of the config a stage's settings read (``X.from_config`` in its workflow script):
    the dotted ``keys`` (whole sections or single keys) less the dotted keys ``leave_out``, as a
    nested dict with sorted keys. A rule's parameter, so a change to a key the stage does not read does not rerun it;
    tests/test_settings.py checks that each rule passes every key its settings read."""
    part = {}
    for key in keys:
        *parents, last = key.split(".")
        value, into = config, part
        for name in parents:
            value, into = value[name], into.setdefault(name, {})
        into[last] = copy.deepcopy(value[last])
    for key in leave_out:
        *parents, last = key.split(".")
        into = part
        for name in parents:
            into = into[name]
        del into[last]
    return _keys_sorted(part)


def _keys_sorted(value):
    """``value`` with every dict's keys in sorted order: Snakemake compares parameters as written, so
    two keys swapped in the config file would otherwise rerun the stage and everything after it."""
    if isinstance(value, dict):
        return {key: _keys_sorted(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_keys_sorted(item) for item in value]
    return value


def script_code(rule_name):
    """A parameter that changes with workflow_scripts/<rule>.py and every draftsmith module it imports,
    transitively (Snakemake tracks the script, not the package code behind it)."""
    return script_fingerprint(f"{workflow.basedir}/workflow_scripts/{rule_name}.py")


def target_dir():
    if config["target"]["source"] == "demo":
        return f"{RESULTS}/target"
    return config["target"]["path"]


def target_weights():
    """A parameter of the rules that run the target's weights: their content's fingerprint, so
    weights swapped in place rerun them. The demo target is a rule's output, tracked as such."""
    if config["target"]["source"] == "demo":
        return "demo_target"
    return weights_fingerprint(target_dir())


def sources_identity(sources):
    """A parameter of the rules that read the raw data sources: their files' identity by stat (size,
    modification and status-change times; a save_to_disk folder's files too), so a source replaced
    by an older file (mv, cp -p, rsync -t) or a folder written again reruns them, where Snakemake
    compares modification times only. A source under this run's results/ is a rule's output, which
    Snakemake tracks: taken when the plan is made, before that rule writes it, its identity would
    be stale at once and rerun its readers again on the next plan."""
    outputs = Path(RESULTS).resolve()
    return files_fingerprint(s for s in sources if not Path(s).resolve().is_relative_to(outputs))


def target_files_identity():
    """A parameter of inspect_target: the target's config and tokenizer files' identity by stat, so
    a chat template or tokenizer replaced by an older file (mv, cp -p, rsync -t) reruns the
    preflight and the data stages after it, where Snakemake compares modification times only. The
    demo's are a rule's outputs, which Snakemake tracks."""
    if config["target"]["source"] == "demo":
        return None
    return files_fingerprint([target_config(), *target_tokenizer_files()])


def eval_source_identity(wildcards):
    """sources_identity of prepare_eval_prompts' one evaluation prompt set."""
    return sources_identity([eval_source_path(wildcards)])


def engine_version(*stages):
    """The installed vLLM, when one of ``stages`` (PreflightSettings.engines' names: extraction, eval,
    regenerate, which writes synthesized conversations too; none: any) runs the target through it,
    so an upgrade reruns the rule that checks or runs it (whose kept chunks and shards are keyed by
    the release too: targets.vllm_install.engine_release). A workflow that never uses vLLM does not rerun when it changes; inspect_target, whose
    target.json every stage reads, follows extraction's alone (the one that reads what target.json
    says vLLM can capture), so trying eval.backend: vllm after an evaluation in the HF loop reruns
    the preflight and the evaluation, not the extraction and training between them."""
    engines = PreflightSettings.from_config(config).engines(synthesizing=writes_its_own())
    if not any(engines.get(stage) == "vllm" for stage in stages or engines):
        return None
    return installed_vllm_version()


def target_config():
    return f"{target_dir()}/config.json"


def target_tokenizer_files():
    """The tokenizer and chat template files preflight reads (never the weights), so a
    new chat template reruns preflight and what follows; the demo's appear with its config."""
    if config["target"]["source"] == "demo":
        return []
    patterns = (
        "tokenizer*",
        "chat_template*",
        "special_tokens_map.json",
        "vocab.*",
        "merges.txt",
        "*.tiktoken",
        "tiktoken.model",
    )
    folder = Path(target_dir())
    return sorted({str(p) for pattern in patterns for p in folder.glob(pattern) if p.is_file()})


def user_sources():
    """The data sources read as given (for demo, the demo's conversations); not the target's own."""
    return [
        f"{RESULTS}/data/demo_conversations.jsonl" if s == "demo" else s
        for s in config["data"]["sources"]
        if s != "self"
    ]


def writes_its_own():
    """Whether the target writes conversations itself (data.sources holds self)."""
    return "self" in config["data"]["sources"]


def synthesized():
    return [f"{RESULTS}/data/synthesized.jsonl"] if writes_its_own() else []


def conversations_for_training():
    """The conversations the trainer learns from: the sources' with the target's own answers when
    regeneration is on, and those the target wrote itself (already its own answers)."""
    if config["regenerate"]["enabled"] and user_sources():
        return [f"{RESULTS}/data/regenerated.jsonl", *synthesized()]
    return user_sources() + synthesized()


def self_written_turns():
    """check_setup's check of the user turn the target writes from: the system prompts it is
    written after ([None]: none), or None when the target writes no conversations."""
    if not writes_its_own():
        return None
    return config["synthesize"]["system_prompts"] or [None]


def target_gpus():
    """GPUs one extraction part needs (declared so Snakemake and cluster executors book them)."""
    extraction = config["extraction"]
    return extraction["tensor_parallel_size"] if uses_gpu(config["device"]) else 0


def engine_tensor_parallel_size(backend):
    """vLLM runs the target at extraction's tensor parallel size in every stage; HF on one device."""
    if backend == "vllm":
        return config["extraction"]["tensor_parallel_size"]
    return 1


def regenerate_tensor_parallel_size():
    return engine_tensor_parallel_size(config["regenerate"]["backend"])


def regenerate_gpus():
    return regenerate_tensor_parallel_size() if uses_gpu(config["device"]) else 0


def eval_tensor_parallel_size():
    return engine_tensor_parallel_size(config["eval"]["backend"])


def eval_gpus():
    return eval_tensor_parallel_size() if uses_gpu(config["device"]) else 0


def train_gpus():
    """GPUs of the whole training job: train.devices on each of train.nodes nodes."""
    train = config["train"]
    return train["devices"] * train["nodes"] if uses_gpu(config["device"]) else 0


def online_gpus():
    """GPUs of the online training job: the engine's (extraction.tensor_parallel_size) and the
    trainer's (train.devices), side by side on one node."""
    return target_gpus() + train_gpus()


def job_threads(gpus):
    """CPU threads of a job that runs the target or trains. On GPUs each device's job gets an equal
    share of the cores (at most 4 per device: tokenising, scheduling, writing shards, loading
    batches), one core staying free for the CPU stages beside them (build_vocab_mapping, plots). The
    share is of all the GPUs the run was given (--resources gpu=N): with fewer, jobs that could run
    side by side on their own GPUs would wait for cores instead. On the CPU the math is the job:
    all cores."""
    cores = total_cores()
    if not gpus:
        return cores
    machine_gpus = max(gpus, run_gpus())
    per_gpu = max(1, min(4, (cores - 1) // machine_gpus))
    return max(1, min(cores - 1, per_gpu * gpus))


def threads_beside_gpu_jobs():
    """CPU threads of a CPU stage that runs beside the jobs on GPUs (build_vocab_mapping beside
    extraction): the cores those jobs leave when every GPU of the run is busy (job_threads), so it
    need not wait for them; all cores on the CPU, where it runs alone."""
    gpus = max(run_gpus(), target_gpus()) if target_gpus() else 0
    return max(1, total_cores() - job_threads(gpus)) if gpus else total_cores()


def total_cores():
    """--cores. Commands that run no job (--unlock, --report, --cleanup-metadata) may leave it out,
    and Snakemake then raises on reading it; no thread count matters to them."""
    try:
        return workflow.cores
    except WorkflowError:
        return 1


def run_gpus():
    """The GPUs of --resources gpu=N (0 when not given)."""
    given = workflow.global_resources.get("gpu")
    value = given.value if given is not None else None
    return int(value) if isinstance(value, (int, float)) else 0


def extraction_parts():
    return range(config["extraction"]["parts"])


def eval_sources():
    """The evaluation prompt sets besides the held-out split, by name (eval.sources)."""
    return {source["name"]: source["path"] for source in config["eval"]["sources"]}


def eval_source_path(wildcards):
    return eval_sources()[wildcards.name]


def eval_source_prompts():
    """Each evaluation prompt set rendered for the target (prepare_eval_prompts' outputs)."""
    return [f"{RESULTS}/data/eval_sources/{name}.jsonl" for name in eval_sources()]


def final_outputs():
    """What a run delivers: the draft itself too, so a draft deleted by a failed retrain is trained
    again though the evaluation files after it are still there."""
    return [
        f"{RESULTS}/preflight.json",
        f"{RESULTS}/draft/config.json",
        f"{RESULTS}/draft/model.safetensors",
        f"{RESULTS}/eval/acceptance.json",
        f"{RESULTS}/eval/acceptance_by_position.png",
        f"{RESULTS}/eval/tau_vs_k.png",
        f"{RESULTS}/eval/prompt_sets.png",
        f"{RESULTS}/eval/payoff.json",
        f"{RESULTS}/eval/payoff.png",
        f"{RESULTS}/train/training_curves.png",
    ]
