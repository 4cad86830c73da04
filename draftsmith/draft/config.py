"""What an EAGLE-3 draft is: its shape, its variant, and its ``config.json`` in the speculators format.

Variants (``draft.variant``), as speculators 0.9 (speculators/models/eagle3/config.py, core.py) and
vLLM's loader (vllm/model_executor/models/llama_eagle3.py, transformers_utils/configs/speculators/
algos.py) name them:

* ``eagle3``: fc over the concatenated captured states; each draft step feeds the next the last
  layer's output before the final norm (speculators' and vLLM's reading of EAGLE-3).
* ``eagle3.1``: the two changes of EAGLE 3.1 (arXiv 2605.09992, vLLM's 2026-05-26 post), as the
  config fields vLLM reads: ``fc_norm`` (an RMSNorm on each captured state before fc, so layers of
  very different scale contribute alike) and ``norm_output`` (the next draft step gets the state
  after the final norm, the one the lm_head reads, so its scale does not drift with depth).

``norm_before_fc`` (one RMSNorm over the concatenation, gpt-oss style, speculators' trainer default)
is read and written too, so drafts trained by speculators load here; it is no Draftsmith variant.
``fc_norm`` and ``norm_output`` are also written into ``transformer_layer_config``, where vLLM 0.24
reads them (``draftsmith.targets.vllm_compat.LAYER_CONFIG_FLAGS``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from draftsmith.errors import TrainingError
from draftsmith.targets.vllm_compat import LAYER_CONFIG_FLAGS

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format is written here
NORM_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
VARIANTS: dict[str, dict[str, bool]] = {
    "eagle3": {"norm_before_fc": False, "fc_norm": False, "norm_output": False},
    "eagle3.1": {"norm_before_fc": False, "fc_norm": True, "norm_output": True},
}


@dataclass
class Eagle3DraftConfig:
    """Shape and serving metadata of an EAGLE-3 draft (a Llama-style decoder over fused target states)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]  # HF hidden_states ids == vLLM eagle_aux_hidden_state_layer_ids (module docstring)
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    norm_before_residual: bool = True
    initializer_range: float = 0.02
    pad_token_id: int | None = None
    verifier_name_or_path: str | None = None
    verifier_architectures: list[str] = field(default_factory=list)
    speculative_tokens: int = 3
    norm_before_fc: bool = False  # one RMSNorm over the concatenated captured states
    fc_norm: bool = False  # an RMSNorm on each captured state (EAGLE 3.1)
    norm_output: bool = False  # the next draft step gets the post-norm state (EAGLE 3.1)

    def __post_init__(self) -> None:
        if list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)):
            raise TrainingError(f"aux layer ids must be distinct and ascending, got {self.aux_layer_ids}",
                                where="target.json aux_layer_ids",
                                fix="vLLM concatenates aux states in ascending layer order; list them so")
        if self.num_attention_heads % self.num_key_value_heads:
            raise TrainingError(f"{self.num_attention_heads} attention heads are not a multiple of "
                                f"{self.num_key_value_heads} key/value heads", where="draft config")
        if self.norm_before_fc and self.fc_norm:
            raise TrainingError("norm_before_fc and fc_norm are both set", where="draft config",
                                fix="normalise the captured states once: one of them (speculators refuses both)")

    @property
    def variant(self) -> str | None:
        """``eagle3`` or ``eagle3.1`` when the norm flags are one of Draftsmith's variants, else None."""
        flags = {k: getattr(self, k) for k in NORM_FLAGS}
        return next((name for name, want in VARIANTS.items() if want == flags), None)

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @classmethod
    def from_target(cls, target: dict, *, draft_vocab_size: int, num_layers: int = 1, variant: str = "eagle3",
                    norm_before_residual: bool = True, speculative_tokens: int = 3,
                    aux_layer_ids: Sequence[int] | None = None) -> Eagle3DraftConfig:
        """A draft shaped after the target's text model (``target.json`` as a dict).

        Llama/Qwen-like targets lend their attention layout; targets without one (MLA, as in
        DeepSeek-V3 / Kimi-K2) get 128-dim heads, hidden/128 of them, and 8 key/value heads, the
        layout public EAGLE-3 drafts for those targets use. RoPE scaling is kept only for Llama
        targets, whose scaling vLLM's Llama draft implements identically. ``variant`` is a key of
        ``VARIANTS``.
        """
        if variant not in VARIANTS:
            raise TrainingError(f"unknown draft variant {variant!r}", where="config key draft.variant",
                                fix="set draft.variant to one of " + ", ".join(map(repr, VARIANTS)))
        tc = target.get("text_config", {})
        hidden = int(target["hidden_size"])
        heads = tc.get("num_attention_heads") or max(hidden // 128, 1)
        head_dim = tc.get("head_dim") or hidden // heads
        kv_heads = tc.get("num_key_value_heads") or heads
        if "kv_lora_rank" in tc or heads * head_dim < hidden // 2:
            head_dim = 128 if hidden % 128 == 0 else hidden // max(hidden // 128, 1)
            heads = hidden // head_dim
            kv_heads = 8 if heads % 8 == 0 else heads
        rope = _draft_rope_parameters(tc)
        architectures = [target["architecture"]] if target.get("architecture") else []
        return cls(
            hidden_size=hidden, num_attention_heads=int(heads), num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim), intermediate_size=int(tc.get("intermediate_size") or 4 * hidden),
            target_vocab_size=int(target["vocab_size"]), draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=list(aux_layer_ids if aux_layer_ids is not None else target["aux_layer_ids"]),
            num_layers=num_layers, rms_norm_eps=float(tc.get("rms_norm_eps") or 1e-6),
            # SiLU whatever the target's activation (gelu for GPT-2, gelu_pytorch_tanh for Gemma): the
            # draft is its own Llama-style model, and vLLM's EAGLE-3 Llama draft runs SiLU only (LlamaMLP)
            hidden_act="silu",
            max_position_embeddings=int(tc.get("max_position_embeddings") or 4096),
            rope_parameters=rope, norm_before_residual=norm_before_residual,
            initializer_range=float(tc.get("initializer_range") or 0.02),
            pad_token_id=tc.get("pad_token_id"), verifier_name_or_path=target.get("model_path"),
            verifier_architectures=architectures, speculative_tokens=speculative_tokens, **VARIANTS[variant],
        )

    def transformer_layer_config(self) -> dict[str, Any]:
        """The ``transformer_layer_config`` dict: a LlamaConfig (as speculators serialises it).

        ``num_aux_hidden_states`` rides along because vLLM's llama_eagle3.py reads the fc input
        width from it and otherwise assumes 3 aux layers; ``fc_norm`` and ``norm_output`` for vLLM
        releases that read them only there (``vllm_compat.LAYER_CONFIG_FLAGS``).
        """
        from transformers import LlamaConfig

        config = LlamaConfig(
            vocab_size=self.target_vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters), initializer_range=self.initializer_range,
            attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
            pad_token_id=self.pad_token_id, bos_token_id=None, eos_token_id=None,
        )
        config.architectures = ["LlamaForCausalLM"]
        out = config.to_diff_dict()
        out.pop("transformers_version", None)
        out["num_aux_hidden_states"] = self.num_aux
        out.update({flag: getattr(self, flag) for flag in LAYER_CONFIG_FLAGS})
        return out

    def llama_config(self):
        from transformers import LlamaConfig

        kwargs = {k: v for k, v in self.transformer_layer_config().items()
                  if k not in ("model_type", "architectures", "num_aux_hidden_states", *LAYER_CONFIG_FLAGS)}
        return LlamaConfig(**kwargs)

    def to_speculators(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """config.json as speculators 0.9's ``Eagle3SpeculatorConfig`` writes it."""
        return {
            "architectures": ["Eagle3DraftModel"],
            "auto_map": {"": "config.Eagle3SpeculatorConfig"},
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{
                    "proposal_type": "greedy", "speculative_tokens": self.speculative_tokens,
                    "verifier_accept_k": 1, "accept_tolerance": 0.0,
                }],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": self.verifier_name_or_path,
                             "architectures": list(self.verifier_architectures)},
            },
            "transformer_layer_config": self.transformer_layer_config(),
            "draft_vocab_size": self.draft_vocab_size,
            # vLLM defaults a missing norm_before_residual to True, speculators' config class to
            # False: always write it.
            "norm_before_residual": self.norm_before_residual,
            **{flag: getattr(self, flag) for flag in NORM_FLAGS},
            "embed_requires_grad": False,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "tie_word_embeddings": False,
            "dtype": dtype,
        }

    @classmethod
    def from_speculators(cls, config: dict[str, Any]) -> Eagle3DraftConfig:
        if config.get("speculators_model_type") != "eagle3":
            raise TrainingError(f"not an EAGLE-3 speculators config (speculators_model_type "
                                f"{config.get('speculators_model_type')!r})", where="config.json")
        tl = config["transformer_layer_config"]
        if tl.get("model_type", "llama") != "llama":
            raise TrainingError(f"only Llama-style draft layers are supported, got {tl.get('model_type')!r}",
                                where="config.json transformer_layer_config.model_type")
        rope = tl.get("rope_parameters") or {"rope_type": "default", "rope_theta": tl.get("rope_theta", 10000.0)}
        spec = config.get("speculators_config") or {}
        verifier = spec.get("verifier") or {}
        methods = spec.get("proposal_methods") or [{}]
        heads = tl["num_attention_heads"]
        aux = config.get("eagle_aux_hidden_state_layer_ids") or []
        return cls(
            hidden_size=tl["hidden_size"], num_attention_heads=heads,
            num_key_value_heads=tl.get("num_key_value_heads") or heads,
            head_dim=tl.get("head_dim") or tl["hidden_size"] // heads,
            intermediate_size=tl["intermediate_size"], target_vocab_size=tl["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size") or tl["vocab_size"],
            aux_layer_ids=list(aux), num_layers=tl.get("num_hidden_layers", 1),
            rms_norm_eps=tl.get("rms_norm_eps", 1e-6), hidden_act=tl.get("hidden_act", "silu"),
            max_position_embeddings=tl.get("max_position_embeddings", 4096), rope_parameters=dict(rope),
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            initializer_range=tl.get("initializer_range", 0.02), pad_token_id=tl.get("pad_token_id"),
            verifier_name_or_path=verifier.get("name_or_path"),
            verifier_architectures=list(verifier.get("architectures") or []),
            speculative_tokens=methods[0].get("speculative_tokens", 3),
            **{flag: bool(config.get(flag, False)) for flag in NORM_FLAGS},
        )


def _draft_rope_parameters(text_config: dict) -> dict[str, Any]:
    params = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
    if isinstance(params, dict) and isinstance(next(iter(params.values()), None), dict):
        params = params.get("full_attention") or next(iter(params.values()))  # per-layer-type RoPE
    theta = (params.get("rope_theta") if isinstance(params, dict) else None) or text_config.get("rope_theta") or 10000.0
    rope_type = (params.get("rope_type") or params.get("type") or "default") if isinstance(params, dict) else "default"
    if text_config.get("model_type") == "llama" and rope_type in ("llama3", "linear", "dynamic"):
        return {**params, "rope_type": rope_type, "rope_theta": float(theta)}
    return {"rope_type": "default", "rope_theta": float(theta)}
