"""The target's quantization, read from its config without its weights: the method, the bits, which
modules stay unquantized, and what the quantized weights weigh as stored.

A checkpoint says how it is quantized in ``quantization_config`` (``compression_config`` in older
compressed-tensors releases), at the top of config.json or in the text model's config (Kimi-K2.5
keeps it in ``text_config``; it then covers the text model alone, not a vision tower beside it).
Which parameters are quantized is decided on the model built on the meta device: the weights of
``nn.Linear`` modules and the stacked expert weights of fused MoE layers, minus the embeddings, the
output head and every module the config's ignore list names. Their bytes are counted from their
shapes (``quantized_bytes``); every other parameter keeps the dtype the target loads in.

The size is the weights as stored, scales included, within about 1%: the packing of sub-byte
values into int32 words, a GPTQ ``g_idx`` (one int32 per input channel) and per-module metadata
(compressed-tensors' ``weight_shape``) are left out, and a bitsandbytes 4-bit scale is counted as a
float32 per 64 values (double quantization stores less).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)

CONFIG_KEYS = ("quantization_config", "compression_config")
# Where checkpoints list what stays unquantized: compressed-tensors, transformers, vLLM, ModelOpt.
IGNORE_KEYS = ("ignore", "modules_to_not_convert", "llm_int8_skip_modules", "ignored_layers", "exclude_modules")
# Methods whose bits the method fixes and whose configs need not state them, beyond those
# read_schemes knows by name.
FIXED_BITS = {"bitnet": 2}


@dataclass(frozen=True)
class Scheme:
    """How one set of weights is stored: ``bits`` per value, and one scale of ``scale_bytes`` per
    ``scale_over`` ("tensor", "channel": an output row, "group": ``group`` values of a row, "block":
    a ``block`` of rows x columns), with a zero point of ``bits`` per scale where asymmetric."""

    bits: float
    scale_over: str = "channel"
    group: int = 0
    block: tuple[int, int] = (0, 0)
    scale_bytes: int = 2
    zero_point: bool = False
    targets: tuple[str, ...] = ("Linear",)

    def stored_bytes(self, shape: tuple[int, ...]) -> float:
        rows, cols = math.prod(shape[:-1]), shape[-1]
        if self.scale_over == "group":
            scales = rows * math.ceil(cols / self.group)
        elif self.scale_over == "block":
            scales = math.prod(shape[:-2]) * math.ceil(shape[-2] / self.block[0]) * math.ceil(cols / self.block[1])
        elif self.scale_over == "tensor":
            scales = 1
        else:
            scales = rows
        per_scale = self.scale_bytes + (self.bits / 8 if self.zero_point else 0)
        return rows * cols * self.bits / 8 + scales * per_scale

    def describe(self) -> str:
        over = {"group": f"per {self.group} values", "block": f"per {self.block[0]}x{self.block[1]} block",
                "channel": "per output channel", "tensor": "per tensor"}[self.scale_over]
        return f"{self.bits:g}-bit, scales {over}{', asymmetric' if self.zero_point else ''}"


def find_quantization(raw: dict, text_key: str | None) -> tuple[str, dict] | None:
    """The quantization config and where it was found (``quantization_config`` or
    ``<text_key>.quantization_config``), or None for an unquantized target."""
    for prefix, config in (("", raw), (f"{text_key}.", raw.get(text_key) if text_key else None)):
        for key in CONFIG_KEYS:
            if isinstance(config, dict) and isinstance(config.get(key), dict):
                return prefix + key, config[key]
    return None


def read_schemes(method: str, q: dict) -> list[Scheme] | None:
    """The weight schemes ``q`` declares, or None where its bits cannot be read (an unknown method
    that does not state them: reported as such, never guessed)."""
    if method in ("compressed-tensors", "compressed_tensors"):
        return _compressed_tensors(q)
    if method == "fp8":
        block = q.get("weight_block_size")
        # DeepSeek-V3 style: one float32 scale (scale_inv) per block; per tensor without blocks
        return [Scheme(8, "block", block=tuple(block), scale_bytes=4) if block else Scheme(8, "tensor", scale_bytes=4)]
    if method == "bitsandbytes":
        if q.get("load_in_4bit"):
            return [Scheme(4, "group", group=64, scale_bytes=4)]
        return [Scheme(8, "channel", scale_bytes=4)] if q.get("load_in_8bit") else None
    if method == "mxfp4":
        return [Scheme(4, "group", group=32, scale_bytes=1)]  # one e8m0 scale per 32 values
    if method.startswith("modelopt"):
        algo = str(q.get("quant_algo", "")).upper()
        if algo == "NVFP4":
            return [Scheme(4, "group", group=16, scale_bytes=1)]
        return [Scheme(8, "tensor", scale_bytes=4)] if algo.startswith("FP8") else None
    if method in ("fbgemm_fp8", "ptpc_fp8"):
        return [Scheme(8, "channel", scale_bytes=4)]
    bits = next((q[k] for k in ("bits", "w_bit", "weight_bits", "num_bits", "wbits") if q.get(k)), None)
    bits = bits or FIXED_BITS.get(method)
    if bits is None:
        return None
    group = q.get("group_size") or q.get("q_group_size") or -1
    # GPTQ stores zero points whether symmetric or not; AWQ where zero_point is on (its default)
    zero = method.startswith("gptq") or (method.startswith("awq") and q.get("zero_point", True))
    return [Scheme(float(bits), "group" if group > 0 else "channel", group=max(group, 0), zero_point=bool(zero))]


def _compressed_tensors(q: dict) -> list[Scheme] | None:
    schemes = []
    for group in (q.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not weights or not weights.get("num_bits"):
            continue  # a group that quantizes activations only leaves the weights as they are
        bits, strategy = weights["num_bits"], weights.get("strategy") or "tensor"
        # FP4 (NVFP4) keeps one FP8 scale per 16 values; other formats keep scales in the model dtype
        scale_bytes = 1 if (weights.get("type") == "float" and bits == 4) else 2
        if strategy in ("group", "tensor_group"):
            scheme = Scheme(bits, "group", group=weights.get("group_size") or 128, scale_bytes=scale_bytes)
        elif strategy == "block":
            scheme = Scheme(bits, "block", block=tuple(weights.get("block_structure") or (128, 128)),
                            scale_bytes=scale_bytes)
        else:
            scheme = Scheme(bits, strategy if strategy in ("channel", "tensor") else "channel", scale_bytes=scale_bytes)
        schemes.append(replace(scheme, zero_point=not weights.get("symmetric", True),
                               targets=tuple(group.get("targets") or ("Linear",))))
    return schemes or None


def name_matches(pattern: str, name: str) -> bool:
    """Whether an ignore or target entry names module ``name``: ``re:<regex>`` searched in the name
    (not matched from its start: the meta model may place the text model under another prefix than
    the checkpoint, model.language_model. for language_model.model.), otherwise a dotted name, with
    ``*`` for one component, that is a whole run of the name's components."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    run = re.escape(pattern).replace(r"\*", r"[^.]*")
    return re.search(rf"(^|\.){run}(\.|$)", name) is not None


