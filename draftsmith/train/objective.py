"""The training objective: the positions each TTT step scores, the loss against the teacher over the
draft vocabulary (its KL, optionally mixed with the cross-entropy on its top token; fused kernels), the
feature noise on the captured states, and the draft unrolled for ``ttt_steps`` on one packed
micro-batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from draftsmith.draft.model import Eagle3Draft
from draftsmith.errors import TrainingError
from draftsmith.targets.logits import apply_logit_transform
from draftsmith.train.attention import TTTAttention


def scored_positions(valid: torch.Tensor) -> dict:
    """Gather indices of the positions each TTT step scores, from ``valid`` [K, T] on the host, so
    that the lm_head, the teacher and the loss touch only those and the step never syncs.

    ``teach_rows`` [N0]: the teacher's rows, the step-0 loss positions (step j at t is scored
    against the teacher at t+j, itself a step-0 loss position of the same sample); ``rows``: the
    positions of steps 0..K-1, concatenated, ``splits`` their counts; ``teach``: each position's
    teacher as an index into ``teach_rows``; ``keep``: per step, the rows whose output is used
    (concatenated, ``keep_splits`` their counts); ``pick``: each scored position as an index into
    its step's ``keep``.
    """
    valid = valid.cpu()
    t = valid.shape[1]
    teach_rows = valid[0].nonzero().squeeze(1)
    compact = valid[0].long().cumsum(0) - 1
    rows, teach = [], []
    for j in range(valid.shape[0]):
        r = valid[j].nonzero().squeeze(1)
        if bool((r + j >= t).any()) or not bool(valid[0][r + j].all()):
            raise TrainingError(f"TTT step {j}'s loss positions are not step 0's shifted by {j} within samples",
                                where="training batch", fix="build batches with draftsmith.train.batches")
        rows.append(r)
        teach.append(compact[r + j])
    # keep[j]: the rows whose step-j output anything uses, those scored at step j or later (step
    # j+1 reads step j's output at the same row); pick[j]: step j's scored rows within keep[j].
    keep, pick, needed = [None] * len(rows), [None] * len(rows), torch.zeros(t, dtype=torch.bool)
    for j in reversed(range(len(rows))):
        needed = needed | valid[j]
        keep[j] = needed.nonzero().squeeze(1)
        pick[j] = (needed.long().cumsum(0) - 1)[rows[j]]
    return {"teach_rows": teach_rows, "rows": torch.cat(rows), "teach": torch.cat(teach),
            "splits": tuple(len(r) for r in rows), "keep": torch.cat(keep), "keep_splits": tuple(map(len, keep)),
            "pick": torch.cat(pick)}


def noised_states(aux: torch.Tensor, num_states: int, amplitude: float, seed: int) -> torch.Tensor:
    """aux [T, A*H] (A captured states per token, concatenated) plus uniform noise in
    ±``amplitude`` x each state's RMS at its token, drawn on aux's device from ``seed``. EAGLE adds
    uniform noise of a fixed size to the target's features; relative to each state's scale, one
    setting fits every layer and model. Padding rows (zeros) stay zeros."""
    x = aux.view(aux.shape[0], num_states, -1).float()
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    generator = torch.Generator(aux.device).manual_seed(seed)
    noise = torch.rand(x.shape, generator=generator, device=aux.device, dtype=torch.float32).mul_(2).sub_(1)
    return (x + (amplitude * rms) * noise).to(aux.dtype).view_as(aux)


def _teacher_rows(tz: torch.Tensor):
    """Per row of teacher logits: logsumexp, negative entropy (sum p log p), argmax and max."""
    tf = tz.float()
    tlse = torch.logsumexp(tf, -1)
    logp = tf - tlse[:, None]
    top, arg = tf.max(-1)
    return tlse, (logp.exp() * logp).sum(-1), arg, top


def _loss_rows(z: torch.Tensor, tz: torch.Tensor, tlse: torch.Tensor, negent: torch.Tensor, teach: torch.Tensor,
               top: torch.Tensor, hard: float):
    """Per draft row z against teacher row ``teach``: (1 - hard) * KL(teacher || draft) + hard *
    cross-entropy on the teacher's top token ``top[teach]``, with the draft's logsumexp (for the
    backward) and argmax. The teacher's probabilities are recomputed from its logits, never stored."""
    zf = z.float()
    lse = torch.logsumexp(zf, -1)
    loss = lse.new_zeros(())
    if hard < 1:
        p = torch.exp(tz[teach].float() - tlse[teach, None])
        loss = (1 - hard) * (lse - (p * zf).sum(-1) + negent[teach])
    if hard > 0:
        loss = loss + hard * (lse - zf.gather(1, top[teach, None]).squeeze(1))
    return loss, lse, zf.argmax(-1)


