"""The prompt-lookup (n-gram) baseline as vLLM runs it, and its acceptance replayed on a greedy text.

vLLM has two ``ngram`` speculators, one per model runner; ``propose`` follows either (``rule``):

- ``EARLIEST`` (``vllm/v1/spec_decode/ngram_proposer.py``, the V1 model runner's, which vLLM's CPU
  build runs): after a context of ``n`` tokens, what followed the earliest earlier occurrence of the
  context's longest suffix of ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens (an occurrence may
  overlap the suffix but must end before the last token), at most ``k`` tokens, never past the end
  of the context or the engine's ``max_model_len``; nothing when no suffix occurs.
- ``LATEST_PADDED`` (``vllm/v1/worker/gpu/spec_decode/ngram``, the V2 model runner's, vLLM's default
  on CUDA from 0.33): the latest such occurrence of the longest suffix, and always ``k`` tokens: the
  slots the match does not fill (the context's end, or no match at all) hold the last token, and are
  verified like any draft.

The HF loop's n-gram drafter proposes by ``EARLIEST``; the vLLM evaluation replays the rule of the
runner its engine uses (``engines.warm.Engine.v2_model_runner``).

A proposal depends only on the text so far, and with greedy decoding the text is the target's
greedy continuation whatever was proposed. So the n-gram baseline's verification steps can be
replayed on that text (``replay``) instead of decoded by an engine of its own: each step proposes
after the verified text, accepts the leading proposals equal to the greedy tokens, and adds the
target's next token. The engine's step rules are kept: the first token comes from the prefill with
no draft, a step schedules at most ``max_model_len - len(text) - 1`` draft tokens, and acceptance is
counted before the output is cut at a stop token or ``max_new_tokens`` (so the greedy text must
run ``k + 1`` tokens past the output's end: ``greedy`` below).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from draftsmith.evaluate.settings import Generation

PROMPT_LOOKUP_MIN = 1  # the shortest suffix matched (vLLM's prompt_lookup_min, as the baseline configures it)
EARLIEST = "earliest occurrence"  # the V1 model runner's proposer
LATEST_PADDED = "latest occurrence, padded to k"  # the V2 model runner's
RUNNER_RULES = {"V1": EARLIEST, "V2": LATEST_PADDED}  # the rule of each vLLM model runner
RULES = tuple(RUNNER_RULES.values())


def propose(context: Sequence[int], k: int, *, ngram_max: int, ngram_min: int = PROMPT_LOOKUP_MIN,
            max_model_len: int | None = None, rule: str = EARLIEST) -> list[int]:
    """vLLM's n-gram proposal after ``context`` by ``rule``: the tokens following an earlier
    occurrence of its longest suffix of ``ngram_min``..``ngram_max`` tokens (module docstring)."""
    if rule not in RULES:
        raise ValueError(f"unknown prompt-lookup rule {rule!r}: one of {RULES}")
    total = len(context)
    if rule == EARLIEST and max_model_len is not None:
        k = min(k, max_model_len - total)
    if k <= 0 or not total:
        return []
    tokens = np.asarray(context, dtype=np.int64)
    found = _follower(tokens, ngram_min, ngram_max, latest=rule == LATEST_PADDED)
    drafts = [int(t) for t in tokens[found:found + k]] if found is not None else []
    if rule == LATEST_PADDED:
        drafts += [int(tokens[-1])] * (k - len(drafts))
    return drafts


def _follower(tokens: np.ndarray, ngram_min: int, ngram_max: int, *, latest: bool) -> int | None:
    """Where the tokens after an occurrence of the longest matching suffix begin (its earliest or
    latest occurrence, ending before the last token), or None."""
    total = len(tokens)
    earlier = tokens[:-1]
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(earlier, n)
        starts = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
        if starts.size:
            return int(starts[-1 if latest else 0]) + n
    return None


def replay(prompt_id: str, prompt: Sequence[int], greedy: Sequence[int], *, k: int, ngram_max: int,
           max_new_tokens: int, stop_ids: Sequence[int], max_model_len: int | None,
           count_steps_without_draft: bool = False, rule: str = EARLIEST) -> Generation:
    """The n-gram baseline's run over ``prompt`` as vLLM would serve it: its output and, per step
    that had a draft, the tokens accepted and proposed. ``greedy`` is the target's greedy
    continuation of ``prompt``, at least ``k + 1`` tokens past where the output ends; ``rule``
    the proposer's (``EARLIEST`` or ``LATEST_PADDED``).

    The HF loop's run instead (``HFDecoder.speculate`` with the ``NgramDrafter``): no
    ``max_model_len``, and ``count_steps_without_draft``, since each of its steps is a forward pass
    of the target, drafted or not."""
    if max_model_len is None:  # a bound the run never reaches
        max_model_len = len(prompt) + max_new_tokens + k + 2
    stops = set(int(t) for t in stop_ids)
    text = [*prompt]
    generated: list[int] = []
    accepted: list[int] = []
    proposed: list[int] = []

    def emit(tokens: Sequence[int]) -> bool:
        """Append the step's tokens up to a stop; whether the output is finished."""
        for token in tokens:
            generated.append(int(token))
            text.append(int(token))
            if token in stops or len(generated) >= max_new_tokens or len(text) >= max_model_len:
                return True
        return False

    done = emit(_greedy_slice(greedy, 0, 1, prompt_id))  # the prefill's token, drafted by nobody
    while not done:
        drafts = propose(text, k, ngram_max=ngram_max, max_model_len=max_model_len, rule=rule)
        drafts = drafts[:max(max_model_len - len(text) - 1, 0)]  # the scheduler's room for them
        at = len(generated)
        truth = _greedy_slice(greedy, at, at + len(drafts) + 1, prompt_id)
        taken = next((j for j, (d, t) in enumerate(zip(drafts, truth)) if d != t), len(drafts))
        if drafts or count_steps_without_draft:
            accepted.append(taken)
            proposed.append(len(drafts))
        done = emit(truth[:taken + 1])
    return Generation(prompt_id, generated, 0.0, accepted, proposed)


def _greedy_slice(greedy: Sequence[int], begin: int, end: int, prompt_id: str) -> list[int]:
    if end > len(greedy):
        raise ValueError(f"prompt {prompt_id}: the greedy text holds {len(greedy)} tokens, the replay needs {end}")
    return [int(t) for t in greedy[begin:end]]
