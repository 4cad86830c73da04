"""Stage evaluate_draft: the held-out prompts, the backend, the runs, acceptance.json."""

from __future__ import annotations

import logging
from pathlib import Path

from draftsmith.engines.shared import SharedEngine
from draftsmith.errors import EvaluationError
from draftsmith.evaluate.decoding import make_decoder
from draftsmith.evaluate.metrics import evaluate_runs
from draftsmith.evaluate.settings import DrafterSpec, EvalSettings, read_prompts
from draftsmith.evaluate.vllm import evaluate_in_vllm, serve_with_vllm, vllm_outside_runs, vllm_section
from draftsmith.io import atomic_write_json, lock_beside, publishing, sole_writer

log = logging.getLogger(__name__)


def evaluate_draft(draft_dir: str | Path, target_json: str | Path, heldout_jsonl: str | Path,
                   out_path: str | Path, settings: EvalSettings, *, engine_kwargs: dict | None = None,
                   sources: dict[str, str | Path] | None = None, shared_engine: SharedEngine | None = None) -> dict:
    """Evaluate the EAGLE-3 draft in ``draft_dir`` against the n-gram baseline on the held-out
    prompts and write acceptance.json to ``out_path``; ``engine_kwargs`` go to vLLM's engines.
    ``sources`` (name -> prompts in heldout.jsonl's format, from prepare_eval_prompts) are evaluated
    the same way, each reported on its own under ``sources``. ``shared_engine``: the draft is served
    in the engine capture ran in (draftsmith.engines.shared).

    One of three modes runs: the HF loop alone (``eval.backend: hf``, ``_in_hf_loop``); vLLM alone
    (``eval.backend: vllm``, ``_in_vllm_alone``); or with ``eval.hf_check`` the draft served by vLLM
    and checked against the HF loop (``_served_and_in_hf_loop``), where the HF loop can hold the target.
    The job is the only writer of ``out_path``'s folder (``io.sole_writer``): an orphaned evaluation of
    an older draft must not write over its rerun's.
    """
    out_dir = Path(out_path).parent
    doing = f"evaluating a draft into {out_dir}"
    with sole_writer(lock_beside(out_dir), doing, str(out_dir), EvaluationError):
        result = _evaluate(draft_dir, target_json, heldout_jsonl, settings, engine_kwargs, sources, shared_engine)
        with publishing(lock_beside(out_dir), doing, EvaluationError, [Path(out_path)]):
            atomic_write_json(out_path, result)
    return result


def _evaluate(draft_dir: str | Path, target_json: str | Path, heldout_jsonl: str | Path, settings: EvalSettings,
              engine_kwargs: dict | None, sources: dict[str, str | Path] | None,
              shared_engine: SharedEngine | None) -> dict:
    from draftsmith.draft.speculators_format import check_draft_folder
    from draftsmith.engines.hf_model import model_dtype_name, resolve_device
    from draftsmith.targets.inspect import read_target_json

    target = read_target_json(target_json)
    check_draft_folder(draft_dir, EvaluationError)
    prompts = read_prompts(heldout_jsonl, settings.max_prompts)
    _warn_past_context(target, prompts, settings, heldout_jsonl)
    sources = sources or {}
    if settings.backend == "hf":
        _hf_loop_holds(target, settings)  # stops a target the HF loop cannot hold
        result = _in_hf_loop(target, draft_dir, prompts, settings, sources)
    else:
        if not prompts:
            raise EvaluationError("no held-out prompts to evaluate", where=str(heldout_jsonl),
                                  fix="raise data.heldout_fraction or data.max_heldout")
        engine = {"dtype": model_dtype_name(settings.model_dtype, resolve_device(settings.device)),
                  "tensor_parallel_size": settings.tensor_parallel_size,
                  "enforce_eager": settings.enforce_eager, **(engine_kwargs or {})}
        if settings.hf_check and _hf_loop_holds(target, settings):
            result = _served_and_in_hf_loop(target, draft_dir, prompts, settings, sources, engine, shared_engine)
        else:
            result = _in_vllm_alone(target, draft_dir, prompts, settings, sources, engine, shared_engine)
    result["settings"].update(target=target["model_path"], heldout=str(heldout_jsonl))
    return result


def _warn_past_context(target: dict, prompts: list, settings: EvalSettings, where: str | Path) -> None:
    """Say how many prompts plus eval.max_new_tokens run past the target's context (preflight
    refuses only what overflows on every prompt: how many do depends on the prompts)."""
    context = (target.get("text_config") or {}).get("max_position_embeddings")
    over = sum(len(p.ids) + settings.max_new_tokens > context for p in prompts) if context else 0
    if over:
        log.warning("%d of %d prompts in %s plus eval.max_new_tokens=%d run past the target's context of %d "
                    "positions: the HF loop decodes past it, vLLM refuses them; lower eval.max_new_tokens or "
                    "data.max_seq_len", over, len(prompts), where, settings.max_new_tokens, context)


