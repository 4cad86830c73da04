"""What a target does to its logits after its lm_head, so that training's teacher (the final state
times the lm_head's rows) is the distribution the target decodes from.

Most families' causal-LM heads return ``lm_head(final_state)`` as it is. A few scale the logits or
cap them with a tanh; the table below holds one rule per ``model_type``, read from each family's
modeling code in transformers (vLLM applies the same settings in each model's
``LogitsProcessor(scale=..., soft_cap=...)``). The same config key means different things in
different families (Granite divides by ``logits_scaling``, HyperCLOVA X multiplies by it), so
the rule goes by family, not by key. tests/test_target_logits.py holds the table against the
installed transformers' modeling code (each family whose head's logits are scaled or capped has a
rule). A family outside the table that transforms its logits anyway is caught where its real
logits are at hand: the HF capture backend compares them with
the teacher's formula on its first batch (``extract.hf_backend.check_teacher_logits``).
"""

from __future__ import annotations

from collections.abc import Callable

IDENTITY = {"scale": 1.0, "softcap": None}


def _times(key: str) -> Callable[[dict], dict]:
    # a null scale is none (Cohere Compass: "logit_scale if not None else 1.0")
    return lambda config: {"scale": 1.0 if config[key] is None else float(config[key]), "softcap": None}


def _divided_by(key: str) -> Callable[[dict], dict]:
    return lambda config: {"scale": 1.0 / float(config[key]), "softcap": None}


def _softcap(key: str = "final_logit_softcapping", times: str | None = None) -> Callable[[dict], dict]:
    """A tanh cap of ``config[key]`` (none when null), after a scale of ``config[times]``."""
    def rule(config: dict) -> dict:
        cap = config.get(key)
        return {"scale": float(config[times]) if times else 1.0, "softcap": float(cap) if cap else None}
    return rule


RULES: dict[str, Callable[[dict], dict]] = {
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared",
                     "granitemoehybrid", "granite4_vision_text"), _divided_by("logits_scaling")),
    "minicpm3": _divided_by("logits_scaling"),  # the final state divided before the (bias-free) head
    "hyperclovax": _times("logits_scaling"),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"), _times("logit_scale")),
    "falcon_h1": _times("lm_head_multiplier"),
    **dict.fromkeys(("gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "vaultgemma",
                     "nanochat"), _softcap()),
    "recurrent_gemma": _softcap("logits_soft_cap"),
    "muse_glimmer_text": _softcap(times="output_multiplier"),
}


def logit_transform(text_model_type: str, text_config: dict) -> dict:
    """{"scale": s, "softcap": c or None}: the target's logits are softcap(s * lm_head(final))."""
    rule = RULES.get(text_model_type)
    return rule(text_config) if rule else dict(IDENTITY)


def apply_logit_transform(logits, transform: dict | None):
    """``logits`` (a tensor) as the target returns them: scaled, then capped (c * tanh(z / c))."""
    if not transform:
        return logits
    if transform["scale"] != 1.0:
        logits = logits * transform["scale"]
    if transform["softcap"]:
        logits = (logits / transform["softcap"]).tanh() * transform["softcap"]
    return logits


def describe(transform: dict | None) -> str:
    """The transform as a formula over ``lm_head(final state)``, for logs and errors."""
    text = "lm_head(final state)"
    if not transform:
        return text
    if transform["scale"] != 1.0:
        text = f"{transform['scale']:g} x {text}"
    if transform["softcap"]:
        text = f"{transform['softcap']:g} tanh({text} / {transform['softcap']:g})"
    return text
