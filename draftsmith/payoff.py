"""Stage estimate_payoff: will speculation make decoding faster on the user's server?

A roofline cost model of one decode step (docs/payoff.md has the formulas and their limits): the
target reads its weights once per step, for a mixture-of-experts target only the experts the step's
tokens route to, and its KV cache; it computes 2 FLOPs per active parameter and token; each layer
all-reduces twice over tensor parallelism. Verifying k draft tokens multiplies the tokens of a step
by up to k + 1, which for a MoE target at a batch of many sequences activates many more experts:
speculation that accepts little can then be slower than plain decoding. The speedup is

    τ(k) · t_target(B, 1) / (t_target(B, 1 + Σ_j p_j) + k · t_draft(B))

with τ(k) and the proposal rates p_j from the measured acceptance by position (acceptance.json).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from draftsmith.errors import EvaluationError
from draftsmith.io import atomic_write_json, read_json
from draftsmith.settings import StageSettings, check_settings, config_value, from_schema

log = logging.getLogger(__name__)

PAYOFF_FORMAT = "draftsmith.payoff/1"
# Peak rates per GPU from NVIDIA's SXM data sheets: HBM GB/s, dense bf16 TFLOP/s, NVLink GB/s per
# direction. Kernels reach a share of them (eval.payoff.efficiency).
GPUS = {
    "h100": {"memory_bandwidth_gbs": 3350.0, "tflops": 989.0, "interconnect_gbs": 450.0},
    "h200": {"memory_bandwidth_gbs": 4800.0, "tflops": 989.0, "interconnect_gbs": 450.0},
}
ACTIVATION_BYTES = 2  # bf16 activations in the all-reduces
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}  # auto serves in bf16 on GPUs


@dataclass(frozen=True)
class PayoffSettings(StageSettings):
    """The eval.payoff section: the serving setup; defaults and ranges from the schema."""

    gpu: str = from_schema("eval.payoff.gpu")
    memory_bandwidth_gbs: float | None = from_schema("eval.payoff.memory_bandwidth_gbs")
    tflops: float | None = from_schema("eval.payoff.tflops")
    interconnect_gbs: float | None = from_schema("eval.payoff.interconnect_gbs")
    efficiency: float = from_schema("eval.payoff.efficiency")
    tensor_parallel_size: int | None = from_schema("eval.payoff.tensor_parallel_size")
    weight_bytes: float | None = from_schema("eval.payoff.weight_bytes")
    expert_weight_bytes: float | None = from_schema("eval.payoff.expert_weight_bytes")
    context_tokens: int = from_schema("eval.payoff.context_tokens")
    batch_sizes: tuple[int, ...] = from_schema("eval.payoff.batch_sizes")
    k: tuple[int, ...] = from_schema("eval.payoff.k")
    forward_overhead_us: float = from_schema("eval.payoff.forward_overhead_us")
    allreduce_latency_us: float = from_schema("eval.payoff.allreduce_latency_us")

    SECTION = "eval.payoff"
    ALSO_READS = ("extraction.tensor_parallel_size", "target.dtype")

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "k"):
            object.__setattr__(self, name, tuple(sorted(set(getattr(self, name)))))
        check_settings(self)

    @classmethod
    def from_config(cls, config: Mapping) -> PayoffSettings:
        """eval.payoff with its nulls filled in: the target is served as this run ran it (extraction's
        tensor parallel size, target.dtype)."""
        return super().from_config(config).resolved(config_value(config, "extraction.tensor_parallel_size"),
                                                    config_value(config, "target.dtype"))

    def resolved(self, tensor_parallel_size: int = 1, dtype: str = "auto") -> PayoffSettings:
        """Every null filled in: the GPU's rates, the run's tensor parallel size and dtype."""
        rates = {key: getattr(self, key) or value for key, value in GPUS[self.gpu].items()}
        weight_bytes = self.weight_bytes or DTYPE_BYTES[dtype]
        return replace(self, **rates, tensor_parallel_size=self.tensor_parallel_size or tensor_parallel_size,
                       weight_bytes=weight_bytes, expert_weight_bytes=self.expert_weight_bytes or weight_bytes)


@dataclass(frozen=True)
class TargetShape:
    """What the cost model needs of the target, from its (text) config: parameters read every
    step, per routed expert, per token's attention, and the KV cache's bytes per token and layer."""

    layers: int
    hidden: int
    heads: int
    always_params: int  # attention, dense MLPs, shared experts, routers, lm_head: read every step
    expert_params: int  # one routed expert of one layer
    moe_layers: int
    experts: int  # routed experts per MoE layer (0: dense)
    top_k: int
    kv_values_per_token: int  # per layer; MLA: the latent, the same on every TP rank
    kv_shards: int  # how many ways the KV cache splits over TP at most (KV heads; 1 for MLA)
    attention_flops_per_context_token: int  # per query token and layer

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def active_params(self) -> int:
        return self.always_params + self.moe_layers * self.top_k * self.expert_params

    @property
    def total_params(self) -> int:
        return self.always_params + self.moe_layers * self.experts * self.expert_params


@dataclass(frozen=True)
class DraftShape:
    """The draft's cost per forward: parameters read (its embedding excluded: a lookup), decoder
    layers, and KV values per token and layer."""

    params: int
    layers: int
    kv_values_per_token: int
    kv_shards: int


def target_shape(config: dict) -> TargetShape:
    """The cost-model shape of a Hugging Face text config (dense, Mixtral/Qwen-MoE, DeepSeek-V3/MLA)."""
    try:
        hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
        heads = config["num_attention_heads"]
    except KeyError as e:
        raise EvaluationError(f"the target's config has no {e.args[0]}", where="target.json text_config",
                              fix="rerun inspect_target on a Hugging Face decoder config") from None
    if config.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3, Kimi): a compressed latent replaces K and V
        rope, nope, v = config["qk_rope_head_dim"], config["qk_nope_head_dim"], config["v_head_dim"]
        latent = config["kv_lora_rank"]
        q = (hidden * config["q_lora_rank"] + config["q_lora_rank"] * heads * (nope + rope)
             if config.get("q_lora_rank") else hidden * heads * (nope + rope))
        attention = q + hidden * (latent + rope) + latent * heads * (nope + v) + heads * v * hidden
        kv_values, kv_shards = latent + rope, 1
        attention_flops = 2 * heads * (2 * latent + rope)  # scores and values against the latent
    else:
        head_dim = config.get("head_dim") or hidden // heads
        kv_heads = config.get("num_key_value_heads") or heads
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        kv_values, kv_shards = 2 * kv_heads * head_dim, kv_heads
        attention_flops = 4 * heads * head_dim
    experts = config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts") or 0
    dense_mlp = 3 * hidden * config.get("intermediate_size", 4 * hidden)
    lm_head = hidden * vocab
    if not experts:
        return TargetShape(layers, hidden, heads, layers * (attention + dense_mlp) + lm_head, 0, 0, 0, 0,
                           kv_values, kv_shards, attention_flops)
    expert = 3 * hidden * (config.get("moe_intermediate_size") or config["intermediate_size"])
    dense_layers = set(range(config.get("first_k_dense_replace") or 0)) | set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step") or 1
    moe_layers = sum(1 for i in range(layers) if i not in dense_layers and (i + 1) % step == 0)
    shared = (config.get("n_shared_experts") or 0) * expert
    if config.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one shared expert of its own width
        shared = 3 * hidden * config["shared_expert_intermediate_size"]
    always = (layers * attention + (layers - moe_layers) * dense_mlp + moe_layers * (shared + hidden * experts)
              + lm_head)
    return TargetShape(layers, hidden, heads, always, expert, moe_layers, experts, config["num_experts_per_tok"],
                       kv_values, kv_shards, attention_flops)


def draft_shape(draft_dir: str | Path) -> DraftShape:
    """The draft's shape from its speculators config.json and its checkpoint's tensor sizes."""
    from safetensors import safe_open

    draft_dir = Path(draft_dir)
    layer = read_json(draft_dir / "config.json").get("transformer_layer_config") or {}
    params, layers = 0, set()
    with safe_open(draft_dir / "model.safetensors", "pt") as f:
        for name in f.keys():
            if "embed_tokens" in name or name in ("d2t", "t2d"):
                continue
            params += math.prod(f.get_slice(name).get_shape())
            parts = name.split(".")
            if "layers" in parts:
                layers.add(parts[parts.index("layers") + 1])
    heads = layer.get("num_attention_heads") or 1
    kv_heads = layer.get("num_key_value_heads") or heads
    head_dim = layer.get("head_dim") or layer.get("hidden_size", 0) // heads
    return DraftShape(params, max(1, len(layers)), 2 * kv_heads * head_dim, kv_heads)


def expected_experts(experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts ``tokens`` tokens route to, each to ``top_k`` of ``experts`` chosen
    uniformly: E·(1 - (1 - top_k/E)^n)."""
    return experts * (1 - (1 - top_k / experts) ** tokens) if experts else 0.0


