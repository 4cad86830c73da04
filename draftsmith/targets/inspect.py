"""Preflight: learn everything later stages need about the target without reading its weights.

The model is built from its config on the meta device, so a 1T-parameter target is inspected
in seconds; every problem that would otherwise surface after a half-hour load (a wrapper the
tools do not know, layer ids out of range, no chat template, remote code) is raised here.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from draftsmith.errors import ConfigError, TargetError
from draftsmith.io import atomic_write_json
from draftsmith.placement import DEVICES_ENV
from draftsmith.targets.logits import IDENTITY as IDENTITY_LOGITS
from draftsmith.targets.logits import describe as describe_logits
from draftsmith.targets.logits import logit_transform
from draftsmith.targets.quantization import describe_quantization

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

TARGET_FORMAT = "draftsmith.target/1"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Where no GPU can be seen (a login node), the fit check assumes the largest memory one GPU has
# today (NVIDIA B300, 288 GB): what does not fit there fits no single device.
LARGEST_DEVICE_BYTES = 288 * 10**9
HF_STAGE_KEYS = {"regenerate_responses": "regenerate.backend", "extract_hidden_states": "extraction.backend",
                 "evaluate_draft": "eval.backend"}
HF_STAGE_FIXES = {
    "regenerate_responses": "set regenerate.backend: vllm (tensor parallel over extraction.tensor_parallel_size GPUs)",
    "extract_hidden_states": "set extraction.backend: vllm (tensor parallel over extraction.tensor_parallel_size GPUs)",
    "evaluate_draft": "set eval.backend: vllm (a target the HF loop cannot hold is then evaluated in vLLM "
                      "alone, against vLLM's own greedy decoding)",
}


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's usual low, middle and high layers: [2, L//2, L-3]; on targets of fewer than 7
    layers, where those collapse (5 layers: [2, 2, 2]), three distinct decoder-layer outputs spread
    from 1 to L-1. Below 4 layers fewer than three exist (3 layers: [1, 2]; 2 layers: [1]): the draft
    fuses those rather than the embeddings' output (id 0), which a 1-layer target alone falls back to."""
    usual = [2, num_layers // 2, num_layers - 3]
    if len(set(usual)) == 3 and usual == sorted(usual) and usual[0] < usual[-1] < num_layers:
        return usual
    if num_layers < 4:
        return list(range(1, num_layers)) or [0]
    return sorted({round(1 + k * (num_layers - 2) / 2) for k in range(3)})


def load_config(model_path: str | Path, trust_remote_code: bool):
    """The target's config, or a TargetError that says why it cannot be read."""
    from transformers import AutoConfig

    model_path = Path(model_path)
    config_file = model_path / "config.json"
    if not config_file.is_file():
        raise TargetError("the target folder has no config.json", where=str(model_path),
                          fix="point target.path at a Hugging Face model folder (config.json, tokenizer, weights)")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TargetError(f"config.json is not valid JSON: {e}", where=str(config_file),
                          fix="restore the model's config.json") from e
    auto_map = raw.get("auto_map") or {}
    code = remote_code_files(model_path, auto_map)
    if auto_map and not trust_remote_code:
        if raw.get("model_type") not in _known_model_types():
            raise TargetError(
                f"model type {raw.get('model_type')!r} needs the model's own Python code ({', '.join(code)}), "
                "and trust_remote_code is off",
                where=str(config_file),
                fix="read that code, then set target.trust_remote_code: true in the config")
    if auto_map and trust_remote_code:
        warn_remote_code(model_path, auto_map)
    try:
        return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as e:
        raise TargetError(f"transformers cannot read the config: {e}", where=str(config_file),
                          fix="upgrade transformers, or set target.trust_remote_code: true if the model "
                              "ships its own code") from e


def warn_remote_code(model_path: Path, auto_map: dict) -> None:
    log.warning("target.trust_remote_code is on: this Python code from the model folder will run: %s "
                "(named by auto_map in %s)", ", ".join(remote_code_files(model_path, auto_map)),
                model_path / "config.json")


def remote_code_files(model_path: Path, auto_map: dict) -> list[str]:
    """The files that auto_map's classes come from: ``<folder>/<module>.py``, or ``<repo>: <module>.py``
    for code that transformers would fetch from another repository."""
    files = set()
    for value in auto_map.values():
        for ref in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(ref, str) or "." not in ref:
                continue
            repo, _, ref = ref.rpartition("--")
            module = ref.rsplit(".", 1)[0] + ".py"
            files.add(f"{repo}: {module}" if repo else str(model_path / module))
    return sorted(files)


def check_weight_format(model_path: Path) -> None:
    """Refuse a target whose weights exist only as pickles (.bin, .pt): unpickling runs code."""
    names = [p.name for p in model_path.iterdir() if p.is_file()]
    if any(n.endswith(".safetensors") for n in names):
        return
    pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt")) and n != "training_args.bin")
    if pickles:
        raise TargetError(
            f"the target's weights are pickled ({', '.join(pickles[:3])}{', ...' if len(pickles) > 3 else ''}), "
            "and Draftsmith reads weights as safetensors only: unpickling a file can run any code",
            where=str(model_path),
            fix="convert the checkpoint to safetensors (e.g. load it once where you trust it and "
                "save_pretrained(..., safe_serialization=True)), or use the model's safetensors release")


def _known_model_types() -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES)


