"""Stage regenerate_responses: the conversations of the data sources with the target's own answers,
chunk by chunk (``regenerate.chunk_size`` conversations each, renamed into the work folder once
whole), guarded by a fingerprint of what decides the text; the package's docstring says how."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

from tqdm import tqdm

from draftsmith.bad_rows import BadRow, Tally
from draftsmith.conversations import answer_turns, load_conversations
from draftsmith.engines.hf_model import resolve_device, stage_model_dtype
from draftsmith.engines.shared import SharedEngine
from draftsmith.errors import DataError, TargetError
from draftsmith.io import (
    atomic_write_json,
    atomic_write_text,
    fsync_dir,
    lock_beside,
    publishing,
    read_json,
    read_jsonl,
    sha256_file,
    sole_writer,
)
from draftsmith.regenerate.answering import (
    Regenerator,
    TurnCounts,
    check_answers,
    mostly_empty_so_far,
    open_regenerators,
)
from draftsmith.regenerate.settings import RegenerateSettings
from draftsmith.settings import PROGRESS_INTERVAL_S
from draftsmith.targets.identity import weights_identity
from draftsmith.targets.vllm_install import engine_release

log = logging.getLogger(__name__)

REGENERATE_FORMAT = "draftsmith.regenerate/1"


def _source_identity(source: Path) -> dict:
    if source.is_dir():
        return {str(p.relative_to(source)): sha256_file(p) for p in sorted(source.rglob("*")) if p.is_file()}
    return {source.name: sha256_file(source)}


def regeneration_fingerprint(settings: RegenerateSettings, *, model: dict, sources: Sequence[str | Path],
                             shared_context: int | None = None) -> str:
    """Hash of everything that decides the regenerated text; chunks written under another are stale.
    ``shared_context``: vLLM decodes in the engine shared with capture (``engines.shared``), whose
    context gives each answer that many positions (``regeneration_context``)."""
    from draftsmith.fingerprint import code_fingerprint

    generation = settings.section_values()
    generation.pop("enabled")
    eager = generation.pop("enforce_eager")
    if settings.greedy:
        # Greedy answers depend on none of these; sampled ones on all (the random stream).
        generation.pop("top_p")
        generation.pop("chunk_size")
    else:
        generation.update(seed=settings.seed)
    device = resolve_device(settings.device)
    # The engine's numerics by what they resolve to ("auto" on this machine), so a config that
    # names what auto chose keeps the chunks; vLLM's tensor parallel size only where vLLM runs.
    numerics = {"dtype": stage_model_dtype(settings),
                "device": device.split(":")[0],
                "tensor_parallel_size": settings.tensor_parallel_size if settings.backend == "vllm" else 1}
    if eager and settings.backend == "vllm" and numerics["device"] == "cuda":  # other kernels than CUDA graphs'
        numerics["enforce_eager"] = True
    if shared_context:  # the target verifies the slot's drafts (other kernels) in a context of this size
        numerics["shared_engine_context"] = shared_context
    numerics.update(engine_release(settings.backend))
    payload = {
        "format": REGENERATE_FORMAT,
        "generation": generation,
        "model": model,
        "numerics": numerics,
        "sources": [{"path": str(s), "content": _source_identity(Path(s))} for s in sources],
        # this module and the draftsmith modules it imports (reading conversations, loading the target),
        # not tokenising or masking: a patch to prepare_dataset keeps regenerated answers
        "code": code_fingerprint("draftsmith.regenerate.stage"),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()



def _chunk_path(work_dir: Path, index: int) -> Path:
    return work_dir / f"chunk-{index:06d}.jsonl"


def _counts_path(chunk: Path) -> Path:
    return chunk.with_suffix(".counts.json")


def _kept_chunk(path: Path, ids: list[str]) -> TurnCounts | None:
    """What a finished chunk's regeneration produced (its answers judged again with the rest), or
    None when it is missing, lacks its counts, or is not the chunk expected here."""
    if not path.is_file() or not _counts_path(path).is_file():
        return None
    rows = [row for _, row in read_jsonl(path, error=DataError, fix=f"delete {path}: the rerun regenerates it")]
    if [r.get("id") for r in rows] != ids:
        log.warning("%s does not hold the conversations expected there; regenerating it", path)
        return None
    return TurnCounts(**read_json(_counts_path(path)))


def _prepare_work_dir(work_dir: Path, fingerprint: str) -> None:
    """Drop chunks written under another fingerprint, then record this one."""
    work_dir.mkdir(parents=True, exist_ok=True)
    marker = work_dir / "fingerprint.json"
    old = read_json(marker).get("fingerprint") if marker.is_file() else None
    stale = sorted(work_dir.glob("chunk-*"))
    if old != fingerprint:
        if stale:
            log.info("settings, model, sources or code changed since %d chunks were written in %s: "
                     "discarding them", sum(p.suffix == ".jsonl" for p in stale), work_dir)
        for path in stale:
            path.unlink()
        atomic_write_json(marker, {"format": REGENERATE_FORMAT, "fingerprint": fingerprint})


def _answer_count(conv: Any) -> int:
    """Assistant turns the regeneration answers in one conversation (none in a plain-text row)."""
    return len(answer_turns(conv.messages)) if conv.is_chat else 0


class SourceCounts(NamedTuple):
    """What regeneration has to do: the usable conversations and the answers it writes."""

    conversations: int
    answers: int


def count_conversations(sources: Sequence[str | Path], max_bad_fraction: float) -> SourceCounts:
    """Count the usable conversations of ``sources`` and their answers, before the target loads.
    More than ``max_bad_fraction`` bad rows raise ``DataError`` as prepare_dataset would raise it:
    that stage reads the regenerated rows only, where the bad rows are gone."""
    tally = Tally(max_bad_fraction)
    conversations = answers = 0
    for row in load_conversations(sources, regenerating=True):  # streamed: counts only
        tally.read += 1
        if isinstance(row, BadRow):
            tally.bad(row)
        else:
            conversations, answers = conversations + 1, answers + _answer_count(row)
    tally.check()
    if conversations == 0:
        raise DataError(f"no usable conversations in {', '.join(map(str, sources))}",
                        where=", ".join(map(str, sources)),
                        fix="check data.sources; the log names the first bad rows and why")
    return SourceCounts(conversations, answers)


def _chunks(rows: Iterator, chunk_size: int, bad: Counter) -> Iterator[list]:
    chunk: list = []
    for row in rows:
        if isinstance(row, BadRow):
            bad[row.reason] += 1
            continue
        chunk.append(row)
        if len(chunk) == chunk_size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _output_row(conv: Any, messages: list[dict] | None) -> dict:
    source = {"file": conv.file, "line": conv.line}
    if messages is None:  # a plain-text row: nothing to answer, passed through
        return {"id": conv.id, "text": conv.text, "source": source}
    return {"id": conv.id, "messages": messages, **({"tools": conv.tools} if conv.tools else {}), "source": source}


def regenerate_conversations(sources: Sequence[str | Path], regenerator: Regenerator, out_path: str | Path,
                             work_dir: str | Path, fingerprint: str, counted: SourceCounts, *,
                             target: str | Path) -> dict:
    """Regenerate every conversation of ``sources`` (``counted``: ``count_conversations``'s answer)
    chunk by chunk (``regenerate.chunk_size`` conversations each) into ``work_dir``, then write
    them, in source order, to ``out_path``; chunks already there under ``fingerprint`` are kept.
    More than ``data.max_bad_fraction`` empty answers raise ``TargetError`` naming ``target``
    (the model folder) before ``out_path`` is written, as ``check_answers`` says."""
    started = time.perf_counter()
    work_dir, out_path = Path(work_dir), Path(out_path)
    _prepare_work_dir(work_dir, fingerprint)
    total, total_answers = counted
    bad: Counter = Counter()
    counts = TurnCounts()
    reused = written = text_rows = 0
    # The bar counts answers, batch by batch, so a large chunk still shows its progress.
    progress = tqdm(total=total_answers, desc="regenerating", unit=" answers", file=sys.stderr,
                    mininterval=PROGRESS_INTERVAL_S)
    regenerator.on_answers = progress.update
    done_answers = 0
    try:
        chunk_size = regenerator.settings.chunk_size
        for index, chunk in enumerate(_chunks(load_conversations(sources, regenerating=True), chunk_size, bad)):
            path = _chunk_path(work_dir, index)
            text_rows += sum(not c.is_chat for c in chunk)
            kept = _kept_chunk(path, [c.id for c in chunk])
            if kept is not None:
                counts.add(kept)  # judged with the rest: a rerun, or a job killed before the last check
                reused += 1
            else:
                chats = [c for c in chunk if c.is_chat]
                messages, chunk_counts = regenerator.regenerate(
                    [c.messages for c in chats], seed=index, tools=[c.tools for c in chats],
                    names=[{"id": c.id, "file": c.file, "line": c.line} for c in chats])
                counts.add(chunk_counts)
                answered = dict(zip(map(id, chats), messages))
                rows = [_output_row(c, answered.get(id(c))) for c in chunk]
                atomic_write_json(_counts_path(path), asdict(chunk_counts))  # first: a chunk never lacks its counts
                atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
                written += 1
            if mostly_empty_so_far(counts):
                _stop_on_empty_answers(counts, regenerator, target, work_dir)  # not hours of chunks later
            done_answers += sum(map(_answer_count, chunk))
            progress.update(done_answers - progress.n)  # reused chunks, and answers left as they were
    finally:
        progress.close()
        regenerator.on_answers = None
    num_chunks = reused + written
    _stop_on_empty_answers(counts, regenerator, target, work_dir)
    with publishing(lock_beside(work_dir), f"regenerating answers in {work_dir}", TargetError, [out_path]):
        _concatenate([_chunk_path(work_dir, i) for i in range(num_chunks)], out_path)
    stats = {
        "conversations": total, "chunks": num_chunks, "chunks_reused": reused, "chunks_generated": written,
        "turns_generated": counts.turns, "tokens_generated": counts.tokens,
        "turns_truncated": counts.truncated, "empty_answers": counts.empty, "turns_past_the_context": counts.unanswered,
        "text_rows_passed_through": text_rows, "conversations_unchanged": counts.unchanged,
        "bad_rows_skipped": dict(bad),
        "seconds": round(time.perf_counter() - started, 2),
    }
    log.info("regenerated %d conversations into %s: %d chunks generated, %d reused; %d turns, %d tokens "
             "(%d cut at max_new_tokens, %d empty); %d bad rows skipped %s",
             total, out_path, written, reused, counts.turns, counts.tokens, counts.truncated, counts.empty,
             sum(bad.values()), dict(bad) or "")
    if counts.unanswered:
        log.warning("%d turns are not answered: the conversation before each fills the engine's context, so "
                    "nothing from them on could be trained; their conversations end after the last answer",
                    counts.unanswered)
    if counts.turns and counts.truncated / counts.turns > 0.5:
        log.warning("%d of %d answers hit regenerate.max_new_tokens=%d: the draft will learn cut-off answers; "
                    "raise regenerate.max_new_tokens", counts.truncated, counts.turns,
                    regenerator.settings.max_new_tokens)
    return stats


def _stop_on_empty_answers(counts: TurnCounts, regenerator: Regenerator, target: str | Path, work_dir: Path) -> None:
    """``check_answers``; when it refuses, the chunks are dropped (they hold the answers judged), so a
    rerun regenerates and judges them again rather than reusing them unjudged."""
    try:
        check_answers(counts, regenerator.settings, regenerator.tokenizer, target)
    except TargetError:
        for path in work_dir.glob("chunk-*"):
            path.unlink()
        raise


def _concatenate(parts: list[Path], out_path: Path) -> None:
    """Write the parts one after another to ``out_path``, visible only once complete."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, out_path)
    fsync_dir(out_path.parent)


def regenerate_responses(sources: Sequence[str | Path], model_path: str | Path, out_path: str | Path,
                         work_dir: str | Path, settings: RegenerateSettings, *, trust_remote_code: bool = False,
                         engine_kwargs: dict | None = None, shared_engine: SharedEngine | None = None) -> dict:
    """Load the target in ``model_path`` (transformers or vLLM, per ``settings.backend``) and write
    ``out_path``: the conversations of ``sources`` with the target's own answers (OpenAI messages,
    same ids, plus ``source``). ``engine_kwargs`` are vLLM's; with ``shared_engine`` vLLM decodes in
    the engine capture and evaluation share (``engines.shared``), started here when none is warm."""
    from transformers import AutoTokenizer

    counted = count_conversations(sources, settings.max_bad_fraction)  # bad data stops before any load
    model_path, work_dir = Path(model_path), Path(work_dir)
    fingerprint = regeneration_fingerprint(settings, model=weights_identity(model_path), sources=sources,
                                           shared_context=shared_engine.regeneration if shared_engine else None)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    # one writer of the chunks (an orphaned job's and its rerun's would mix), before the target loads
    with (sole_writer(lock_beside(work_dir), f"regenerating answers in {work_dir}", str(work_dir), TargetError),
          open_regenerators(model_path, tokenizer, [settings], trust_remote_code=trust_remote_code,
                            engine_kwargs=engine_kwargs, shared_engine=shared_engine) as [regenerator]):
        return regenerate_conversations(sources, regenerator, out_path, work_dir, fingerprint, counted,
                                        target=model_path)