def target_step_seconds(shape: TargetShape, server: PayoffSettings, batch: int, tokens_per_seq: float) -> float:
    """One forward of the target over ``batch`` sequences of ``tokens_per_seq`` new tokens each
    (1 for plain decoding, 1 + proposals when verifying), on one GPU of the TP group."""
    tp = server.tensor_parallel_size
    tokens = batch * tokens_per_seq
    experts = expected_experts(shape.experts, shape.top_k, tokens)
    weights = (shape.always_params * server.weight_bytes
               + shape.moe_layers * experts * shape.expert_params * server.expert_weight_bytes) / tp
    # Attention reads each sequence's KV cache once per step, however many query tokens it has.
    kv = (batch * server.context_tokens * shape.layers * shape.kv_values_per_token * server.weight_bytes
          / min(tp, shape.kv_shards))
    flops = tokens * (2 * shape.active_params + shape.layers * server.context_tokens
                      * shape.attention_flops_per_context_token) / tp
    compute = _roofline(weights + kv, flops, server)
    return compute + _allreduces(2 * shape.layers, tokens * shape.hidden, server) + server.forward_overhead_us * 1e-6


def draft_step_seconds(draft: DraftShape, hidden: int, server: PayoffSettings, batch: int) -> float:
    """One forward of an EAGLE-3 draft (one token per sequence), at the target's TP as vLLM runs it."""
    tp = server.tensor_parallel_size
    weights = draft.params * server.weight_bytes / tp
    kv = (batch * server.context_tokens * draft.layers * draft.kv_values_per_token * server.weight_bytes
          / min(tp, draft.kv_shards))
    compute = _roofline(weights + kv, batch * 2 * draft.params / tp, server)
    return compute + _allreduces(2 * draft.layers, batch * hidden, server) + server.forward_overhead_us * 1e-6


