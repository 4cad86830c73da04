# Helpers for every stage: paths, config lookups, resources, code fingerprints.

import os
from pathlib import Path

from draftsmith.config import cuda_present
from draftsmith.fingerprint import code_fingerprint

RUN = config["run"]
RESULTS = f"results/{RUN}"
LOGS = f"logs/{RUN}"
BENCH = f"benchmarks/{RUN}"


def code(*modules):
    """A parameter that changes with the draftsmith code a stage imports (Snakemake tracks only scripts)."""
    return code_fingerprint(*modules)


def target_dir():
    if config["target"]["source"] == "demo":
        return f"{RESULTS}/target"
    return config["target"]["path"]


def target_config():
    return f"{target_dir()}/config.json"


def target_tokenizer_files():
    """The tokenizer files preflight reads (never the weights); the demo's appear with its config."""
    if config["target"]["source"] == "demo":
        return []
    return [str(p) for p in Path(target_dir()).glob("tokenizer*") if p.is_file()]


def dataset_sources():
    return [
        f"{RESULTS}/data/demo_conversations.jsonl" if s == "demo" else s
        for s in config["data"]["sources"]
    ]


def conversations_for_training():
    """The conversations the trainer learns from: the target's own answers when regeneration is on."""
    if config["regenerate"]["enabled"]:
        return [f"{RESULTS}/data/regenerated.jsonl"]
    return dataset_sources()


def data_settings():
    """prepare_dataset's settings; regenerated conversations are always in messages format."""
    settings = {k: v for k, v in config["data"].items() if k != "sources"}
    if config["regenerate"]["enabled"]:
        settings["format"] = "auto"
    return {**settings, "seed": config["seed"]}


def uses_gpu(device):
    return device == "cuda" or (device == "auto" and cuda_present())


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


def job_threads(gpus):
    """CPU threads of a job that runs the target or trains. On GPUs a few cores per device do its
    CPU work (tokenising, scheduling, writing shards, loading batches); the rest stay free for the
    CPU stages that run beside it (build_vocab_mapping, plots). On the CPU the math is the job: all
    cores."""
    if gpus:
        return max(1, min(workflow.cores - 1, 4 * gpus))
    return workflow.cores


def extraction_parts():
    return range(config["extraction"]["parts"])


def final_outputs():
    return [
        f"{RESULTS}/eval/acceptance.json",
        f"{RESULTS}/eval/acceptance_by_position.png",
        f"{RESULTS}/eval/tau_vs_k.png",
        f"{RESULTS}/train/training_curves.png",
    ]