def build_meta_model(config, trust_remote_code: bool) -> nn.Module:
    """Instantiate the target's architecture with no storage (meta device)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    candidates = []
    for arch in getattr(config, "architectures", None) or []:
        if hasattr(transformers, arch):
            candidates.append(getattr(transformers, arch))
    candidates.extend(c for c in _auto_classes(config.model_type) if c not in candidates)
    auto_map = getattr(config, "auto_map", None) or {}
    errors = []
    # A checkpoint stored in float8 (or a dtype this torch lacks) names a dtype torch cannot make the
    # default: the structure alone is needed here, so build it in bfloat16.
    dtype = getattr(config, "dtype", None)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    kwargs = {} if dtype in (None, torch.float16, torch.bfloat16, torch.float32, torch.float64) else \
        {"dtype": torch.bfloat16}
    with torch.device("meta"):
        for cls in candidates:
            try:
                return cls._from_config(config, **kwargs)
            except Exception as e:  # noqa: BLE001 - try the next way of building it, report all
                errors.append(f"{cls.__name__}: {e}")
        for auto_cls in (AutoModelForCausalLM, AutoModelForImageTextToText):
            if auto_map and auto_cls.__name__ not in auto_map and candidates:
                continue
            try:
                return auto_cls.from_config(config, trust_remote_code=trust_remote_code, **kwargs)
            except (ValueError, KeyError) as e:
                errors.append(f"{auto_cls.__name__}: {e}")
    raise TargetError(
        f"transformers cannot build architecture {getattr(config, 'architectures', None)} "
        f"(model_type {config.model_type!r}): " + "; ".join(errors),
        fix="use a model folder whose architecture transformers knows, or enable "
            "target.trust_remote_code for a model that ships its own code")


def _auto_classes(model_type: str) -> list[type]:
    """The classes the Auto factories would pick for ``model_type``, found in their name tables:
    asking a factory that lacks the type costs seconds (its error message imports every config)."""
    import transformers
    from transformers.models.auto import modeling_auto

    found = []
    for table in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"):
        name = getattr(modeling_auto, table, {}).get(model_type)
        if isinstance(name, str) and hasattr(transformers, name):
            found.append(getattr(transformers, name))
    return found


def module_path(root: nn.Module, target: nn.Module) -> str:
    for name, module in root.named_modules():
        if module is target:
            return name
    raise TargetError(f"module {type(target).__name__} is not part of the model")


def find_decoder_layers(model: nn.Module, num_layers: int) -> str:
    """Dotted path of the text model's decoder layers, through any multimodal wrapper.

    Prefer the decoder that the model itself names (``get_decoder()``); otherwise take the one
    ModuleList of ``num_layers`` layers that sits beside a token embedding.
    """
    from torch import nn

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is not None and isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        if len(decoder.layers) == num_layers:
            return module_path(model, decoder.layers)
    embedding = model.get_input_embeddings()
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            parent_name = name.rpartition(".")[0]
            parent = model.get_submodule(parent_name) if parent_name else model
            if any(child is embedding for child in parent.children()):
                found.append(name)
    if len(found) == 1:
        return found[0]
    lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    raise TargetError(
        f"cannot tell which module list holds the {num_layers} decoder layers (candidates: {found or lists})",
        fix="set target.layers_path to the dotted path of the decoder layers, e.g. language_model.model.layers")


def check_head_without_bias(head: nn.Module, model_path: Path) -> None:
    """Refuse a target whose lm_head adds a bias (Phi-1/1.5/2, GPT-J, CodeGen). Training's teacher
    is the final state times the head's rows, and vLLM's EAGLE-3 draft head has no bias: the draft
    would learn logits the target never decodes from (a bias of std 1 moved them by 47% of the largest
    logit; a small one passes the extraction's check and flips the argmax at some positions)."""
    if getattr(head, "bias", None) is not None:
        raise TargetError(f"the target's lm_head ({type(head).__name__}) adds a bias to its logits, and training's "
                          "teacher (the final state times the head's rows) and vLLM's EAGLE-3 draft head have none: "
                          "the draft would learn other logits than the target's", where=f"{model_path}/config.json",
                          fix="use a target whose lm_head has no bias (Phi-3 and later, not Phi-1/1.5/2; not GPT-J "
                              "or CodeGen); no setting changes this")


def check_embedding_width(embed: nn.Module, head: nn.Module, hidden_size: int, model_path: Path) -> None:
    """Refuse a target whose token embedding or lm_head is narrower or wider than its hidden states
    (OPT-350m projects 512-wide embeddings to 1024: project_in/project_out). The draft takes its
    input embedding and its lm_head from the target and runs them on hidden-width states, and the
    final state captured (the lm_head's input) would not be hidden-width either."""
    widths = {"token embedding": getattr(embed, "embedding_dim", None), "lm_head": getattr(head, "in_features", None)}
    odd = {name: width for name, width in widths.items() if width is not None and width != hidden_size}
    if odd:
        widths = " and ".join(sorted({str(width) for width in odd.values()}))
        raise TargetError(f"the target's {' and '.join(odd)} {'are' if len(odd) > 1 else 'is'} {widths} wide, its "
                          f"hidden states {hidden_size}: it projects between them (as OPT-350m's "
                          "project_in/project_out do), and an EAGLE-3 draft runs the target's embedding and "
                          "lm_head on hidden-width states", where=f"{model_path}/config.json",
                          fix="use a target whose embedding is as wide as its hidden states (for OPT, "
                              "word_embed_proj_dim equal to hidden_size: every OPT size but 350m); no setting "
                              "changes this")


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    if len(set(layer_ids)) != len(layer_ids):
        raise TargetError(f"aux layer ids {list(layer_ids)} repeat a layer", where="target.aux_layer_ids",
                          fix="list each layer once")
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise TargetError(
            f"aux layer ids {bad} are out of range: the target has {num_layers} decoder layers, so ids run "
            f"0..{num_layers - 1} (id i is the input of decoder layer i; the final state {num_layers} is always captured)",
            where="target.aux_layer_ids", fix=f"use ids below {num_layers}, e.g. {default_aux_layer_ids(num_layers)}")
    return sorted(layer_ids)


def inspect_tokenizer(model_path: Path, vocab_size: int, trust_remote_code: bool = False) -> dict:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise TargetError(f"the target's tokenizer cannot be loaded: {e}", where=str(model_path),
                          fix="put the model's tokenizer files (tokenizer.json, tokenizer_config.json) in the folder") from e
    if len(tokenizer) > vocab_size:
        raise TargetError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}: "
            "they belong to different models", where=str(model_path),
            fix="use the tokenizer that was released with this model")
    if not tokenizer.chat_template:
        raise TargetError("the tokenizer has no chat template, so conversations cannot be formatted as the "
                          "target expects", where=str(model_path),
                          fix="add the model's chat template (chat_template.jinja or tokenizer_config.json "
                              "'chat_template') to the folder")
    return {"tokenizer_size": len(tokenizer), "has_chat_template": True,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
            # the class AutoTokenizer picked, so check_setup loads the same one without AutoTokenizer's
            # imports (torch and transformers' generation code: seconds of a check that takes one)
            "tokenizer_class": f"{type(tokenizer).__module__}.{type(tokenizer).__name__}"}


