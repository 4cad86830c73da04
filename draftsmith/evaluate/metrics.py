"""Metrics of an evaluation: the lossless check against greedy decoding, acceptance length and
rate per draft position, the timed speedup, and the runs over prompts and drafters that produce them."""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from tqdm import tqdm

from draftsmith.errors import EvaluationError
from draftsmith.evaluate.decoding import DecodingBackend, HFDecoder
from draftsmith.evaluate.drafters import Drafter
from draftsmith.evaluate.replay import can_replay, replay_runs
from draftsmith.evaluate.settings import DrafterSpec, EvalSettings, Generation, Prompt
from draftsmith.settings import PROGRESS_INTERVAL_S

log = logging.getLogger(__name__)


ACCEPTANCE_FORMAT = "draftsmith.acceptance/1"
MAX_LISTED_TIES = 100  # acceptance.json lists this many near-ties and counts them all
# The wall-clock speedup is reported from at least this many timed prompts: one prompt's timing
# swings with the machine's load (3.8x and 0.5x were both seen for one draft).
MIN_TIMED_PROMPTS = 8
# The target scores a token one position at a time in greedy decoding and k+1 positions at a time
# when verifying; different matmul shapes round differently, so where its two best logits are
# closer than this share of the best logit's size (a few units in the last place of the dtype,
# accumulated over the layers) the two runs may legitimately pick different tokens. Everything
# else is a bug.
TIE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def near_tie(best: float, below: float, tolerance: float) -> bool:
    """Whether a token ``below`` under the best logit ``best`` is within rounding of it: ``tolerance``
    (TIE_TOLERANCE's, by dtype) times the best logit's size."""
    return below <= tolerance * max(abs(best), 1.0)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first token where ``a`` and ``b`` part (the shorter length when one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_lossless(reference: Generation, candidate: Generation, *, label: str, tolerance: float,
                   gap: Callable[[list[int], int], tuple[float, float]],
                   greedy_after: Callable[[list[int]], list[int]], problem: str | None = None,
                   candidate_name: str = "speculative decoding", fix: str | None = None) -> list[dict]:
    """Check that every token ``candidate`` generated is the target's greedy choice after the ones
    before it; raise EvaluationError at the first that is not.

    ``reference`` is plain greedy decoding of the same prompt. Where the two part at a numerical
    near-tie (``gap(prefix, token)``: the target's best logit after ``prefix`` and how far below it
    the candidate's token is; within ``tolerance`` times the best logit's size), greedy decoding is
    restarted after the candidate's tokens (``greedy_after``) and the comparison goes on from there.
    Returns the near-ties passed. ``problem``, ``candidate_name`` and ``fix`` word the error when
    the candidate is not this loop's speculative decoding (e.g. vLLM's output).
    """
    got = candidate.tokens
    ref = reference.tokens  # greedy decoding after got[:offset]
    offset = 0
    ties: list[dict] = []
    while True:
        rest = got[offset:]
        if rest == ref:
            return ties
        p = offset + first_difference(rest, ref)
        below = best = None
        if p < len(got) and p - offset < len(ref):
            best, below = gap(got[:p], got[p])
            if near_tie(best, below, tolerance):
                log.warning("prompt %s, %s: speculative and greedy decoding part at generated token %d, whose "
                            "logit is only %.2g below the target's best (%.4g): rounding; compared from there "
                            "against greedy decoding of the speculative prefix",
                            reference.prompt_id, label, p, below, best)
                ties.append({"prompt": reference.prompt_id, "drafter": label, "position": p, "margin": below,
                             "best_logit": best})
                offset = p + 1
                ref = greedy_after(got[:offset])
                continue
        want = ref[p - offset] if p - offset < len(ref) else "the end (greedy decoding stopped)"
        have = got[p] if p < len(got) else f"the end ({candidate_name} stopped)"
        detail = "" if below is None else f" (whose logit is {below:.3g} below the target's best, {best:.4g})"
        raise EvaluationError(
            f"{problem or f'speculative decoding with the {label} is not lossless'}: at generated token {p}, "
            f"greedy decoding gives {want} and {candidate_name} gives {have}{detail}",
            where=f"held-out prompt {reference.prompt_id!r}, generated position {p}",
            fix=fix or "speculative decoding must reproduce greedy decoding exactly: this is a bug in the "
                       "verification loop or a nondeterministic target (check the attention implementation "
                       "and the dtype)")


def acceptance_stats(generations: Sequence[Generation], k: int) -> dict:
    """τ (accepted draft tokens + 1 per verification step, averaged over steps), the share of steps
    whose draft token j was accepted (a position after a rejection counts as not accepted) and
    proposed, and the counts they come from."""
    steps = sum(len(g.accepted) for g in generations)
    accepted = [a for g in generations for a in g.accepted]
    proposed = [n for g in generations for n in g.proposed]
    by_position = [sum(a >= j for a in accepted) for j in range(1, k + 1)]
    proposed_by_position = [sum(n >= j for n in proposed) for j in range(1, k + 1)]
    seconds = sum(g.seconds for g in generations)
    tokens = sum(len(g.tokens) for g in generations)
    return {
        "tau": (sum(accepted) + steps) / steps if steps else None,
        "acceptance_rate_by_position": [c / steps if steps else None for c in by_position],
        "proposal_rate_by_position": [c / steps if steps else None for c in proposed_by_position],
        "accepted_by_position": by_position,
        "num_prompts": len(generations),
        "num_tokens": tokens,
        "num_steps": steps,
        "seconds": round(seconds, 4),
        "tokens_per_second": tokens / seconds if seconds else None,
    }


def by_source(prompts: Sequence[Prompt], draft: Sequence[Generation], baseline: Sequence[Generation],
              k: int) -> dict | None:
    """τ of the draft and of the baseline on each data file's held-out prompts, where they come from
    more than one (the user's conversations beside the target's own, say): a mean over all of them
    hides which the draft serves well. None for prompts of one file."""
    files: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        files.setdefault(prompt.source, []).append(i)
    if len(files) < 2:
        return None
    found = {}
    for file, indices in files.items():
        tau = acceptance_stats([draft[i] for i in indices], k)["tau"]
        baseline_tau = acceptance_stats([baseline[i] for i in indices], k)["tau"]
        found[file or "(unnamed)"] = {"num_prompts": len(indices), "tau": tau, "baseline_tau": baseline_tau,
                                      "ratio": tau / baseline_tau if tau and baseline_tau else None}
    log.info("τ by held-out source at k=%d: %s", k, "; ".join(
        f"{file} {f['tau'] or 0:.3f} vs {f['baseline_tau'] or 0:.3f} ({f['num_prompts']} prompts)"
        for file, f in found.items()))
    return found


@dataclass(frozen=True)
class OutsideRun:
    """Outputs another engine (vLLM) produced for the same prompts, in prompt order, to be checked
    against the evaluation's greedy references like its own speculative runs; the strings word the
    error (see ``check_lossless``)."""

    label: str
    generations: Sequence[Generation]
    problem: str
    candidate_name: str
    fix: str
    k: int | None = None


def run_evaluation(backend: DecodingBackend, prompts: Sequence[Prompt], draft: DrafterSpec | Drafter,
                   baseline: DrafterSpec | Drafter, settings: EvalSettings,
                   outside: Sequence[OutsideRun] = ()) -> dict:
    """Decode ``prompts`` greedily and speculatively with the draft and the baseline at ``k``, check
    every speculative output (and every ``outside`` run's) against greedy decoding, and return
    acceptance.json's figures; τ at every k of the sweep on the first ``sweep_max_prompts``, replayed
    on the target's greedy text (``replay_runs``) or, for a drafter it cannot replay, decoded and
    checked like the run at ``k``."""
    return evaluate_runs(backend, prompts, draft, baseline, settings, outside)[0]


def evaluate_runs(backend: DecodingBackend, prompts: Sequence[Prompt], draft: DrafterSpec | Drafter,
              baseline: DrafterSpec | Drafter, settings: EvalSettings, outside: Sequence[OutsideRun] = ()
              ) -> tuple[dict, dict[tuple[str, int], list[Generation]]]:
    """``run_evaluation``, also returning the decoded speculative runs by (drafter name, k): at
    ``k`` for every drafter, at each k of the sweep for those not replayed."""
    for run in outside:
        if [g.prompt_id for g in run.generations] != [p.id for p in prompts]:
            raise EvaluationError(f"the {run.label} run holds other prompts than the evaluation",
                                  where="evaluate.run_evaluation", fix="pass its outputs in prompt order")
    if not prompts:
        raise EvaluationError("no held-out prompts to evaluate", where="data/heldout.jsonl",
                              fix="raise data.heldout_fraction or data.max_heldout")
    started = time.perf_counter()
    sweep = sorted(set(settings.k_sweep) | {settings.k})
    n_sweep = min(len(prompts), settings.sweep_max_prompts)
    drafters = {"draft": draft, "baseline": baseline}
    replayed = _replayable(backend, drafters) if len(sweep) > 1 else {}
    greedy, runs, ties = _decode(backend, prompts, drafters, settings, sweep, n_sweep, outside, replayed)
    swept = {key: generations[:n_sweep] for key, generations in runs.items()}
    replay_check = None
    if replayed:
        again = replay_runs(backend, prompts[:n_sweep], replayed, sweep, greedy[:n_sweep])
        swept |= {(name, k): generations for (name, k), generations in again.items() if k != settings.k}
        replay_check = _replay_check(again, runs, settings.k, n_sweep)
    main = {name: acceptance_stats(runs[name, settings.k], settings.k) for name in drafters}
    result = {
        "format": ACCEPTANCE_FORMAT,
        **main["draft"],
        "draft": _describe(draft),
        "baseline": {**_describe(baseline), **main["baseline"]},
        "by_source": by_source(prompts, runs["draft", settings.k], runs["baseline", settings.k], settings.k),
        "tau_by_k": {
            "k": sweep,
            "draft": [acceptance_stats(swept["draft", k], k)["tau"] for k in sweep],
            "baseline": [acceptance_stats(swept["baseline", k], k)["tau"] for k in sweep],
            "num_prompts": n_sweep,
            "prompts": "all" if n_sweep == len(prompts) else f"the first {n_sweep} of {len(prompts)}",
            "replayed": sorted(replayed),
            "replay_check": replay_check,
        },
        "speedup": _speedup(backend, greedy, [runs[name, settings.k] for name in ("draft", "baseline")], main),
        "lossless": {
            "checked_generations": sum(len(v) for v in runs.values()) + sum(len(r.generations) for r in outside),
            "checked_tokens": sum(len(g.tokens) for v in runs.values() for g in v)
                              + sum(len(g.tokens) for r in outside for g in r.generations),
            "numerical_tie_count": len(ties),
            "numerical_ties": ties[:MAX_LISTED_TIES],
        },
        "device": backend.describe_device(),
        "settings": {**settings.section_values(), "k_sweep": list(settings.k_sweep), "stop_token_ids": backend.stop_ids},
        "seconds": round(time.perf_counter() - started, 2),
    }
    log.info("τ = %.3f (draft) vs %.3f (%s baseline) at k=%d over %d prompts, %d tokens; speedup over greedy "
             "%.2fx (draft), %.2fx (baseline)", result["tau"] or 0, result["baseline"]["tau"] or 0,
             result["baseline"]["kind"], settings.k, len(prompts), result["num_tokens"],
             result["speedup"]["draft"] or 0, result["speedup"]["baseline"] or 0)
    if ties:
        log.warning("%d near-tie(s) of the target's two best logits resolved differently by greedy and "
                    "speculative decoding (in lossless.numerical_ties); every token was checked",
                    len(ties))
    return result, runs


def _replay_check(replayed: dict[tuple[str, int], list[Generation]], decoded: dict[tuple[str, int], list[Generation]],
                  k: int, n_sweep: int) -> dict:
    """On how many of the sweep's prompts each replayed drafter's run at ``k`` is the loop's own
    (tokens, accepted and proposed per step): the replay's check where the sweep's τ at ``k`` is
    the decoded runs'. A prompt apart is a near-tie rounded otherwise by one pass over the text
    than by the loop's incremental steps, not an error: the runs at ``k`` were checked lossless."""
    def same(a: Generation, b: Generation) -> bool:
        return (a.tokens, a.accepted, a.proposed) == (b.tokens, b.accepted, b.proposed)

    equal = {name: sum(same(a, b) for a, b in zip(runs, decoded[name, k][:n_sweep]))
             for (name, at), runs in replayed.items() if at == k}
    for name, count in equal.items():
        if count < n_sweep:
            log.warning("the %s's replayed run at k=%d differs from the loop's on %d of %d prompts (a near-tie "
                        "rounded otherwise by one pass over the text); the sweep's other k are the replay's",
                        name, k, n_sweep - count, n_sweep)
    return {"k": k, "prompts": n_sweep, "equal_to_the_loop": equal}


def _replayable(backend: DecodingBackend, drafters: dict[str, DrafterSpec | Drafter]) -> dict[str, Drafter]:
    """The drafters whose k sweep is replayed on the target's greedy text (``replay_runs``) instead
    of decoded again at each k: the HF loop's EAGLE-3 draft and n-gram baseline."""
    if not isinstance(backend, HFDecoder):
        return {}
    loaded = {name: backend.drafter(spec) for name, spec in drafters.items()}
    return {name: drafter for name, drafter in loaded.items() if can_replay(drafter)}


def _decode(backend: DecodingBackend, prompts: Sequence[Prompt], drafters: dict[str, DrafterSpec | Drafter],
            settings: EvalSettings, sweep: list[int], n_sweep: int, outside: Sequence[OutsideRun],
            replayed: Collection[str]) -> tuple[list[Generation], dict[tuple[str, int], list[Generation]], list[dict]]:
    """Every prompt decoded greedily and by each drafter at ``k`` (and, for the drafters not
    ``replayed``, at each k of the sweep on the first ``n_sweep``), each speculative and ``outside``
    output checked against greedy decoding; returns the greedy runs, the speculative runs by
    (drafter, k), and the near-ties let through."""
    tolerance = TIE_TOLERANCE.get(backend.dtype, 1e-4)
    # One-time costs (allocations, lazy kernels) must not count against whichever runs first.
    warm = min(4, backend.max_new_tokens)
    backend.greedy(prompts[0], max_new_tokens=warm)
    for spec in drafters.values():
        backend.speculate(prompts[0], spec, settings.k, max_new_tokens=warm)

    greedy: list[Generation] = []
    decoded = [(name, k) for k in sweep for name in drafters if k == settings.k or name not in replayed]
    runs: dict[tuple[str, int], list[Generation]] = {job: [] for job in decoded}
    ties: list[dict] = []
    for i, prompt in enumerate(tqdm(prompts, desc="evaluating", unit=" prompts", file=sys.stderr,
                                    mininterval=PROGRESS_INTERVAL_S)):
        jobs = [(name, k) for name, k in decoded if k == settings.k or i < n_sweep]
        # Greedy runs first on even prompts and last on odd ones, so that whatever favours the
        # first or the last run of a prompt (caches, clock boost) cancels out of the speedup.
        if i % 2 == 0:
            reference = backend.greedy(prompt)
        generations = {(name, k): backend.speculate(prompt, drafters[name], k) for name, k in jobs}
        if i % 2 == 1:
            reference = backend.greedy(prompt)
        greedy.append(reference)
        for (name, k), generation in generations.items():
            found = check_lossless(reference, generation, label=f"{name} (k={k})", tolerance=tolerance,
                                   gap=partial(backend.logit_gap, prompt),
                                   greedy_after=partial(_greedy_after, backend, prompt))
            ties.extend({**tie, "k": k} for tie in found)
            runs[name, k].append(generation)
        for run in outside:
            found = check_lossless(reference, run.generations[i], label=run.label, tolerance=tolerance,
                                   gap=partial(backend.logit_gap, prompt),
                                   greedy_after=partial(_greedy_after, backend, prompt), problem=run.problem,
                                   candidate_name=run.candidate_name, fix=run.fix)
            ties.extend({**tie, "k": run.k} for tie in found)
    return greedy, runs, ties


def _speedup(backend: DecodingBackend, greedy: list[Generation], at_k: list[list[Generation]], main: dict) -> dict:
    """Wall-clock speedup over greedy decoding of the draft and the baseline (``at_k``: their runs
    at ``k``, in that order), overall and per prompt; None under MIN_TIMED_PROMPTS prompts."""
    greedy_seconds = sum(g.seconds for g in greedy)
    greedy_tokens = sum(len(g.tokens) for g in greedy)
    timed = len(greedy) >= MIN_TIMED_PROMPTS

    def speedup(name: str) -> float | None:
        return greedy_seconds / main[name]["seconds"] if timed and main[name]["seconds"] else None

    def spread(generations: list[Generation]) -> dict | None:
        """Quartiles of the per-prompt speedups: how much one prompt's timing varies."""
        ratios = [g.seconds / s.seconds for g, s in zip(greedy, generations) if s.seconds > 0]
        if not timed or not ratios:
            return None
        q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        return {"min": min(ratios), "q1": q1, "median": median, "q3": q3, "max": max(ratios)}

    return {
        "draft": speedup("draft"),
        "baseline": speedup("baseline"),
        "draft_per_prompt": spread(at_k[0]),
        "baseline_per_prompt": spread(at_k[1]),
        "greedy_seconds": round(greedy_seconds, 4),
        "draft_seconds": main["draft"]["seconds"],
        "baseline_seconds": main["baseline"]["seconds"],
        "greedy_tokens_per_second": greedy_tokens / greedy_seconds if greedy_seconds else None,
        "num_prompts": len(greedy),
        "measured": f"wall clock of the {backend.name} loops, one prompt at a time, on the same prompts"
                    + ("" if timed else f"; not reported: fewer than {MIN_TIMED_PROMPTS} prompts timed"),
    }


def _greedy_after(backend: DecodingBackend, prompt: Prompt, generated: list[int]) -> list[int]:
    """Greedy decoding's tokens after ``prompt`` + ``generated``, up to the same total length."""
    remaining = backend.max_new_tokens - len(generated)
    if remaining <= 0 or (generated and generated[-1] in backend.stop_ids):
        return []
    return backend.greedy(Prompt(prompt.id, [*prompt.ids, *generated]), max_new_tokens=remaining).tokens


def _describe(drafter: DrafterSpec | Drafter) -> dict:
    if isinstance(drafter, DrafterSpec):
        return drafter.describe()
    return {"kind": type(drafter).__name__}