def describe_quantization(model, raw: dict, text_key: str | None, text_prefix: str) -> dict | None:
    """target.json's ``quantization``: method, bits, what stays unquantized, and the count and
    stored bytes of the quantized parameters (``quantized_bytes`` None: the bits are unknown)."""
    found = find_quantization(raw, text_key)
    if found is None:
        return None
    where, q = found
    method = str(q.get("quant_method") or q.get("quant_algo") or "unknown").lower()
    schemes = read_schemes(method, q)
    ignore = [str(p) for key in IGNORE_KEYS for p in (q.get(key) or [])]
    scope = text_prefix if "." in where else ""  # a text model's quantization covers it alone
    info = {
        "method": method,
        "config_key": where,
        "bits": max(s.bits for s in schemes) if schemes else None,
        "scheme": "; ".join(dict.fromkeys(s.describe() for s in schemes)) if schemes else None,
        "format": q.get("format") or q.get("fmt"),
        "unquantized": list(dict.fromkeys(["embeddings", "lm_head", *ignore])) + ([f"everything outside {scope.rstrip('.')}"] if scope else []),
        "quantized_parameters": None,
        "quantized_bytes": None,
    }
    if schemes is None:
        log.warning("the target is quantized with %r (%s), whose weight bits Draftsmith cannot read: its size is "
                    "not known, so no memory check refuses it; target.json's weight_bytes counts it unquantized",
                    method, where)
        return info
    kept = {id(p) for p in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}
    count, stored = 0, 0.0
    for name, shape, kind in _weights(model, kept, scope):
        scheme = next((s for s in schemes if any(t == kind or name_matches(t, name) for t in s.targets)), None)
        if scheme is not None and not any(name_matches(p, name) for p in ignore):
            count += math.prod(shape)
            stored += scheme.stored_bytes(shape)
    info.update(quantized_parameters=count, quantized_bytes=round(stored))
    return info


def _weights(model, kept: set[int], scope: str):
    """(name, shape, kind) of every weight a quantization method may store quantized: Linear weights
    (kind "Linear") and fused expert stacks (3-D parameters of an experts module, kind "Linear": the
    checkpoint holds them as one Linear per expert)."""
    from torch import nn

    for module_name, module in model.named_modules():
        if not module_name.startswith(scope):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in kept:
                continue
            if isinstance(module, nn.Linear) and param_name == "weight":
                yield module_name, tuple(param.shape), "Linear"
            elif param.dim() == 3 and "experts" in module_name.rsplit(".", 1)[-1].lower():
                yield f"{module_name}.{param_name}", tuple(param.shape), "Linear"

