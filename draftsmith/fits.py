"""Settings that cannot fit: a training batch whose memory exceeds the trainer's device and
generation that runs past the target's context, refused at preflight (check_setup) before any job;
a training step and a warmup that do not fit the run, refused by train_draft before any weight is read.

Preflight's checks read the target's text config (config.json, no weights) and check_setup's settings
(``draftsmith.preflight.PreflightSettings``: device, data.max_seq_len, vocab.draft_vocab_size,
train.batch_tokens, train.ttt_steps, draft.num_layers, eval.max_new_tokens, regenerate.enabled
and max_new_tokens). Before extraction the store's size is unknown, so train_draft checks the
step again against the batches its plan makes, and the warmup against the plan's step count.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Protocol

from draftsmith.errors import ConfigError

# The rows of the CPU's attention blocks (draftsmith.train.attention.document_blocks); here, so that
# the preflight's memory check reads it without importing the trainer (whose patches it need not rerun)
BLOCK_ROWS = 128

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
                     attention: str, dtype_bytes: int, span: int | None = None) -> int:
    """Peak bytes of one training micro-batch (forward and backward) of ``batch_tokens`` positions.

    ``sdpa`` (the CPU's path, draftsmith.train.attention) computes dense scores: TTT step j
    attends over (j+1)*T keys, so each layer keeps its float32 softmax [heads, T, (j+1)T] for the
    backward (sum over j: K(K+1)/2), and the last step holds two more of its size while it
    computes (the scores, the masked scores; in the backward, their gradients), beside the
    boolean masks of every step and the two built once ((K+2) T^2 bytes). ``flex`` never
    materialises them. Both keep each step's draft logits and the teacher's, [T, draft_vocab],
    and one gradient of them (K+2 of those). On the CPU the dense scores are computed block by block
    of whole samples (``draftsmith.train.attention.document_blocks``): with ``span`` the longest
    block, T^2 becomes at most T x span.

    Measured peak RSS of real CPU steps (1-layer draft, 2 heads, float32) is 0.97x to 1.10x this
    at batch_tokens 2048-8192, ttt_steps 1-5 (docs/errors.md); the flex estimate is its dominant
    term only, not measured.
    """
    t, k = batch_tokens, ttt_steps
    logits = (k + 2) * t * draft_vocab * dtype_bytes
    if attention != "sdpa":
        return logits
    width = t if span is None else min(t, span)
    scores = 4 * heads * t * width * (num_layers * k * (k + 1) // 2 + 2 * k)
    return logits + scores + (k + 2) * t * width


def attention_span(attention: str, longest_sample: int) -> int | None:
    """``StepShape.span`` where the dense scores are computed per block of whole samples (sdpa on
    the CPU): a block holds samples of up to BLOCK_ROWS rows together, or one longer sample."""
    if attention != "sdpa":
        return None
    return max(BLOCK_ROWS, longest_sample)


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
    from draftsmith.placement import host_memory_bytes

    if os.environ.get("SLURM_JOB_ID"):
        return None
    if device == "cpu":
        return "sdpa", host_memory_bytes()
    import torch  # only here: the preflight imports no torch where it need not ask for GPUs

    if torch.cuda.is_available():
        return "flex", min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    if device == "cuda":
        return None
    return "sdpa", host_memory_bytes()


_MEMORY = {"sdpa": "the CPU's memory (cgroup limit included)", "flex": "one GPU's memory"}


def process_memory(device) -> tuple[int, str]:
    """The bytes one training process on ``device`` (a torch.device) can use, and what they are: its
    GPU's memory, or its share of the host's among the training processes of this node (torchrun's
    LOCAL_WORLD_SIZE)."""
    import torch

    from draftsmith.placement import host_memory_bytes

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, _MEMORY["flex"]
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if processes == 1:
        return host_memory_bytes(), _MEMORY["sdpa"]
    return host_memory_bytes() // processes, f"a 1/{processes} share of {_MEMORY['sdpa']}, one per training process"


@dataclass(frozen=True)
class StepShape:
    """What one training step's memory depends on beside its positions (``train_step_bytes``)."""

    ttt_steps: int
    heads: int
    num_layers: int
    draft_vocab: int
    attention: str  # "sdpa" (the CPU's dense path) or "flex"
    span: int | None = None  # sdpa on the CPU: the longest block of whole samples (None: the whole batch)

    def bytes(self, positions: int) -> int:
        dtype_bytes = 4 if self.attention == "sdpa" else 2  # float32 on the CPU (an upper bound), bfloat16 on a GPU
        return train_step_bytes(positions, self.ttt_steps, self.heads, self.num_layers, self.draft_vocab,
                                self.attention, dtype_bytes, self.span)

    def most_positions(self, have: int) -> int:
        """The most positions whose step fits in ``have`` bytes (0 if none)."""
        lo, hi = 0, 1
        while self.bytes(hi) <= have:  # the bytes grow at least linearly: this ends
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.bytes(mid) <= have else (lo, mid)
        return lo


def _size(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 10**8 else f"{n / 1e6:,.1f} MB"


def check_step_fits(positions: int, basis: str, shape: StepShape, memory: tuple[int, str], where: str) -> dict:
    """Refuse a training step of ``positions`` positions (``basis`` says where that number comes
    from) whose memory exceeds ``memory`` (bytes, what they are); the fix names the train.batch_tokens
    that fits."""
    have, what = memory
    need = shape.bytes(positions)
    report = {"attention": shape.attention, "positions": positions, "estimated_bytes": need, "device_bytes": have}
    if need <= have:
        return report
    path = ("dense attention: the CPU's sdpa path holds heads x T x (j+1)T float32 scores per TTT step j"
            if shape.attention == "sdpa" else "the draft's and the teacher's logits of every TTT step")
    fits = shape.most_positions(have)
    fix = (f"lower train.batch_tokens to {fits} or less (keep it >= data.max_seq_len, lowering that too if needed)"
           if fits >= 2 else
           "train on a device with more memory, or lower vocab.draft_vocab_size")
    raise ConfigError(
        f"one training step of {positions:,} positions ({basis}; ttt_steps {shape.ttt_steps}, {shape.heads} draft "
        f"heads, draft vocabulary {shape.draft_vocab}) needs about {_size(need)} ({path}), more than "
        f"{what}, {_size(have)}", where=where,
        fix=fix + ("; or train on a GPU (device: cuda), whose flex attention never builds the dense scores"
                   if shape.attention == "sdpa" else ""))


def check_train_fits(text: dict, settings: FitSettings, memory: tuple[str, int] | None) -> dict | None:
    """Refuse a train.batch_tokens whose step (``train_step_bytes``) exceeds the trainer's memory.

    Before extraction the store's size is unknown, so this assumes full batches of train.batch_tokens
    positions: an upper bound (a batch never holds more than the store, nor than one mixed group of
    its shards). train_draft checks again with the plan's largest batch (``check_step_fits``).
    """
    if memory is None:
        return None
    attention, have = memory
    shape = StepShape(settings.ttt_steps, _draft_heads(text, settings), settings.num_layers,
                      settings.draft_vocab_size, attention, attention_span(attention, settings.max_seq_len))
    basis = (f"train.batch_tokens={settings.batch_tokens}, an upper bound: it assumes full batches, and the store, "
             "not extracted yet, may hold fewer tokens")
    return check_step_fits(settings.batch_tokens, basis, shape, (have, _MEMORY[attention]),
                           where=f"config keys train.batch_tokens, device ({settings.device})")


def check_warmup(warmup_steps: int, steps: int, plan: str) -> None:
    """Refuse a warmup longer than the run's ``steps`` optimizer steps (``plan`` says where they come from).

    The schedule (``train.loop._lr_at``) ramps to train.lr over the warmup: such a run never
    reaches it (1,000 warmup steps of a 40-step run peak at 4%, and its draft learnt nothing).
    The step count needs the store, so train_draft checks it against its plan. Only train.max_steps
    bounds it before any data exists: check_setup could refuse a warmup above it, were the two
    keys among those its rule passes (rules/target.smk).
    """
    if warmup_steps <= steps:
        return
    raise ConfigError(
        f"train.warmup_steps is {warmup_steps}, longer than the run ({plan}): the learning rate would still be "
        f"warming up at the last step, at {steps / warmup_steps:.0%} of train.lr",
        where="config key train.warmup_steps",
        fix=f"set train.warmup_steps to at most {steps}, or to null (a twentieth of the run, {max(1, steps // 20)} here), "
            "or train for more steps (raise train.epochs or train.max_steps, or lower train.batch_tokens)")


def check_context(text: dict, settings: FitSettings) -> dict:
    """Refuse samples longer than the target's context, and generation that cannot fit it; warn
    where only long prompts overflow.

    ``data.max_seq_len`` past the context would store and train on hidden states of positions the
    target was never trained at (or, with learned positions, fail in extraction once the target has
    loaded): refused.

    Every prompt is at least one token, so ``max_new_tokens`` >= the context overflows on every
    prompt: refused. Held-out and eval.sources prompts are shorter than data.max_seq_len, so
    beyond ``context - max_new_tokens`` only the longer ones overflow; how many is known once they
    are rendered (evaluate_draft counts them), so preflight warns.
    """
    context = text.get("max_position_embeddings")
    if not context:
        return {"context": None}
    if settings.max_seq_len > context:
        raise ConfigError(f"data.max_seq_len: samples of up to {settings.max_seq_len} tokens run past the target's "
                          f"context of {context} positions (max_position_embeddings): the draft would learn from "
                          "hidden states at positions the target was never trained at",
                          where="config key data.max_seq_len", fix=f"set data.max_seq_len to at most {context}")
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
