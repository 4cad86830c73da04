"""Acceptance replayed on the target's greedy output: many drafts compared on the same prompts
without running the target once per draft.

The HF loop's proposal at a verification step depends only on the verified text (the draft's cache
holds the verified positions; the chain attends to them and to its own earlier steps), and a step's
accepted length is the number of leading proposals equal to the target's greedy tokens. So the
target runs once per prompt (``trace_greedy``: its greedy tokens and aux states), the draft runs
once per prompt over every position at every depth with the true tokens as inputs
(``match_lengths``: TTT's attention, as in training; a chain is only scored up to its first miss,
where the true tokens are the draft's own), and the loop's walk is replayed for any k
(``replay``). For greedy decoding this is the loop's τ and acceptance by position, up to the
rounding of one forward pass over the text against the loop's incremental ones (in float32 the
same steps; tests/test_evaluate.py). The evaluation replays its τ-against-k sweep this way
(``replay_runs``, on the greedy runs it decoded), and ``bench/trainer_quality.py`` its drafts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from draftsmith.errors import EvaluationError
from draftsmith.evaluate.decoding import HFDecoder
from draftsmith.evaluate.drafters import Drafter, Eagle3Drafter, NgramDrafter
from draftsmith.evaluate.prompt_lookup import replay as replay_prompt_lookup
from draftsmith.evaluate.settings import Generation, Prompt


@dataclass(frozen=True)
class GreedyTrace:
    """One prompt's greedy text: ``ids`` = prompt + greedy tokens (decoded past any stop token, so
    every chain the loop could propose before its limit can be checked) and the target's aux
    states [len(ids), A*H] from one forward pass over them (None where no draft needs them)."""

    prompt: Prompt
    ids: list[int]
    aux: torch.Tensor | None


@torch.no_grad()
def trace_greedy(decoder: HFDecoder, prompts: Sequence[Prompt], max_new_tokens: int, depth: int,
                 decoded: Sequence[Sequence[int]] | None = None, *, capture: bool = True) -> list[GreedyTrace]:
    """The target's greedy continuation of each prompt, ``max_new_tokens + depth + 1`` tokens long
    (the loop's last step may propose ``depth`` tokens past its limit), and, with ``capture``, its
    aux states. ``decoded``: each prompt's greedy tokens already known (e.g. the evaluation's greedy
    run), continued from there."""
    target, traces, length = decoder.target, [], max_new_tokens + depth + 1
    for i, prompt in enumerate(prompts):
        tokens = list(decoded[i][:length]) if decoded is not None else []
        if len(tokens) < length:  # decoded as far as asked: only the capture's forward is left
            cache = target.new_cache()
            logits, _ = target.forward([*prompt.ids, *tokens], cache, last_only=True)
        while len(tokens) < length:
            tokens.append(int(logits[-1].argmax()))
            if len(tokens) < length:
                logits, _ = target.forward(tokens[-1:], cache, last_only=True)
        ids = [*prompt.ids, *tokens]
        aux = target.forward(ids, target.new_cache(), last_only=True, capture=True)[1] if capture else None
        traces.append(GreedyTrace(prompt, ids, aux))
    return traces


@torch.no_grad()
def match_lengths(draft: torch.nn.Module, trace: GreedyTrace, depth: int) -> list[int]:
    """For each row i (the aux state of position i, paired with token i+1, as the loop pairs
    them): how many of the ``depth`` tokens the draft's chain from there proposes equal the greedy
    tokens i+2, i+3, ... before the first that does not. ``draft`` is an ``Eagle3Draft``."""
    from draftsmith.train.attention import TTTAttention

    device = draft.fc.weight.device
    ids = torch.tensor(trace.ids, device=device)
    rows = len(trace.ids) - 1
    attend = TTTAttention(torch.zeros(rows, dtype=torch.long, device=device), "sdpa")
    hidden = draft.fuse(trace.aux[:rows].to(device=device, dtype=draft.fc.weight.dtype))
    base = torch.arange(rows, device=device)
    leading = torch.ones(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    for d in range(depth):
        # depth d at row i reads token i+1+d under position id i+1+d and predicts token i+2+d
        inputs = ids[(base + 1 + d).clamp(max=rows)]
        cos, sin = draft.rope(base + 1 + d)
        hidden, logits = draft.step(hidden, inputs, cos, sin, attend)
        attend.next_step()
        wanted = base + 2 + d
        hit = torch.zeros(rows, dtype=torch.bool, device=device)
        inside = wanted <= rows
        hit[inside] = draft.draft_to_target(logits[inside].argmax(-1)) == ids[wanted[inside]]
        leading &= hit
        lengths += leading.long()
    return lengths.tolist()


def replay(trace: GreedyTrace, lengths: Sequence[int], k: int, max_new_tokens: int,
           stop_ids: Sequence[int]) -> Generation:
    """The HF loop's run of one prompt at ``k`` (``HFDecoder.speculate``), from the draft's match
    lengths: the same tokens, accepted and proposed counts (seconds 0: nothing was timed)."""
    stop, first = set(stop_ids), len(trace.prompt.ids)
    tokens = [trace.ids[first]]
    accepted: list[int] = []
    done = tokens[0] in stop or max_new_tokens <= 1
    row = first - 1  # the last position with a target state; its chain proposes tokens row+2...
    while not done:
        if row + 2 >= len(trace.ids):
            raise EvaluationError(f"the greedy text ends at {len(trace.ids) - first} new tokens, the run needs more",
                                  where=f"prompt {trace.prompt.id!r}",
                                  fix="trace at least max_new_tokens + k + 1 new tokens (trace_greedy)")
        a = min(lengths[row], k)
        accepted.append(a)
        for token in trace.ids[row + 2:row + 3 + a]:
            tokens.append(token)
            if token in stop or len(tokens) >= max_new_tokens:
                done = True
                break
        row += a + 1
    return Generation(trace.prompt.id, tokens, 0.0, accepted, [k] * len(accepted))


def can_replay(drafter: object) -> bool:
    """Whether ``replay_runs`` knows how ``drafter`` (the HF loop's) proposes."""
    return isinstance(drafter, (Eagle3Drafter, NgramDrafter))


def replay_runs(decoder: HFDecoder, prompts: Sequence[Prompt], drafters: Mapping[str, Drafter],
                ks: Sequence[int], greedy: Sequence[Generation] | None = None
                ) -> dict[tuple[str, int], list[Generation]]:
    """The HF loop's run of every prompt by every drafter (``can_replay``) at every k of ``ks``,
    replayed on one greedy trace per prompt (continuing ``greedy``, the prompts' greedy runs, where
    given): the EAGLE-3 draft from its match lengths, the n-gram baseline by its proposal rule
    (``prompt_lookup.replay``, the loop's steps)."""
    unknown = sorted(name for name, drafter in drafters.items() if not can_replay(drafter))
    if unknown:
        raise ValueError(f"no replay for the drafters {unknown}: decode them (HFDecoder.speculate)")
    depth = max(ks)
    decoded = [g.tokens for g in greedy] if greedy is not None else None
    capture = any(isinstance(d, Eagle3Drafter) for d in drafters.values())
    traces = trace_greedy(decoder, prompts, decoder.max_new_tokens, depth, decoded, capture=capture)
    runs: dict[tuple[str, int], list[Generation]] = {(name, k): [] for name in drafters for k in ks}
    for trace in traces:
        for name, drafter in drafters.items():
            lengths = match_lengths(drafter.draft, trace, depth) if isinstance(drafter, Eagle3Drafter) else None
            for k in ks:
                runs[name, k].append(_replayed(drafter, trace, lengths, k, decoder))
    return runs


def _replayed(drafter: Drafter, trace: GreedyTrace, lengths: list[int] | None, k: int, decoder: HFDecoder) -> Generation:
    """One drafter's run of one prompt at ``k``: the EAGLE-3 draft's from its match lengths, the
    n-gram baseline's by the HF loop's steps (no engine context to fit; a step without a draft is a step)."""
    if isinstance(drafter, Eagle3Drafter):
        return replay(trace, lengths, k, decoder.max_new_tokens, decoder.stop_ids)
    return replay_prompt_lookup(trace.prompt.id, trace.prompt.ids, trace.ids[len(trace.prompt.ids):], k=k,
                                ngram_max=drafter.ngram_max, max_new_tokens=decoder.max_new_tokens,
                                stop_ids=decoder.stop_ids, max_model_len=None, count_steps_without_draft=True)