def _roofline(bytes_read: float, flops: float, server: PayoffSettings) -> float:
    """A memory-bound or compute-bound kernel's time, whichever bound binds."""
    return max(bytes_read / (server.memory_bandwidth_gbs * 1e9 * server.efficiency),
               flops / (server.tflops * 1e12 * server.efficiency))


def _allreduces(count: int, values: float, server: PayoffSettings) -> float:
    """``count`` ring all-reduces of ``values`` activations each over the TP group (none at TP 1)."""
    tp = server.tensor_parallel_size
    if tp == 1:
        return 0.0
    per = 2 * (tp - 1) / tp * values * ACTIVATION_BYTES / (server.interconnect_gbs * 1e9 * server.efficiency)
    return count * (per + server.allreduce_latency_us * 1e-6)


def extend_rates(rates: Sequence[float | None], k: int) -> list[float]:
    """Rates by draft position 1..k from the measured positions: beyond them, each position keeps
    the last measured position's share of the one before (a geometric tail)."""
    rates = [r or 0.0 for r in rates]
    if not rates:
        raise EvaluationError("acceptance.json holds no acceptance by position", where="acceptance.json",
                              fix="rerun evaluate_draft")
    ratio = rates[-1] / rates[-2] if len(rates) > 1 and rates[-2] > 0 else rates[-1]
    while len(rates) < k:
        rates.append(rates[-1] * min(ratio, 1.0))
    return rates[:k]