def inspect_target(model_path: str | Path, *, aux_layer_ids: Sequence[int] | None = None,
                   trust_remote_code: bool = False, layers_path: str | None = None) -> dict:
    """Describe the target (DESIGN.md's target.json) from its config and tokenizer alone, or take
    the description an earlier preflight made of the same files with the same code
    (``inspection_memo``)."""
    from draftsmith.targets import inspection_memo

    started = time.perf_counter()
    model_path = Path(model_path).resolve()
    settings = {"aux_layer_ids": None if aux_layer_ids is None else list(aux_layer_ids),
                "trust_remote_code": trust_remote_code, "layers_path": layers_path}
    key = inspection_memo.inspection_key(model_path, settings)
    info = inspection_memo.recall(key) if key else None
    if info is not None:
        log.info("target %s: described as an earlier preflight found it (the same files, settings and code; "
                 "%s)", model_path, inspection_memo.cache_dir())
        auto_map = json.loads((model_path / "config.json").read_text(encoding="utf-8")).get("auto_map")
        if trust_remote_code and auto_map:  # the later stages still run it: said as the inspection says it
            warn_remote_code(model_path, auto_map)
    else:
        info = _inspect(model_path, **settings)
        if key:
            inspection_memo.remember(key, info)
    return {**info, "inspect_seconds": round(time.perf_counter() - started, 3)}


