"""The attention of the draft unrolled for training-time test: step j sees step 0's keys causally
within its sample and the keys of steps 1..j at the same position."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.fits import BLOCK_ROWS

try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch < 2.9
    AuxRequest = None


def document_blocks(doc: torch.Tensor, rows: int = BLOCK_ROWS) -> list[tuple[int, int]]:
    """Row ranges [start, end) of ``doc`` [T] (a packed batch's sample ids, each sample's rows
    contiguous) that never split a sample: consecutive samples grouped while the group stays within
    ``rows`` rows; a longer sample is a block of its own. No row attends outside its sample, so
    attention computed block by block is the whole batch's."""
    counts = torch.unique_consecutive(doc.cpu(), return_counts=True)[1].tolist()
    blocks, start, end = [], 0, 0
    for n in counts:
        if end > start and end - start + n > rows:
            blocks.append((start, end))
            start = end
        end += n
    blocks.append((start, end))
    return blocks


def _flex_with_lse(fn, q, k, v, block_mask, scale):
    """flex_attention returning (out, lse), on both the new and the old return convention."""
    if AuxRequest is not None:
        out, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_lse=True)


class TTTAttention:
    """The TTT attention pattern for one micro-batch, used as the draft's ``attend``.

    Step 0 stores each layer's keys/values; step j attends to them causally within the sample
    and to the keys/values of steps 1..j at the same position. ``sdpa`` concatenates those keys
    and uses an explicit boolean mask (speculators' dense path); on the CPU it does so block by
    block of whole samples (``document_blocks``): a packed batch of short samples then computes a
    fraction of the T x (j+1)T scores, all of them masked out beyond the samples (on a GPU, where
    the step is one compiled graph, one block: the whole batch). ``flex`` runs the causal part
    with flex attention over block-diagonal document masks and merges the few same-position keys
    through the log-sum-exp, so it never materialises the (j+1)*T-wide mask.
    """

    def __init__(self, doc: torch.Tensor, impl: str, flex_fn=None) -> None:
        self.impl, self.step_index = impl, 0
        self.k0: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.extra: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        t = doc.shape[0]
        if impl == "sdpa":
            self.blocks = [(0, t)] if doc.is_cuda else document_blocks(doc)
            self.masks = []  # per block: (causal within samples, same position)
            for start, end in self.blocks:
                d, n = doc[start:end], end - start
                causal = (d[:, None] == d[None, :]) & torch.ones(n, n, dtype=torch.bool, device=doc.device).tril()
                self.masks.append((causal, torch.eye(n, dtype=torch.bool, device=doc.device)))
        else:
            from torch.nn.attention.flex_attention import create_block_mask

            def causal_document(b, h, q_idx, kv_idx):
                return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

            self.block_mask = create_block_mask(causal_document, None, None, t, t, device=doc.device,
                                                _compile=doc.is_cuda)
            if flex_fn is None:
                from torch.nn.attention.flex_attention import flex_attention as flex_fn
            self.flex = flex_fn

    def next_step(self) -> None:
        self.step_index += 1

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        gqa = q.shape[1] != k.shape[1]
        if self.step_index == 0:
            self.k0[layer] = (k, v)
            self.extra[layer] = []
        else:
            self.extra[layer].append((k, v))
        k0, v0 = self.k0[layer]
        extra = self.extra[layer]
        if self.impl == "sdpa":
            outs = []
            for (start, end), (causal, eye) in zip(self.blocks, self.masks):
                rows = slice(start, end)
                keys = torch.cat([k0[rows]] + [e[0][rows] for e in extra])
                values = torch.cat([v0[rows]] + [e[1][rows] for e in extra])
                mask = torch.cat([causal] + [eye] * len(extra), dim=1)
                outs.append(F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys.transpose(0, 1),
                                                           values.transpose(0, 1), attn_mask=mask, scale=scale,
                                                           enable_gqa=gqa))
            return torch.cat(outs, dim=1).transpose(0, 1)
        out, lse = _flex_with_lse(self.flex, q.transpose(0, 1)[None].contiguous(),
                                  k0.transpose(0, 1)[None].contiguous(), v0.transpose(0, 1)[None].contiguous(),
                                  self.block_mask, scale)
        out, lse = out[0].transpose(0, 1), lse[0].transpose(0, 1)  # [T, Hq, D], [T, Hq]
        if not extra:
            return out
        group = q.shape[1] // k.shape[1]
        ks = torch.stack([e[0] for e in extra], dim=2).repeat_interleave(group, dim=1)  # [T, Hq, j, D]
        vs = torch.stack([e[1] for e in extra], dim=2).repeat_interleave(group, dim=1)
        f = torch.promote_types(q.dtype, torch.float32)
        # Products and sums, not einsum: as matmuls of 1xD by Dxj per token and head they run in
        # small-tile kernels at a fraction of the bandwidth (docs/benchmarks.md, "Matmuls by shape").
        scores = (q.to(f)[:, :, None] * ks.to(f)).sum(-1) * scale  # [T, Hq, j]
        weights = torch.softmax(torch.cat([lse.to(f)[..., None], scores], dim=-1), dim=-1)
        merged = weights[..., :1] * out.to(f) + (weights[..., 1:, None] * vs.to(f)).sum(2)
        return merged.to(q.dtype)