def _hf_loop_holds(target: dict, settings: EvalSettings) -> bool:
    """Whether the HF loop can hold the target (checked before any engine starts); a target too
    large for one GPU is evaluated in vLLM alone where eval.backend is vllm (eval.hf_check is then
    ignored, with a warning), and stops otherwise."""
    from draftsmith.engines.hf_model import resolve_device
    from draftsmith.errors import TargetError
    from draftsmith.targets.inspect import check_fits_devices

    if not (resolve_device(settings.device).startswith("cuda") and "num_parameters" in target):
        return True
    try:
        check_fits_devices(target, {"evaluate_draft": 1}, dtype=settings.model_dtype)
    except TargetError as e:
        if settings.backend != "vllm":
            raise
        log.warning("the HF loop cannot hold the target (%s): evaluating in vLLM alone", e.what)
        return False
    return True


def _stop_ids(target: dict) -> list[int]:
    from draftsmith.engines.hf_model import stop_ids_from_files

    return stop_ids_from_files(target["model_path"], trust_remote_code=target.get("trust_remote_code", False))


def _in_vllm_alone(target: dict, draft_dir: str | Path, prompts: list, settings: EvalSettings,
                   sources: dict[str, str | Path], engine: dict, shared: SharedEngine | None) -> dict:
    """The draft served by vLLM at ``k``, each served token checked against the target's argmax, the
    n-gram baseline replayed on the same text (or both as separate vLLM engines)."""
    sets = {name: read_prompts(path, settings.max_prompts) for name, path in sources.items()}
    result = evaluate_in_vllm(target, draft_dir, prompts, settings, stop_ids=_stop_ids(target), sources=sets,
                              shared=shared, **engine)
    for name, path in sources.items():
        result["sources"][name] = source_section(result["sources"][name], path)
    return result


def _served_and_in_hf_loop(target: dict, draft_dir: str | Path, prompts: list, settings: EvalSettings,
                           sources: dict[str, str | Path], engine: dict, shared: SharedEngine | None) -> dict:
    """The draft served by vLLM (its engines closed, or asleep, before the HF loop loads the target,
    so the two never share the GPU), its outputs checked against the HF loop's greedy decoding;
    vLLM's figures go under ``vllm``."""
    served = serve_with_vllm(target, draft_dir, prompts, settings, stop_ids=_stop_ids(target), shared=shared, **engine)
    return _in_hf_loop(target, draft_dir, prompts, settings, sources, served=served)


def _in_hf_loop(target: dict, draft_dir: str | Path, prompts: list, settings: EvalSettings,
                sources: dict[str, str | Path], *, served=None) -> dict:
    """The draft and the n-gram baseline in the HF speculative loop, on the held-out prompts and on
    each prompt set; with ``served``, vLLM's run of the same prompts is checked and reported too."""
    decoder = make_decoder(target, max_new_tokens=settings.max_new_tokens, dtype=settings.model_dtype,
                           device=settings.device)
    if served is not None and served.stop_ids != decoder.stop_ids:
        raise EvaluationError(f"vLLM was run with stop tokens {served.stop_ids}, the loaded target stops at "
                              f"{decoder.stop_ids}", where=f"{target['model_path']}/generation_config.json",
                              fix="set eos_token_id in the model's generation_config.json")
    log.info("evaluating %s on %d held-out prompts with %s (%s backend, %s)", draft_dir, len(prompts),
             target["model_path"], settings.backend, decoder.describe_device())
    outside = vllm_outside_runs(served, settings.k) if served is not None else []
    drafters = DrafterSpec("eagle3", path=str(draft_dir)), DrafterSpec("ngram", ngram_max=settings.ngram_max)
    result, runs = evaluate_runs(decoder, prompts, *drafters, settings, outside)
    if served is not None:
        result["vllm"] = vllm_section(served, result, runs["draft", settings.k], settings.k)
        log.info("vLLM serving the draft: τ = %.3f (HF loop %.3f) at k=%d; speedup over vLLM greedy %.2fx",
                 result["vllm"]["tau"] or 0, result["tau"] or 0, settings.k, result["vllm"]["speedup"] or 0)
    if sources:
        result["sources"] = {name: _evaluate_set(decoder, name, path, drafters, settings)
                             for name, path in sources.items()}
    return result


def _evaluate_set(decoder, name: str, path: str | Path, drafters: tuple[DrafterSpec, DrafterSpec],
                  settings: EvalSettings) -> dict:
    """One eval.sources prompt set through the HF loop, as the held-out prompts (vLLM's serving
    check covers the held-out prompts only: each set would be two more engine starts)."""
    log.info("evaluating the prompt set %s (%s)", name, path)
    found, _ = evaluate_runs(decoder, read_prompts(path, settings.max_prompts), *drafters, settings)
    return source_section(found, path)


def source_section(result: dict, path: str | Path) -> dict:
    """acceptance.json's entry for one prompt set: its figures, less what the whole evaluation shares
    (format, drafter, device, settings)."""
    shared = ("format", "draft", "device", "settings", "vllm", "reference")
    return {"prompts": str(path), **{k: v for k, v in result.items() if k not in shared}}