def _inspect(model_path: Path, *, aux_layer_ids: Sequence[int] | None, trust_remote_code: bool,
             layers_path: str | None) -> dict:
    from draftsmith.targets.vllm_support import backend_support

    config = load_config(model_path, trust_remote_code)
    check_weight_format(model_path)
    text_config = config.get_text_config()
    num_layers = text_config.num_hidden_layers
    torch_dtype = str(getattr(text_config, "dtype", None) or getattr(config, "dtype", None) or "float32")
    model = build_meta_model(config, trust_remote_code)  # (may set config.dtype: read it first)
    if layers_path is None:
        layers_path = find_decoder_layers(model, num_layers)
    else:
        try:
            layers = model.get_submodule(layers_path)
        except AttributeError as e:
            raise TargetError(f"the model has no module {layers_path!r}", where="target.layers_path",
                              fix="leave target.layers_path empty to let preflight find the layers") from e
        if len(layers) != num_layers:
            raise TargetError(f"{layers_path} holds {len(layers)} modules, the config says {num_layers} layers",
                              where="target.layers_path")
    aux = check_layer_ids(default_aux_layer_ids(num_layers) if aux_layer_ids is None else aux_layer_ids, num_layers)
    raw = json.loads((model_path / "config.json").read_text(encoding="utf-8"))  # load_config has checked it
    text_key = None if text_config is config else _text_key(raw, text_config.model_type)
    quantization = describe_quantization(model, raw, text_key, layers_path.rpartition(".")[0] + ".")
    tokenizer = inspect_tokenizer(model_path, text_config.vocab_size, trust_remote_code)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    check_embedding_width(embed, head, text_config.hidden_size, model_path)
    check_head_without_bias(head, model_path)
    info = {
        "format": TARGET_FORMAT,
        "model_path": str(model_path),
        "architecture": (config.architectures or [type(model).__name__])[0],
        "model_type": config.model_type,
        "text_model_type": text_config.model_type,
        "wrapped": text_config is not config,
        "layers_path": layers_path,
        "embed_path": module_path(model, embed),
        "lm_head_path": module_path(model, head),
        # what the target does to lm_head(final state) before it decodes: training's teacher does the same
        "logit_transform": logit_transform(text_config.model_type, text_config.to_dict()),
        "tie_word_embeddings": head.weight is embed.weight,
        "num_hidden_layers": num_layers,
        "hidden_size": text_config.hidden_size,
        "vocab_size": text_config.vocab_size,
        "aux_layer_ids": aux,
        "final_layer_id": num_layers,
        "captured_layer_ids": [*aux, num_layers],
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "torch_dtype": torch_dtype.replace("torch.", ""),
        "quantization": quantization,
        "trust_remote_code": trust_remote_code,
        **tokenizer,
        "text_config": standard_names(text_config.to_dict()),
    }
    info["backends"] = backend_support(info, config)
    return info