def _loss_rows_grad(z: torch.Tensor, lse: torch.Tensor, tz: torch.Tensor, tlse: torch.Tensor, teach: torch.Tensor,
                    top: torch.Tensor, hard: float, grad: torch.Tensor) -> torch.Tensor:
    """d loss / d z = softmax(z) - ((1 - hard) * p + hard * onehot(top)), times each row's incoming
    gradient, in z's dtype."""
    target = (1 - hard) * torch.exp(tz[teach].float() - tlse[teach, None]) if hard < 1 else 0.0
    if hard > 0:
        onehot = torch.arange(z.shape[1], device=z.device)[None] == top[teach, None]
        target = target + hard * onehot
    return (grad[:, None] * (torch.exp(z.float() - lse[:, None]) - target)).to(z.dtype)


@dataclass(frozen=True)
class LossKernels:
    """The row-wise parts of the loss. Eager, they run in row chunks (bounding the float32
    temporaries); compiled, Inductor fuses each into kernels that read the logits once or twice and
    write only per-row results (the backward: the gradient), so they take all rows at once. Row
    counts differ per batch: compiled with automatic dynamic shapes."""

    teacher: Any = _teacher_rows
    loss: Any = _loss_rows
    loss_grad: Any = _loss_rows_grad
    chunk: int | None = 4096

    @classmethod
    def compiled(cls, backend: str = "inductor") -> LossKernels:
        return cls(*(torch.compile(f, backend=backend) for f in (_teacher_rows, _loss_rows, _loss_rows_grad)), chunk=None)

    def slices(self, n: int) -> list[slice]:
        if self.chunk is None or n <= self.chunk:
            return [slice(None)]
        return [slice(i, i + self.chunk) for i in range(0, n, self.chunk)]

    def rows(self, fn, n: int, *args, rowwise: tuple[int, ...] = (0,)) -> tuple[torch.Tensor, ...]:
        """fn over row chunks of the arguments at positions ``rowwise``, outputs concatenated."""
        parts = [fn(*(a[s] if i in rowwise else a for i, a in enumerate(args))) for s in self.slices(n)]
        if len(parts) == 1:
            return parts[0]
        if isinstance(parts[0], torch.Tensor):
            return torch.cat(parts)
        return tuple(torch.cat(p) for p in zip(*parts))


class DraftLoss(torch.autograd.Function):
    """Per scored row, the loss against the teacher over the draft vocabulary (``_loss_rows``: its
    KL, mixed with the cross-entropy on its top token by ``hard``), and the draft's argmax.

    Inputs: draft logits z [N, Vd] (the lm_head's output, in its compute dtype), the teacher's
    logits tz [N0, Vd] with their logsumexp, negative entropy and top token [N0], and each draft
    row's teacher row ``teach`` [N]. Saves z and per-row values only: the float32 softmaxes are
    recomputed in the backward instead of kept per TTT step (autograd through log_softmax would
    hold several float32 [N, Vd] tensors per step).
    """

    @staticmethod
    def forward(ctx, z, tz, tlse, negent, teach, top, hard: float, kernels: LossKernels):
        with torch.autocast(z.device.type, enabled=False):
            loss, lse, arg = kernels.rows(kernels.loss, z.shape[0], z, tz, tlse, negent, teach, top, hard,
                                          rowwise=(0, 4))
        ctx.save_for_backward(z, lse, tz, tlse, teach, top)
        ctx.kernels, ctx.hard = kernels, hard
        ctx.mark_non_differentiable(arg)
        return loss, arg

    @staticmethod
    def backward(ctx, grad_loss, grad_arg):
        z, lse, tz, tlse, teach, top = ctx.saved_tensors
        kernels = ctx.kernels
        with torch.autocast(z.device.type, enabled=False):
            grad = kernels.rows(kernels.loss_grad, z.shape[0], z, lse, tz, tlse, teach, top, ctx.hard,
                                grad_loss.contiguous(), rowwise=(0, 1, 4, 7))
        return grad, None, None, None, None, None, None, None