def speedups(shape: TargetShape, draft: DraftShape | None, acceptance: Sequence[float | None],
             proposals: Sequence[float | None] | None, server: PayoffSettings) -> dict:
    """Expected decode speedup over plain decoding for each k of ``server.k`` and batch of
    ``server.batch_sizes``; ``draft`` None is a drafter without GPU cost (n-gram lookup).
    ``proposals`` (share of steps proposing position j) default to every position proposed. A k
    beyond the measured positions rests on extrapolated rates (``acceptance_at_k``, each best's
    ``acceptance``)."""
    if acceptance and all(rate is None for rate in acceptance):  # evaluation decoded no step to measure
        return {"acceptance_rate_by_position": list(acceptance), "measured_positions": 0, "tau": None,
                "speedup": None, "verify_step_ms": None, "best": None,
                "not_measured": "evaluation measured no verification step (every generation ended at its "
                                "first token: eval.max_new_tokens, or the target stopped at once)"}
    top = max(server.k)
    measured = len(acceptance)
    accepted = extend_rates(acceptance, top)
    proposed = extend_rates(proposals, top) if proposals else [1.0] * top
    plain = [target_step_seconds(shape, server, b, 1) for b in server.batch_sizes]
    out = {"acceptance_rate_by_position": accepted, "proposal_rate_by_position": proposed,
           "measured_positions": measured,
           "acceptance_at_k": ["measured" if k <= measured else "extrapolated" for k in server.k],
           "tau": [], "speedup": [], "verify_step_ms": []}
    for k in server.k:
        tau = 1 + sum(accepted[:k])
        verified = 1 + sum(proposed[:k])
        steps = [target_step_seconds(shape, server, b, verified)
                 + (k * draft_step_seconds(draft, shape.hidden, server, b) if draft else 0.0)
                 for b in server.batch_sizes]
        out["tau"].append(tau)
        out["speedup"].append([tau * p / s for p, s in zip(plain, steps)])
        out["verify_step_ms"].append([s * 1e3 for s in steps])
    best = [max(range(len(server.k)), key=lambda i: out["speedup"][i][j]) for j in range(len(server.batch_sizes))]
    out["best"] = [{"batch": b, "k": server.k[i], "speedup": out["speedup"][i][j],
                    "acceptance": out["acceptance_at_k"][i]}
                   for j, (b, i) in enumerate(zip(server.batch_sizes, best))]
    return out


def measured_range(positions: int) -> str:
    """The measured draft positions as a reader sees them: k=1, k=1..3."""
    return "k=1" if positions == 1 else f"k=1..{positions}"


def best_line(drafter: dict) -> str:
    """The best k and its speedup at each batch, a k past the measured positions marked extrapolated."""
    if drafter["best"] is None:
        return "not estimated: " + drafter["not_measured"]
    measured = measured_range(drafter["measured_positions"])
    return ", ".join(f"B={b['batch']}: k={b['k']}"
                     + (f" (extrapolated beyond the measured {measured})" if b["acceptance"] == "extrapolated" else "")
                     + f" {b['speedup']:.2f}x" for b in drafter["best"])


def estimate_payoff(acceptance_json: str | Path, target_json: str | Path, draft_dir: str | Path,
                    out_path: str | Path, settings: PayoffSettings) -> dict:
    """Write payoff.json: the speedup the measured acceptance of the draft and of the n-gram baseline
    (acceptance.json) would give on the server of ``settings`` (eval.payoff); ``plots.plot_payoff``
    draws it. Nulls ``from_config`` has not filled in are one GPU's serving in bf16."""
    from draftsmith.draft.speculators_format import check_draft_folder
    from draftsmith.targets.inspect import INSPECT_AGAIN

    server = settings.resolved()
    target = read_json(target_json, error=EvaluationError, fix=INSPECT_AGAIN)
    shape = target_shape(target.get("text_config") or {})
    check_draft_folder(draft_dir, EvaluationError)
    draft = draft_shape(draft_dir)
    acceptance = read_json(acceptance_json)
    plain = [target_step_seconds(shape, server, b, 1) for b in server.batch_sizes]
    result = {
        "format": PAYOFF_FORMAT,
        "model": "docs/payoff.md",
        "server": asdict(server),
        "target": {"kind": "moe" if shape.is_moe else "dense", **asdict(shape), "active_params": shape.active_params,
                   "total_params": shape.total_params},
        "draft_shape": asdict(draft),
        "batch_sizes": list(server.batch_sizes),
        "k": list(server.k),
        "plain_step_ms": [s * 1e3 for s in plain],
        "experts_per_layer": {"plain": [expected_experts(shape.experts, shape.top_k, b) for b in server.batch_sizes]},
        "draft": speedups(shape, draft, acceptance["acceptance_rate_by_position"],
                          acceptance.get("proposal_rate_by_position"), server),
        "baseline": speedups(shape, None, acceptance["baseline"]["acceptance_rate_by_position"],
                             acceptance["baseline"].get("proposal_rate_by_position"), server),
        "sources": {name: speedups(shape, draft, found["acceptance_rate_by_position"],
                                   found.get("proposal_rate_by_position"), server)
                    for name, found in (acceptance.get("sources") or {}).items()},
        "measured_at_k": len(acceptance["acceptance_rate_by_position"]),
    }
    atomic_write_json(out_path, result)
    for name in ("draft", "baseline"):
        log.info("%s: best k and expected speedup by batch: %s", name, best_line(result[name]))
    return result