def _text_key(raw: dict, text_model_type: str) -> str | None:
    """The key of a wrapper's config.json that holds its text model's config (text_config, ...)."""
    return next((k for k, v in raw.items() if isinstance(v, dict) and v.get("model_type") == text_model_type), None)


def standard_names(config: dict) -> dict:
    """A config as a dict (config.json's, or a config's ``to_dict()``) with transformers' standard
    names added where the model names a field its own way: GPT-2 keeps its width in ``n_embd``, which
    its config class maps to ``hidden_size`` (``attribute_map``) on the object only, never in the dict."""
    from transformers import CONFIG_MAPPING

    try:
        attribute_map = CONFIG_MAPPING[config.get("model_type")].attribute_map
    except KeyError:  # remote code, or no model_type: its own names are all there is
        return config
    return {**{name: config[own] for name, own in attribute_map.items() if own in config}, **config}


def weight_bytes(info: dict, dtype: str = "auto") -> int:
    """Bytes of the target's weights as the HF path loads them on a GPU: the quantized parameters as
    stored (target.json's ``quantization``, scales included), every other parameter (from the config,
    on the meta device) in ``dtype`` (``auto`` = bfloat16 on a GPU). A quantization whose bits are
    unknown counts as unquantized."""
    quantization = info.get("quantization") or {}
    stored, quantized = quantization.get("quantized_bytes"), quantization.get("quantized_parameters")
    plain = int(info["num_parameters"]) - (quantized if stored is not None else 0)
    return (stored or 0) + plain * DTYPE_BYTES["bfloat16" if dtype == "auto" else dtype]


def quantization_summary(info: dict) -> str:
    """The quantization in words, for logs and messages ("unquantized" for none)."""
    q = info.get("quantization")
    if not q:
        return "unquantized"
    if q["bits"] is None:
        return f"quantized with {q['method']} (bits unknown to Draftsmith: sized as unquantized)"
    return (f"{q['method']} {q['scheme']} ({q['config_key']}): {q['quantized_parameters'] / 1e9:,.1f}B "
            f"parameters quantized, the rest ({', '.join(q['unquantized'][:4])}{', ...' * (len(q['unquantized']) > 4)}) not")