class TTTObjective(nn.Module):
    """Loss and accuracy counts of the draft unrolled for ``ttt_steps`` on one packed micro-batch.

    The teacher matrices are plain attributes, not parameters or buffers: DDP neither syncs nor
    broadcasts them, and checkpoints do not carry them (they come from the target).
    """

    def __init__(self, draft: Eagle3Draft, lm_head: torch.Tensor, rows: torch.Tensor, *, ttt_steps: int,
                 ttt_decay: float, attention: str, hard_label_weight: float = 0.0, feature_noise: float = 0.0,
                 logit_transform: dict | None = None, flex_fn=None, argmax_chunk: int = 2048) -> None:
        super().__init__()
        self.draft = draft
        self.teacher = lm_head[rows]  # [Vd, H] draft-vocab rows, in draft order
        outside = torch.ones(lm_head.shape[0], dtype=torch.bool)
        outside[rows] = False
        self.rest = lm_head[outside]  # [V - Vd, H]: only for "is the true argmax in the draft vocab?"
        self.ttt_steps, self.ttt_decay, self.hard_label_weight = ttt_steps, ttt_decay, hard_label_weight
        self.feature_noise = feature_noise
        self.logit_transform = logit_transform  # target.json's: the target's logits beyond its lm_head
        self.attention, self.flex_fn, self.argmax_chunk = attention, flex_fn, argmax_chunk
        self.steps_fn = self._steps
        self.kernels = LossKernels()

    def to_device(self, device: torch.device, dtype: torch.dtype) -> TTTObjective:
        self.teacher = self.teacher.to(device=device, dtype=dtype)
        self.rest = self.rest.to(device=device, dtype=dtype)
        return self

    def compile_steps(self, backend: str = "inductor") -> TTTObjective:
        """torch.compile the unrolled draft and the loss's row kernels. All TTT steps are one graph
        (GPU batches have one padded length; each step's kept row count is marked dynamic), so that
        Inductor sums each weight's gradients over the steps and casts the weights once, where
        a graph per step left autograd to add up full float32 gradients step by step."""
        self.steps_fn = torch.compile(self._steps, dynamic=False, backend=backend)
        self.kernels = LossKernels.compiled(backend)
        return self

    def unroll(self, aux: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor,
               keep: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The final-normed states (what the lm_head reads) of TTT steps 0..K-1 (module docstring):
        [T, H], or with ``keep`` (per step, the rows whose outputs are used, each step's within the
        previous one's; ``scored_positions``) [len(keep[j]), H], up to the first step that keeps no
        row.

        ``ids`` [T] are step 0's tokens. Step j's token at row t is step 0's at row t + j, so the
        first layer's projections of the tokens are computed once and read shifted by j rows;
        where t + j leaves t's sample, row t reads another sample's token (or a zero row past the
        batch), at a row that no step from j on scores."""
        steps = self.ttt_steps
        if keep is not None:
            steps = next((j for j, rows in enumerate(keep) if not len(rows)), steps)
            keep = tuple(keep[:steps])
            for rows in keep:
                if len(rows) > 1:  # one compiled graph, whatever the batch's row counts
                    torch._dynamo.mark_dynamic(rows, 0)
        if not steps:
            return []
        cos, sin = self.draft.rope((pos[None] + torch.arange(steps, device=pos.device)[:, None]).flatten())
        return self.steps_fn(aux, ids, cos, sin, TTTAttention(doc, self.attention, self.flex_fn), steps, keep)

    def _steps(self, aux: torch.Tensor, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attend: TTTAttention, steps: int, keep: tuple[torch.Tensor, ...] | None) -> list[torch.Tensor]:
        """``unroll``'s TTT steps; cos and sin [steps * T, D], step after step."""
        hidden = self.draft.fuse(aux)
        t = ids.shape[0]
        token_qkv = F.pad(self.draft.token_qkv(ids), (0, 0, 0, steps - 1))
        states = []
        for j in range(steps):
            rows = None if keep is None else keep[j]
            out, normed = self.draft.advance(hidden, token_qkv[j:j + t], cos[j * t:(j + 1) * t],
                                             sin[j * t:(j + 1) * t], attend, rows)
            attend.next_step()
            states.append(normed)
            if rows is not None and j + 1 < steps:  # rows dropped here stay dropped: zeros stand in for them
                out = out.new_zeros(t, out.shape[1]).index_copy(0, rows, out)
            hidden = out
        return states

    @torch.no_grad()
    def _teacher(self, final: torch.Tensor, teach_rows: torch.Tensor, exact: bool):
        """The teacher at its rows: logits [N0, Vd], logsumexp, negative entropy, argmax, and (``exact``)
        whether the target's argmax over its whole vocabulary lies in the draft vocabulary."""
        x = final[teach_rows]
        tz = apply_logit_transform(x @ self.teacher.to(x.dtype).T, self.logit_transform)
        tlse, negent, arg, top = self.kernels.rows(self.kernels.teacher, tz.shape[0], tz)
        in_vocab = None
        if exact:
            in_vocab = torch.ones_like(arg, dtype=torch.bool)
            if self.rest.shape[0]:
                rest = self.rest.to(x.dtype)
                # the transform rises monotonically: the maximum of the transformed is the transformed maximum
                max_out = apply_logit_transform(
                    torch.cat([(c @ rest.T).max(-1).values for c in x.split(self.argmax_chunk)]), self.logit_transform)
                in_vocab = top >= max_out.float()
        return tz, tlse, negent, arg, in_vocab

    def forward(self, batch: dict, weights: torch.Tensor, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (sum_j weights[j] * sum of step-j loss over its scored positions, stats [K, 6]).

        ``batch``: aux, final, ids, valid, pos, doc and noise_seed as ``BatchFeed`` makes them, plus
        ``scored_positions(valid)``; in training mode, ``feature_noise`` > 0 noises aux
        (``noised_states``) before the draft reads it. stats columns: loss sum, scored positions, positions where the
        draft's argmax is the teacher's within the draft vocabulary; with ``exact`` (logging steps:
        it costs a pass over the target's whole lm_head) also positions checked, positions where the
        draft's token is the target's argmax over its whole vocabulary (what vLLM accepts), and
        positions whose steps 0..j all were (the accepted-prefix events behind the acceptance length).
        """
        aux, final, ids, valid, pos, doc = (batch[k] for k in ("aux", "final", "ids", "valid", "pos", "doc"))
        splits = batch["splits"]
        stats = aux.new_zeros((valid.shape[0], 6), dtype=torch.float32)
        if not splits[0]:  # a filler micro-batch: zero gradients for every parameter, so DDP still reduces
            return sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0, stats
        tz, tlse, negent, target_arg, in_vocab = self._teacher(final, batch["teach_rows"], exact)
        if self.training and self.feature_noise > 0:
            aux = noised_states(aux, aux.shape[1] // final.shape[1], self.feature_noise, batch["noise_seed"])
        rows, teach, pick = (batch[k].split(splits) for k in ("rows", "teach", "pick"))
        keep = batch["keep"].split(batch["keep_splits"])
        chain = valid[0]
        loss = aux.new_zeros((), dtype=torch.float32)
        for j, normed in enumerate(self.unroll(aux, ids, pos, doc, keep)):
            rows_loss, arg = DraftLoss.apply(self.draft.lm_head(normed[pick[j]]), tz, tlse, negent, teach[j],
                                             target_arg, self.hard_label_weight, self.kernels)
            step_sum = rows_loss.sum()
            loss = loss + weights[j] * step_sum
            with torch.no_grad():
                n = step_sum.new_full((), splits[j])
                hit = arg == target_arg[teach[j]]
                row = [step_sum.detach(), n, hit.sum().float()]
                if in_vocab is not None:
                    hit = hit & in_vocab[teach[j]]
                    chain = chain & torch.zeros_like(chain).index_put_((rows[j],), hit)
                    row += [n, hit.sum().float(), chain.sum().float()]
                stats[j, :len(row)] = torch.stack(row)
        return loss, stats
