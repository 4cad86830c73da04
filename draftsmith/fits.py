"""Settings that cannot fit, refused at preflight (check_setup) before any job: a training batch
whose memory exceeds the trainer's device, and generation that runs past the target's context.

Both read the target's text config (config.json, no weights) and check_setup's settings
(``draftsmith.preflight.PreflightSettings``: device, data.max_seq_len, vocab.draft_vocab_size,
train.batch_tokens, train.ttt_steps, draft.num_layers, eval.max_new_tokens, regenerate.enabled
and max_new_tokens).
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

from draftsmith.errors import ConfigError

log = logging.getLogger(__name__)


class FitSettings(Protocol):
    """What these checks read of check_setup's settings (``PreflightSettings`` has them all; named
    here so that preflight, which calls this module, is not imported back)."""

    device: str
    max_seq_len: int
    draft_vocab_size: int
    num_layers: int
    batch_tokens: int
    ttt_steps: int
    eval_max_new_tokens: int
    regenerate_enabled: bool
    regenerate_max_new_tokens: int

def train_step_bytes(batch_tokens: int, ttt_steps: int, heads: int, num_layers: int, draft_vocab: int,
                     attention: str, dtype_bytes: int) -> int:
    """Peak bytes of one training micro-batch (forward and backward) of ``batch_tokens`` positions.

    ``sdpa`` (the CPU's path, draftsmith.train.attention) computes dense scores: TTT step j
    attends over (j+1)*T keys, so each layer keeps its float32 softmax [heads, T, (j+1)T] for the
    backward (sum over j: K(K+1)/2), and the last step holds two more of its size while it
    computes (the scores, the masked scores; in the backward, their gradients), beside the
    boolean masks of every step and the two built once ((K+2) T^2 bytes). ``flex`` never
    materialises them. Both keep each step's draft logits and the teacher's, [T, draft_vocab],
    and one gradient of them (K+2 of those).

    Measured peak RSS of real CPU steps (1-layer draft, 2 heads, float32) is 0.97x to 1.10x this
    at batch_tokens 2048-8192, ttt_steps 1-5 (docs/errors.md); the flex estimate is its dominant
    term only, not measured.
    """
    t, k = batch_tokens, ttt_steps
    logits = (k + 2) * t * draft_vocab * dtype_bytes
    if attention != "sdpa":
        return logits
    scores = 4 * heads * t * t * (num_layers * k * (k + 1) // 2 + 2 * k)
    return logits + scores + (k + 2) * t * t


def _draft_heads(text: dict, settings: FitSettings) -> int:
    """The draft's attention heads, as train_draft shapes it after the target."""
    from draftsmith.draft.config import Eagle3DraftConfig

    target = {"hidden_size": text["hidden_size"], "vocab_size": text.get("vocab_size") or 1,
              "aux_layer_ids": [0], "text_config": text}
    config = Eagle3DraftConfig.from_target(target, draft_vocab_size=settings.draft_vocab_size,
                                           num_layers=settings.num_layers)
    return config.num_attention_heads


def trainer_memory(device: str) -> tuple[str, int] | None:
    """(the trainer's attention path, its device's memory in bytes) as train_draft will run here:
    flex on the smallest GPU torch sees, sdpa in host memory (cgroup limit included) on the CPU;
    None where this job cannot see the trainer's device (SLURM runs it on another node, or
    device: cuda without a GPU, which inspect_target refuses)."""
    import torch

    from draftsmith.targets.inspect import host_memory_bytes

    if os.environ.get("SLURM_JOB_ID"):
        return None
    if device != "cpu" and torch.cuda.is_available():
        return "flex", min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    if device == "cuda":
        return None
    return "sdpa", host_memory_bytes()


def check_train_fits(text: dict, settings: FitSettings, memory: tuple[str, int] | None) -> dict | None:
    """Refuse a train.batch_tokens whose step (``train_step_bytes``) exceeds the trainer's memory."""
    if memory is None:
        return None
    attention, have = memory
    heads = _draft_heads(text, settings)
    dtype_bytes = 4 if attention == "sdpa" else 2  # float32 on the CPU, bfloat16 autocast on a GPU
    need = train_step_bytes(settings.batch_tokens, settings.ttt_steps, heads, settings.num_layers,
                            settings.draft_vocab_size, attention, dtype_bytes)
    report = {"attention": attention, "estimated_bytes": need, "device_bytes": have}
    if need <= have:
        return report
    where = "the CPU's memory (cgroup limit included)" if attention == "sdpa" else "one GPU's memory"
    fits = settings.batch_tokens
    while fits > 2 and train_step_bytes(fits, settings.ttt_steps, heads, settings.num_layers,
                                        settings.draft_vocab_size, attention, dtype_bytes) > have:
        fits //= 2
    path = ("dense attention: the CPU's sdpa path holds heads x T x (j+1)T float32 scores per TTT step j"
            if attention == "sdpa" else "the draft's and the teacher's logits of every TTT step")
    raise ConfigError(
        f"one training step of train.batch_tokens={settings.batch_tokens} (ttt_steps {settings.ttt_steps}, "
        f"{heads} draft heads, draft vocabulary {settings.draft_vocab_size}) needs about "
        f"{need / 1e9:,.1f} GB ({path}), more than {where}, {have / 1e9:,.1f} GB",
        where=f"config keys train.batch_tokens, device ({settings.device})",
        fix=f"lower train.batch_tokens to {fits} or less (and data.max_seq_len with it)"
            + ("; or train on a GPU (device: cuda), whose flex attention never builds the dense scores"
               if attention == "sdpa" else ""))


def check_context(text: dict, settings: FitSettings) -> dict:
    """Refuse generation that cannot fit the target's context, warn where only long prompts overflow.

    Every prompt is at least one token, so ``max_new_tokens`` >= the context overflows on every
    prompt: refused. Held-out and eval.sources prompts are shorter than data.max_seq_len, so
    beyond ``context - max_new_tokens`` only the longer ones overflow; how many is known once they
    are rendered (evaluate_draft counts them), so preflight warns.
    """
    context = text.get("max_position_embeddings")
    if not context:
        return {"context": None}
    keys = [("eval.max_new_tokens", settings.eval_max_new_tokens)]
    if settings.regenerate_enabled:
        keys.append(("regenerate.max_new_tokens", settings.regenerate_max_new_tokens))
    longest = settings.max_seq_len - 1
    for key, new in keys:
        if new >= context:
            raise ConfigError(f"{key}: {new} new tokens cannot follow any prompt within the target's context of "
                              f"{context} positions (max_position_embeddings)", where=f"config key {key}",
                              fix=f"set {key} to at most {context - longest} (the longest prompt, "
                                  f"data.max_seq_len - 1 = {longest}, plus it fits), and below {context} in any case")
        if longest + new > context:
            log.warning("%s: prompts over %d tokens (held-out prompts may have up to %d, data.max_seq_len - 1) "
                        "plus %d new tokens run past the target's context of %d positions%s", key, context - new,
                        longest, new, context, "; evaluate_draft counts them" if key.startswith("eval") else "")
    return {"context": context, "longest_prompt": longest}