def device_memory_bytes() -> int | None:
    """Memory of the smallest GPU this machine shows (a job may land on any), or None without
    nvidia-smi (a login node, a CPU machine)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = [int(float(v)) << 20 for v in out.split() if v.strip()]  # MiB
    return min(sizes) if sizes else None


def hf_stages(config: dict, *, gpu: bool) -> dict[str, int]:
    """The workflow's stages that load the whole target with transformers, and what each holds it
    in (``{rule: GPUs}``; 0: host memory, where ``gpu`` is false: the run's device is the CPU),
    from the validated config. A run on GPUs is first checked to have one (``check_gpu_present``):
    the workflow's preflight reads the config here, before any job that needs a GPU."""
    if gpu:
        check_gpu_present(config["device"])
    stages = {}
    if config["regenerate"]["enabled"] and config["regenerate"]["backend"] == "hf":
        stages["regenerate_responses"] = 1
    extraction = config["extraction"]
    if extraction["backend"] == "hf":
        stages["extract_hidden_states"] = extraction["tensor_parallel_size"] if extraction["device_map"] else 1
    if config["eval"]["backend"] == "hf":
        stages["evaluate_draft"] = 1
    return stages if gpu else dict.fromkeys(stages, 0)


def check_gpu_present(device: str) -> None:
    """Refuse ``device: cuda`` where torch sees no GPU: every stage that runs the target or trains
    would stop, the first after the data stages. Under SLURM the GPU jobs run on other nodes than
    this preflight job, so nothing is refused there."""
    import torch

    if device != "cuda" or os.environ.get("SLURM_JOB_ID") or torch.cuda.is_available():
        return
    raise ConfigError(
        "device: cuda, but torch sees no CUDA GPU on this machine (torch.cuda.is_available() is false), "
        "so the stages that run the target or train would stop", where="config key device",
        fix="on a cluster's login node, run it through the cluster's profile (--profile profiles/slurm: the jobs "
            "run on its nodes, docs/cluster.md) and keep device: cuda; on one machine, set device: cpu (or auto: "
            "the GPU where there is one), or run where torch can use a GPU (an NVIDIA driver, nvidia-smi listing "
            f"the GPUs, a CUDA build of torch); {DEVICES_ENV} only names GPU ids for placement, it makes none usable")


def _weights_phrase(info: dict, dtype: str) -> str:
    need, params = weight_bytes(info, dtype), info["num_parameters"] / 1e9
    q = info.get("quantization")
    if not q:
        return f"{need / 1e9:,.0f} GB in {dtype} ({params:,.1f}B parameters from its config)"
    return (f"{need / 1e9:,.0f} GB ({params:,.1f}B parameters from its config: {q['quantized_parameters'] / 1e9:,.1f}B "
            f"of them as {q['method']} stores them, {q['scheme']}, the rest in {dtype})")


def check_fits_devices(info: dict, hf_stages: dict[str, int], *, dtype: str = "auto",
                       device_bytes: int | None = None) -> None:
    """Refuse a target whose weights alone exceed what an HF stage loads it on ({rule: GPUs}, 0 =
    host memory); activations and KV cache need more still, so a pass is no promise, a refusal is
    sure. A quantized target whose bits are unknown is never refused (its size would be a guess)."""
    quantization = info.get("quantization")
    if not hf_stages or (quantization and quantization["quantized_bytes"] is None):
        return
    host = [rule for rule, n in hf_stages.items() if n == 0]
    if host:
        check_fits_host(info, host, dtype=dtype)
    on_gpus = {rule: n for rule, n in hf_stages.items() if n > 0}
    need = weight_bytes(info, dtype)
    seen = device_bytes or (device_memory_bytes() if on_gpus else None)
    capacity = seen or LARGEST_DEVICE_BYTES
    too_big = {rule: n for rule, n in on_gpus.items() if need > n * capacity}
    if not too_big:
        return
    devices = f"{capacity / 1e9:.0f} GB per GPU ({'this machine' if seen else 'the largest GPU made'})"
    raise TargetError(
        f"the target's weights take {_weights_phrase(info, 'bfloat16' if dtype == 'auto' else dtype)}; "
        + "; ".join(f"{rule} loads it with transformers on {n} GPU{'s' * (n > 1)}" for rule, n in too_big.items())
        + f", {devices}",
        where=", ".join(HF_STAGE_KEYS[r] for r in too_big),
        fix="; ".join(HF_STAGE_FIXES[r] for r in too_big))


def check_fits_host(info: dict, rules: list[str], *, dtype: str = "auto") -> None:
    """Refuse a run on the CPU whose HF stages (``rules``) cannot hold the target's weights in this
    machine's memory. Under SLURM those jobs run on other nodes, with the memory they ask for."""
    from draftsmith.placement import host_memory_bytes  # here: tests give the machine another memory

    if os.environ.get("SLURM_JOB_ID"):
        return
    # auto is float32 on the CPU for evaluation's loop, as engines.hf_model.model_dtype_name has it
    # (which imports this module, so it cannot be imported here); the batched stages may run bfloat16
    cpu_dtype = "float32" if dtype == "auto" else dtype
    need, have = weight_bytes(info, cpu_dtype), host_memory_bytes()
    if need <= have:
        return
    raise TargetError(
        f"the target's weights take {_weights_phrase(info, cpu_dtype)}; with device: cpu, {', '.join(rules)} "
        f"load{'s' * (len(rules) == 1)} it with transformers into this machine's memory, {have / 1e9:,.0f} GB",
        where="config keys device (cpu), " + ", ".join(HF_STAGE_KEYS[r] for r in rules),
        fix="run on GPUs (device: cuda) with " + ", ".join(f"{HF_STAGE_KEYS[r]}: vllm" for r in rules)
            + f", or on a machine with more than {need / 1e9:,.0f} GB of memory"
            + ("; target.dtype: bfloat16 halves the float32 that auto means on the CPU" if cpu_dtype == "float32" else ""))


def write_target_json(out_path: str | Path, model_path: str | Path, *, dtype: str = "auto",
                      hf_stages: dict[str, int] | None = None, **kwargs) -> dict:
    """Inspect the target, refuse it where an HF stage cannot hold it, and write target.json; a refused
    target's description goes to ``refused_path(out_path)`` instead, which the error names."""
    refused = refused_path(out_path)
    refused.unlink(missing_ok=True)  # it describes the last run's refusal, if this run refuses too
    info = inspect_target(model_path, **kwargs)
    info["weight_bytes"] = weight_bytes(info, dtype)
    log.info("target %s: %s, %d layers at %s, hidden %d, vocab %d, aux layers %s (+ final %d), %.1fB parameters, "
             "%s; weights %.1f GB on a GPU", info["model_path"], info["architecture"], info["num_hidden_layers"],
             info["layers_path"], info["hidden_size"], info["vocab_size"], info["aux_layer_ids"],
             info["final_layer_id"], info["num_parameters"] / 1e9, quantization_summary(info),
             info["weight_bytes"] / 1e9)
    if info["logit_transform"] != IDENTITY_LOGITS:
        log.info("target %s: its logits are %s; the draft is trained against the same", info["model_path"],
                 describe_logits(info["logit_transform"]))
    try:
        check_fits_devices(info, dict(hf_stages or {}), dtype=dtype)
    except TargetError as e:
        atomic_write_json(refused, {"refused": {"what": e.what, "where": e.where, "fix": e.fix}, **info})
        raise TargetError(f"{e.what}. What the preflight learned of the target (layers, quantization, weight "
                          f"bytes) is in {refused}", where=e.where, fix=e.fix) from None
    atomic_write_json(out_path, info)
    return info


def refused_path(out_path: str | Path) -> Path:
    """Where write_target_json describes a target it refused: beside target.json, not in it, since
    Snakemake deletes a failed job's outputs and a target.json must mean a target that passed."""
    out_path = Path(out_path)
    return out_path.with_name(f"{out_path.stem}.refused.json")


# How target.json is made again, wherever a stage finds it damaged or not Draftsmith's.
INSPECT_AGAIN = "rerun the inspect_target rule (snakemake --forcerun inspect_target --cores all, with the run's --configfile)"


def read_target_json(path: str | Path) -> dict:
    from draftsmith.io import read_json

    info = read_json(path, error=TargetError, fix=INSPECT_AGAIN)
    if info.get("format") != TARGET_FORMAT:
        raise TargetError(f"not a Draftsmith target description (format {info.get('format')!r})", where=str(path),
                          fix=INSPECT_AGAIN)
    return info
