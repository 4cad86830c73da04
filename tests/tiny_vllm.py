"""More tiny random-init targets, shaped for what vLLM's CPU build runs: MoE and MLA families and
another multimodal wrapper, saved as real Hugging Face folders (same tokenizer as ``tiny.py``).

CPU-build limits they respect: attention head_dim is one of 32/64/.../512; MLA needs the DeepSeek
latent size kv_lora_rank + qk_rope_head_dim = 512 + 64 (the only size its CPU kernel compiles).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Olmo2Config,
    Olmo2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tiny import _spread_weights, build_tokenizer, llama_config


def _save(model: torch.nn.Module, path: Path, spread: bool = True) -> Path:
    model.eval()
    if spread:
        _spread_weights(model)
    model.save_pretrained(path)
    return path


def build_qwen3_moe(path: str | Path, seed: int = 0, **overrides) -> Path:
    """Qwen3-MoE: q/k norms, 4 experts (top-2) in layers 1..3, a dense MLP in layer 0."""
    path = Path(path)
    build_tokenizer(path)
    kwargs = dict(vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                  norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return _save(Qwen3MoeForCausalLM(Qwen3MoeConfig(**kwargs)), path)


def build_olmo2(path: str | Path, seed: int = 0) -> Path:
    """OLMo 2: one of the families vLLM runs through its Transformers backend (``TransformersForCausalLM``,
    which hands the decoder layers a batch of one: ``[1, tokens, hidden]``), with no logit transform."""
    path = Path(path)
    build_tokenizer(path)
    torch.manual_seed(seed)
    return _save(Olmo2ForCausalLM(Olmo2Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)), path)


def build_deepseek_v3(path: str | Path, seed: int = 0, **overrides) -> Path:
    """DeepSeek-V3: MLA attention (latent 512 + rope 64), one dense layer, then routed + shared experts."""
    path = Path(path)
    build_tokenizer(path)
    kwargs = dict(vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                  kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                  first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  num_nextn_predict_layers=0, max_position_embeddings=512, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0,
                  # what DeepSeek-V3's own config.json says and transformers' class assumes; vLLM reads
                  # these keys (without them it builds a softmax router with no correction bias)
                  topk_method="noaux_tc", scoring_func="sigmoid")
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**kwargs))
    model.eval()
    _spread_weights(model)
    with torch.no_grad():  # latent projections are wide (512): keep their outputs at the scale of the rest
        for name, p in model.named_parameters():
            if "kv_b_proj" in name or "kv_a_proj" in name:
                p.mul_(0.25)
    model.save_pretrained(path)
    return path


def build_deepseek_v3_for_platform(path: str | Path, **overrides) -> Path:
    """DeepSeek-V3's own head sizes on CUDA (128 + 64 rope, v 128): the FlashAttention MLA prefill
    kernels take those; the CPU build's MLA takes the smaller ones too."""
    sizes = {"qk_nope_head_dim": 128, "v_head_dim": 128} if ON_CUDA else {}
    return build_deepseek_v3(path, **{**sizes, **overrides})


def build_idefics3(path: str | Path, seed: int = 0, vision_heads: int = 1, **text_overrides) -> Path:
    """A second multimodal wrapper (Idefics3: SigLIP-style vision + Llama text model at model.text_model).
    ``vision_heads``: vLLM builds the vision tower even for text-only use, split over TP ranks."""
    path = Path(path)
    build_tokenizer(path)
    text = llama_config(**text_overrides)
    config = Idefics3Config(
        text_config=text.to_dict(),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=vision_heads,
                           image_size=28, patch_size=14),
        image_token_id=text.vocab_size - 1, scale_factor=1, tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(seed)
    return _save(Idefics3ForConditionalGeneration(config), path)


# -- how the vLLM tests run here and on a CUDA machine (pytest -m gpu there) ----------------------

HAS_VLLM = importlib.util.find_spec("vllm") is not None
ON_CUDA = torch.cuda.is_available()
# On a GPU several engines of one test module share the device: each takes a small slice of it.
ENGINE_ARGS = {"gpu_memory_utilization": 0.2} if ON_CUDA else {}
# The capture parity tests run the dtype a deployment runs: float32 on the CPU build (exact
# comparisons), bfloat16 on CUDA (FlashAttention and MLA kernels take no float32).
CAPTURE_DTYPE = "bfloat16" if ON_CUDA else "float32"


def vllm_test(fn):
    """Marks a test that starts vLLM: ``-m "not vllm"`` deselects them, ``-m gpu`` picks them (with
    the training tests) on a CUDA machine; skipped without vLLM."""
    for mark in (pytest.mark.vllm, pytest.mark.gpu, pytest.mark.slow,
                 pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")):
        fn = mark(fn)
    return fn


def per_request_records() -> bool:
    """Whether the installed vLLM returns each output's own record of its verification steps."""
    from draftsmith.targets.vllm_compat import has_engine_arg

    return has_engine_arg("per_request_spec_decode_metrics")
