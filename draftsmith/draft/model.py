"""The EAGLE-3 draft model: the modules, the step shared by training and inference, incremental drafting.

The module layout and weight names are speculators 0.9's ``Eagle3DraftModel``
(speculators/models/eagle3/core.py, model_definitions.py), which are also the names vLLM's
``llama_eagle3.py`` loads::

    embed_tokens.weight            [V, H]   the target's token embeddings, frozen
    input_norm.weight              [A*H]    norm_before_fc only: one RMSNorm over the concatenation
    fc_norm.{a}.weight             [H]      fc_norm only (EAGLE 3.1): an RMSNorm per captured state
    fc.weight                      [H, A*H] fuses the A captured target states
    layers.0.input_layernorm       on the token embedding
    layers.0.hidden_norm           on the fused (step 0) or fed-back (later steps) hidden state
    layers.0.self_attn.{q,k,v}_proj  take cat([normed embedding, normed hidden]) = 2H inputs
    layers.0.self_attn.o_proj, post_attention_layernorm, mlp.{gate,up,down}_proj
    layers.i (i >= 1)              plain Llama decoder layers
    norm.weight, lm_head.weight    [Vd, H] over the draft vocabulary
    d2t [Vd] int64, t2d [V] bool   draft id i is target id i + d2t[i]

Layer numbering: ``eagle_aux_hidden_state_layer_ids`` is written as our ``aux_layer_ids``
unchanged. Ours are Hugging Face ``output_hidden_states`` indices (id i = input of decoder layer
i). vLLM 0.32 takes the config's ids as ``aux_hidden_state_layers`` as they are
(vllm/v1/worker/gpu_model_runner.py:5251 ``_get_eagle3_aux_layers_from_config``) and captures id i
where the residual stream enters layer i: llama.py:429/439 call ``_maybe_add_hidden_state`` with
``start_layer`` before the first layer and with ``idx + 1`` after layer idx; deepseek_v2.py:1561
(DeepSeek-V3, Kimi-K2) tests ``idx in self.aux_hidden_state_layers`` before layer idx runs; the
value is ``hidden_states + residual`` (interfaces.py:1601), the un-normed stream = HF
``hidden_states[i]``. So the two numberings agree and no +1/-1 applies (DFlash's
``target_layer_ids`` are the ones vLLM shifts by +1). vLLM sorts the ids (interfaces.py:1578) and
concatenates the aux states in that order, so ``fc`` takes them in ascending order too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.draft.config import Eagle3DraftConfig
from draftsmith.errors import TrainingError

# attend(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Modules (the math of transformers' Llama modules, with speculators' Eagle3 first layer)


class RMSNorm(nn.Module):
    """LlamaRMSNorm: normalise in float32, scale by the weight in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: Eagle3DraftConfig, in_features: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def project(self, x: torch.Tensor, columns: slice = slice(None)) -> torch.Tensor:
        """q, k and v of ``x`` in one matmul, [T, (Hq + 2 Hkv) * D], through the ``columns`` of the
        projections' inputs that ``x`` holds (the first layer projects its two halves apart)."""
        weight = torch.cat([self.q_proj.weight[:, columns], self.k_proj.weight[:, columns],
                            self.v_proj.weight[:, columns]])
        return F.linear(x, weight)

    def forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                layer_index: int, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over all T rows of ``qkv`` (``project``'s output); the output projection only on
        the ``keep`` rows."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)), apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        out = attend(layer_index, q, k, v)
        if keep is not None:
            out = out[keep]
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: Eagle3DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        from transformers.activations import ACT2FN

        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Eagle3FirstLayer(nn.Module):
    """speculators' ``Eagle3FirstLayerMixin.forward`` (model_definitions.py:54-110): attention
    over cat([input_layernorm(embeds), hidden_norm(hidden)]), residual from the hidden part
    (the normed one when ``norm_before_residual``).

    The q/k/v projections of that concatenation are the sum of each half's own: the token half
    (``token_qkv``) depends on the token alone, so training projects it once per micro-batch and
    every TTT step reads it shifted, and no gradient is computed for the frozen embeddings."""

    def __init__(self, config: Eagle3DraftConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = Attention(config, 2 * config.hidden_size)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def token_qkv(self, embeds: torch.Tensor) -> torch.Tensor:
        """The token half's q/k/v: [T, (Hq + 2 Hkv) * D]."""
        return self.self_attn.project(self.input_layernorm(embeds), slice(0, self.hidden_size))

    def forward(self, token_qkv: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend, keep: torch.Tensor | None = None) -> torch.Tensor:
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        qkv = token_qkv + self.self_attn.project(hidden, slice(self.hidden_size, None))
        x = self.self_attn(qkv, cos, sin, attend, 0, keep)
        x = (residual if keep is None else residual[keep]) + x
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderLayer(nn.Module):
    """A plain Llama decoder layer (the draft's layers after the first)."""

    def __init__(self, config: Eagle3DraftConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config, config.hidden_size)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend, layer_index: int,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.self_attn.project(self.input_layernorm(hidden))
        x = (hidden if keep is None else hidden[keep]) + self.self_attn(qkv, cos, sin, attend, layer_index, keep)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftKVCache:
    """Keys and values of every position the draft has seen, per layer, for incremental drafting.

    ``crop(n)`` forgets everything after the first ``n`` positions: call it after verification so
    that only positions of accepted tokens (computed from the target's hidden states) remain,
    exactly as vLLM overwrites the slots of rejected draft tokens.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[0]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k])
            v = torch.cat([self.values[layer], v])
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i], self.values[i] = k[:length], self.values[i][:length]


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft: fc over the concatenated aux states, one Eagle-3 layer (+ plain layers), norm, lm_head.

    Training unrolls it with ``advance`` (see draftsmith.train); inference uses ``draft_step`` with a
    ``DraftKVCache``. Both run the same layers: only the attention pattern is supplied from outside.
    """

    def __init__(self, config: Eagle3DraftConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.target_vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.input_norm = RMSNorm(config.num_aux * h, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(h, config.rms_norm_eps) for _ in range(config.num_aux))
                        if config.fc_norm else None)
        self.fc = nn.Linear(config.num_aux * h, h, bias=False)
        layers: list[nn.Module] = [Eagle3FirstLayer(config)]
        layers += [DecoderLayer(config) for _ in range(1, config.num_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.target_vocab_size, dtype=torch.bool))
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary = LlamaRotaryEmbedding(config.llama_config())
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Speculators' (Hugging Face Llama) init: normal(0, initializer_range) linears, unit norms."""
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def load_target_weights(self, embed: torch.Tensor, lm_head: torch.Tensor, d2t: torch.Tensor,
                            t2d: torch.Tensor) -> None:
        """Copy the target's embeddings and the draft-vocab rows of its lm_head, and the vocab mapping."""
        c = self.config
        if tuple(embed.shape) != (c.target_vocab_size, c.hidden_size):
            raise TrainingError(f"target embeddings have shape {tuple(embed.shape)}, expected "
                                f"({c.target_vocab_size}, {c.hidden_size})", where="target embed_tokens")
        rows = draft_rows(d2t, t2d, c.target_vocab_size)
        with torch.no_grad():
            self.embed_tokens.weight = nn.Parameter(embed.detach().clone(), requires_grad=False)
            self.lm_head.weight.copy_(lm_head.detach()[rows].to(self.lm_head.weight.dtype))
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)

    # -- the shared math ------------------------------------------------------------------------

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] in float32 (as transformers' LlamaRotaryEmbedding computes them)."""
        probe = torch.empty(0, device=position_ids.device, dtype=torch.float32)
        cos, sin = self.rotary(probe, position_ids[None])
        return cos[0], sin[0]

    def fuse(self, aux_states: torch.Tensor) -> torch.Tensor:
        """[T, A*H] captured states (ascending layer ids, concatenated) -> [T, H], normalised first
        as a whole (``norm_before_fc``) or per state (``fc_norm``) when the config says so."""
        if self.input_norm is not None:
            aux_states = self.input_norm(aux_states)
        if self.fc_norm is not None:
            chunks = aux_states.chunk(len(self.fc_norm), dim=-1)
            aux_states = torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_states)

    def token_qkv(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's q/k/v of the token half of its input (the normed embeddings of
        ``input_ids``): [T, (Hq + 2 Hkv) * D], what ``advance`` takes beside the hidden state."""
        with torch.no_grad():
            embeds = self.embed_tokens(input_ids)
        return self.layers[0].token_qkv(embeds)

    def advance(self, hidden: torch.Tensor, token_qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass up to the lm_head, on the hidden states and the tokens' ``token_qkv``:
        (output hidden [T, H] fed to the next step, the final-normed state [T, H] that the lm_head
        reads). The state fed on is the last layer's output, or with ``norm_output`` (EAGLE 3.1)
        the final-normed one. Training applies the lm_head only to the positions it scores. With
        ``keep`` [n] (row indices), the last layer's output projection and MLP run on those rows
        alone and both results are theirs ([n, H]): attention still sees every row, the rest of
        the work skips rows whose outputs nothing uses."""
        last = len(self.layers) - 1
        hidden = self.layers[0](token_qkv, hidden, cos, sin, attend, keep if last == 0 else None)
        for i in range(1, len(self.layers)):
            hidden = self.layers[i](hidden, cos, sin, attend, i, keep if i == last else None)
        normed = self.norm(hidden)
        return (normed if self.config.norm_output else hidden), normed

    def step(self, hidden: torch.Tensor, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass: (output hidden [T, H] fed to the next step, draft-vocab logits [T, Vd])."""
        hidden, normed = self.advance(hidden, self.token_qkv(input_ids), cos, sin, attend)
        return hidden, self.lm_head(normed)

    # -- inference -------------------------------------------------------------------------------

    @torch.no_grad()
    def draft_step(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   cache: DraftKVCache, *, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the draft on new positions, extending ``cache``; returns (hidden [n, H], logits [n, Vd]).

        ``hidden_states`` are either the target's aux states [n, A*H] for positions whose token was
        verified (``fused=False``; they go through ``fuse``), or the hidden states the previous draft
        step fed on [n, H] (``fused=True``). ``input_ids`` [n] are the tokens that
        come *after* each hidden state's position (EAGLE's shift: the state at position p is paired
        with token p+1), ``position_ids`` [n] their positions; any convention works as long as it is
        consistent, RoPE sees only differences. New queries attend to everything in the cache plus
        the new positions causally: this is step 0 of training when the cache holds only verified
        positions, and TTT step j when it also holds the j previous draft positions of this chain.
        Map logits to target ids with ``draft_to_target(logits.argmax(-1))``.
        """
        if not fused:
            hidden_states = self.fuse(hidden_states.to(self.fc.weight.dtype))
        cos, sin = self.rope(position_ids)
        n = input_ids.shape[0]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k, v = cache.append(layer, k, v)
            total = k.shape[0]
            mask = torch.ones(n, total, dtype=torch.bool, device=q.device)
            mask[:, total - n:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
            return out.transpose(0, 1)

        return self.step(hidden_states, input_ids, cos, sin, attend)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def draft_rows(d2t: torch.Tensor, t2d: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """Target ids of the draft vocabulary in draft order (i + d2t[i]), checked against t2d."""
    rows = torch.arange(d2t.shape[0], dtype=torch.long) + d2t.cpu().long()
    if rows.min() < 0 or rows.max() >= target_vocab_size:
        raise TrainingError("d2t maps draft ids outside the target vocabulary", where="vocab/mapping.safetensors",
                            fix="rerun build_vocab_mapping for this target")
    expected = torch.zeros(target_vocab_size, dtype=torch.bool)
    expected[rows] = True
    if t2d.shape[0] != target_vocab_size or not torch.equal(expected, t2d.cpu().bool()):
        raise TrainingError("d2t and t2d disagree (t2d must mark exactly the target ids i + d2t[i])",
                            where="vocab/mapping.safetensors", fix="rerun build_vocab_mapping for this target")
    return rows


def num_flops_per_token(config: Eagle3DraftConfig, ttt_steps: int) -> float:
    """Training FLOPs per token (forward + backward) of the matmuls, excluding attention scores
    and the frozen teacher/argmax products, which ``bench`` counts separately."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    first = 2 * h * (q + 2 * kv) + q * h + 3 * h * i
    later = h * (q + 2 * kv) + q * h + 3 * h * i
    per_step = first + (config.num_layers - 1) * later + h * config.draft_vocab_size
    fc = config.num_aux * h * h
    return 2 * 3 * (fc + ttt_steps * per_step)


__all__ = ["Eagle3Draft", "DraftKVCache", "draft_rows", "num_flops_per_token"]
