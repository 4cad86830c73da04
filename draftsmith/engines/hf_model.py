"""Loading the target with Hugging Face transformers: one loader for regeneration, extraction and
evaluation (the class its config names, so a multimodal wrapper loads as itself), and the tokens
that end its answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.engines.cpu_bfloat16 import cpu_multiplies_bfloat16
from draftsmith.engines.loads import target_load
from draftsmith.errors import ExtractionError, TargetError

MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str) -> str:
    """Where the target runs, for every stage and every cache key: ``auto`` = cuda when a GPU is
    visible, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ExtractionError(f"device {device!r} was asked for, but torch sees no CUDA GPU",
                              where="device", fix="set device: cpu, or run on a machine with a GPU")
    return device


def model_dtype_name(dtype: str, device: str, *, batched_hf: bool = False) -> str:
    """The dtype the target runs in on the resolved ``device``, by name, for every stage, engine and
    cache key: ``auto`` = bfloat16 on GPU; on CPU float32, except for transformers' batched forwards
    (``batched_hf``: regeneration, synthesis and extraction with the HF backend) on a CPU that
    multiplies bfloat16 natively, where they run up to 2.9x faster in it (docs/benchmarks.md, "bfloat16
    where the CPU multiplies it"). Evaluation's loop decodes one token at a time, where bfloat16 saves
    nothing and its coarse logits tie, and vLLM's CPU build is checked in float32: both stay float32."""
    if dtype == "auto":
        if device != "cpu":
            return "bfloat16"
        return "bfloat16" if batched_hf and cpu_multiplies_bfloat16() else "float32"
    if dtype not in MODEL_DTYPES:
        raise ExtractionError(f"unknown model dtype {dtype!r}", where="target.dtype",
                              fix=f"use auto or one of {sorted(MODEL_DTYPES)}")
    return dtype


def stage_model_dtype(settings) -> str:
    """``model_dtype_name`` for a stage that runs the target through ``settings.backend`` on
    ``settings.device`` (regeneration's, synthesis's or extraction's settings): the one answer its
    load and its cache key share; the HF backend's forwards are the batched ones."""
    return model_dtype_name(settings.model_dtype, resolve_device(settings.device),
                            batched_hf=settings.backend == "hf")


def resolve_model_dtype(dtype: str, device: str) -> torch.dtype:
    """``model_dtype_name`` as a torch dtype, for transformers."""
    return MODEL_DTYPES[model_dtype_name(dtype, device)]


def load_hf_model(model_path: str | Path, *, dtype: str = "auto", device: str = "auto",
                  device_map: str | None = None, trust_remote_code: bool = False) -> nn.Module:
    """Load the target with the architecture class its config names (as preflight builds it)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from draftsmith.targets.inspect import load_config

    config = load_config(model_path, trust_remote_code)
    device = resolve_device(device)
    # use_safetensors: never unpickle a .bin checkpoint, which can run arbitrary code.
    kwargs = {"config": config, "dtype": resolve_model_dtype(dtype, device), "use_safetensors": True,
              "device_map": device_map or device, "trust_remote_code": trust_remote_code}
    classes = [getattr(transformers, a) for a in (config.architectures or []) if hasattr(transformers, a)]
    errors = []
    try:
        if classes:
            return classes[0].from_pretrained(model_path, **kwargs).eval()
        for auto_cls in (AutoModelForCausalLM, AutoModelForImageTextToText):
            try:
                return auto_cls.from_pretrained(model_path, **kwargs).eval()
            except ValueError as e:  # this auto class does not know the config; try the next one
                errors.append(f"{auto_cls.__name__}: {e}")
    except OSError as e:  # no (safetensors) weights, or a file missing from the folder
        raise TargetError(f"cannot load the target's weights: {e}", where=str(model_path),
                          fix="give a model folder with its .safetensors weights (Draftsmith never loads "
                              "pickled .bin/.pt checkpoints; convert them with safetensors first)") from e
    raise TargetError(f"transformers cannot load architecture {config.architectures}: " + "; ".join(errors),
                      where=str(model_path), fix="use extraction.backend: vllm, or a transformers release "
                                                 "that knows this architecture")


def load_target_model(model_path: str | Path, *, dtype: str = "auto", device: str = "auto",
                      trust_remote_code: bool = False) -> torch.nn.Module:
    """The target as extraction loads it (``load_hf_model``: the class its config names, so a
    multimodal wrapper loads as itself), with a neutral generation config.

    The model folder's generation_config.json (repetition penalty, top_k, min_length, ...) is
    replaced so that "greedy" means argmax and "temperature t" means only that: what the draft
    learns and what evaluation measures must be the same distribution (a sampling call passes
    ``top_k=0`` too: generate fills in its own default of 50 where the config leaves it unset).
    """
    from transformers import GenerationConfig

    with target_load(f"transformers ({model_dtype_name(dtype, resolve_device(device))} on {resolve_device(device)})"):
        model = load_hf_model(model_path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    text_config = model.config.get_text_config()
    model.generation_config = GenerationConfig(
        bos_token_id=getattr(text_config, "bos_token_id", None),
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=getattr(text_config, "pad_token_id", None),
    )
    return model


def stop_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Tokens that end an answer: the model's generation EOS ids and the tokenizer's EOS (the
    chat template's end-of-turn token, e.g. <|im_end|>)."""
    ids: list[int] = []
    for source in (model.generation_config.eos_token_id, getattr(tokenizer, "eos_token_id", None)):
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise TargetError("neither the model nor its tokenizer names an end-of-sequence token, so "
                          "generation could only stop at max_new_tokens",
                          fix="set eos_token_id in the model's generation_config.json or the tokenizer")
    return ids


def stop_ids_from_files(model_path: str | Path, *, trust_remote_code: bool = False) -> list[int]:
    """``stop_token_ids`` without loading weights: the generation config transformers would give
    the model (its generation_config.json, else one derived from config.json) and the tokenizer's EOS."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(model_path)
    except OSError:
        generation = GenerationConfig.from_model_config(
            AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code))
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    return stop_token_ids(SimpleNamespace(generation_config=generation), tokenizer)
