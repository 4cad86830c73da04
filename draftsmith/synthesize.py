"""Stage synthesize_conversations: conversations the target writes itself, its user turns included
(``data.sources: [self]``), for a user who has no chat data of the target's own distribution.

The technique is Magpie's (Xu et al., 2024, "Magpie: Alignment Data Synthesis from Scratch by
Prompting Aligned LLMs with Nothing"): a chat model given only what its chat template renders
before a user's text (the user turn's opening, after an optional system prompt) continues with a
user's request, as it has seen thousands in its own training, and stops at the template's end of
turn. The target then answers that request as it answers any prompt (the regeneration engine:
``regenerate.*`` decides the answers' backend, length and sampling). A system prompt per
conversation, cycled from ``synthesize.system_prompts``, steers the topics.

What is kept: a request that ended within ``max_prompt_tokens`` (one that did not is cut
mid-sentence), of at least ``min_prompt_chars`` characters, whose letters are in
``synthesize.scripts`` (all scripts when empty), and not already kept (compared lowercased, with
its whitespace collapsed), nor any prompt of the ``eval.sources`` prompt sets; each drop is counted
by reason in the stage's stats. Held-out prompts cannot leak into training either: prepare_dataset
holds out whole distinct prompts from every source, this one included.

Requests are written chunk by chunk (``synthesize.chunk_size`` tries each; a chunk's seeds derive
from the run's seed and its number), each chunk renamed into the work folder once whole, so a
killed job resumes at its first missing chunk; a fingerprint of the settings, the model and this
code guards the chunks. Chunks are added until ``synthesize.conversations`` distinct conversations
are kept; a target that keeps under ``MIN_YIELD`` of its tries is refused early, before it burns
hours of GPU on requests it cannot write. Its answers are judged as regeneration's are
(``regenerate.answering.check_answers``): empty ones are kept and counted, and more than
``data.max_bad_fraction`` of them stop the stage naming the target.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import sys
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from draftsmith.chat import UserTurn, user_turn
from draftsmith.errors import DataError, TargetError
from draftsmith.io import (
    atomic_write_json,
    atomic_write_text,
    lock_beside,
    publishing,
    read_json,
    read_jsonl,
    sole_writer,
)
from draftsmith.regenerate.answering import (
    Regenerator,
    TurnCounts,
    check_answers,
    derived_seed,
    mostly_empty_so_far,
    open_regenerators,
)
from draftsmith.regenerate.settings import RegenerateSettings
from draftsmith.regenerate.stage import regeneration_fingerprint
from draftsmith.settings import PROGRESS_INTERVAL_S, StageSettings, check_settings, from_schema
from draftsmith.targets.identity import weights_identity

log = logging.getLogger(__name__)

SYNTHESIZE_FORMAT = "draftsmith.synthesize/1"
MIN_YIELD = 0.02  # kept conversations per try, below which the stage stops (after its first chunk)
MAX_CHUNKS_FACTOR = 4  # chunks tried, at most, per chunk the wanted count needs at full yield


@dataclass(frozen=True)
class SynthesizeSettings(StageSettings):
    """The synthesize section of the config: how many conversations, and how the user turns are
    sampled and filtered. The answers follow ``RegenerateSettings``."""

    conversations: int = from_schema("synthesize.conversations")
    max_prompt_tokens: int = from_schema("synthesize.max_prompt_tokens")
    min_prompt_chars: int = from_schema("synthesize.min_prompt_chars")
    temperature: float = from_schema("synthesize.temperature")
    top_p: float = from_schema("synthesize.top_p")
    system_prompts: tuple[str, ...] = from_schema("synthesize.system_prompts")
    scripts: tuple[str, ...] = from_schema("synthesize.scripts")
    chunk_size: int = from_schema("synthesize.chunk_size")

    SECTION = "synthesize"

    def __post_init__(self) -> None:
        object.__setattr__(self, "system_prompts", tuple(self.system_prompts))
        object.__setattr__(self, "scripts", tuple(s.upper() for s in self.scripts))
        check_settings(self)


# ---------------------------------------------------------------------------------------------
# Filters


def normalized(text: str) -> str:
    """What two requests are compared by: lowercased, whitespace collapsed."""
    return " ".join(text.lower().split())


def scripts_of(text: str) -> Counter:
    """Letters of ``text`` by Unicode script (the first word of each letter's name: LATIN, CJK, ...)."""
    found: Counter = Counter()
    for ch in text:
        if ch.isalpha():
            found[unicodedata.name(ch, "UNKNOWN").split(" ")[0]] += 1
    return found


def drop_reason(text: str | None, settings: SynthesizeSettings, seen: set[str], excluded: set[str]) -> str | None:
    """Why a written request is not kept (``truncated``, ``short``, ``script``, ``duplicate``,
    ``evaluation``), or None. ``text`` None: it never reached the end of its turn."""
    if text is None:
        return "truncated"
    if len(text.strip()) < settings.min_prompt_chars:
        return "short"
    if settings.scripts:
        letters = scripts_of(text)
        if sum(letters[s] for s in settings.scripts) < 0.9 * sum(letters.values()):
            return "script"
    key = normalized(text)
    if key in excluded:
        return "evaluation"
    if key in seen:
        return "duplicate"
    return None


def evaluation_prompts(paths: Iterable[str | Path]) -> set[str]:
    """The normalized user turns of the eval.sources prompt sets (prepare_eval_prompts' outputs),
    which no written request may repeat."""
    found = set()
    for path in paths:
        for _, row in read_jsonl(path, error=DataError, fix="rerun prepare_eval_prompts"):
            users = [m for m in row.get("messages") or [] if m.get("role") == "user" and isinstance(m.get("content"), str)]
            if users:
                found.add(normalized(users[-1]["content"]))
    return found


# ---------------------------------------------------------------------------------------------
# Writing


def write_requests(prompter: Regenerator, turns: Sequence[UserTurn], seed: int) -> list[str | None]:
    """One request per turn opening, sampled by ``prompter``: its text, or None where it did not end
    within the token limit."""
    generated = prompter.generate([t.opening for t in turns], seed=seed)
    requests: list[str | None] = []
    for turn, tokens in zip(turns, generated):
        end = next((j for j, t in enumerate(tokens or ()) if t in turn.closing or t in prompter.stop_ids), None)
        requests.append(None if end is None else prompter.tokenizer.decode(tokens[:end], skip_special_tokens=True).strip())
    return requests


def synthesize_chunk(index: int, prompter: Regenerator, answerer: Regenerator, turns: Sequence[UserTurn],
                     settings: SynthesizeSettings, seed: int, excluded: set[str]) -> dict:
    """Chunk ``index``: ``chunk_size`` requests written and filtered (duplicates within the chunk
    dropped; across chunks when they are joined), the kept ones answered. Returns its rows, the
    requests dropped by reason, how many answers ``regenerate.max_new_tokens`` cut (kept: they are
    what the target wrote), and the answers' count, the empty ones' and the first of them (kept too:
    prepare_dataset drops them, and ``check_answers`` judges them when the chunks are joined)."""
    size = settings.chunk_size
    chunk_turns = [turns[(index * size + n) % len(turns)] for n in range(size)]
    requests = write_requests(prompter, chunk_turns, seed=derived_seed(seed, index, 0))
    dropped: Counter = Counter()
    kept, seen = [], set()
    for n, (turn, text) in enumerate(zip(chunk_turns, requests)):
        reason = drop_reason(text, settings, seen, excluded)
        if reason:
            dropped[reason] += 1
            continue
        seen.add(normalized(text))
        system = [{"role": "system", "content": turn.system}] if turn.system else []
        kept.append((n, [*system, {"role": "user", "content": text}, {"role": "assistant", "content": ""}]))
    sources = [{"file": "self", "line": index * size + n} for n, _ in kept]
    ids = [f"self-{index}-{n}" for n, _ in kept]
    answered, counts = answerer.regenerate([messages for _, messages in kept], seed=derived_seed(seed, index, 1),
                                           names=[{"id": i, **s} for i, s in zip(ids, sources)])
    rows = [{"id": i, "messages": messages, "source": s} for i, messages, s in zip(ids, answered, sources)]
    return {"rows": rows, "dropped": dict(dropped), "answers_cut": counts.truncated, "answers": counts.turns,
            "empty_answers": counts.empty, "first_empty": counts.first_empty}


def synthesize_conversations(model_path: str | Path, out_path: str | Path, stats_path: str | Path,
                             work_dir: str | Path, settings: SynthesizeSettings, answers: RegenerateSettings, *,
                             exclude: Sequence[str | Path] = (), trust_remote_code: bool = False,
                             engine_kwargs: dict | None = None) -> dict:
    """Write ``settings.conversations`` conversations the target in ``model_path`` wrote, user turns
    and answers, to ``out_path`` (OpenAI messages), their counts to ``stats_path``; ``exclude``:
    prompt sets (prepare_eval_prompts' outputs) no request may repeat."""
    work_dir = Path(work_dir)
    with sole_writer(lock_beside(work_dir), _writing(work_dir), str(work_dir), TargetError):  # one writer of the chunks
        return _synthesize(Path(model_path), out_path, stats_path, work_dir, settings, answers, exclude,
                           trust_remote_code, engine_kwargs)


def _writing(work_dir: Path) -> str:
    return f"writing the target's conversations in {work_dir}"


def _synthesize(model_path: Path, out_path: str | Path, stats_path: str | Path, work_dir: Path,
                settings: SynthesizeSettings, answers: RegenerateSettings, exclude: Sequence[str | Path],
                trust_remote_code: bool, engine_kwargs: dict | None) -> dict:
    from transformers import AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    where = f"{model_path} (its chat template)"
    turns = [user_turn(tokenizer, system, where) for system in (settings.system_prompts or (None,))]
    excluded = evaluation_prompts(exclude)
    fingerprint = _fingerprint(settings, answers, weights_identity(model_path), excluded)
    _prepare_work_dir(work_dir, fingerprint)
    prompt_sampling = replace(answers, max_new_tokens=settings.max_prompt_tokens, temperature=settings.temperature,
                              top_p=settings.top_p)
    with contextlib.ExitStack() as stack:
        opened: list[Regenerator] = []

        def write_chunk(index: int) -> dict:
            if not opened:  # the target loads only when a chunk is missing, not to join written ones
                opened.extend(stack.enter_context(open_regenerators(
                    model_path, tokenizer, (prompt_sampling, answers), trust_remote_code=trust_remote_code,
                    engine_kwargs=engine_kwargs, stop_ids=(turns[0].closing, None))))
            return synthesize_chunk(index, *opened, turns, settings, answers.seed, excluded)

        def judge(counts: TurnCounts) -> None:
            check_answers(counts, answers, tokenizer, model_path)

        rows, stats = _collect(work_dir, write_chunk, settings, excluded, judge)
    stats["seconds"] = round(time.perf_counter() - started, 2)
    with publishing(lock_beside(work_dir), _writing(work_dir), TargetError, [Path(out_path), Path(stats_path)]):
        atomic_write_text(out_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        atomic_write_json(stats_path, stats)
    log.info("wrote %d conversations of the target's own into %s from %d tries (%s dropped: %s)",
             len(rows), out_path, stats["tries"], sum(stats["dropped"].values()), stats["dropped"])
    return stats


def _collect(work_dir: Path, write_chunk: Callable[[int], dict], settings: SynthesizeSettings,
             excluded: set[str], judge: Callable[[TurnCounts], None]) -> tuple[list[dict], dict]:
    """Chunks, read back or written (``write_chunk``), joined without duplicates until the wanted count
    is kept. ``judge`` (``check_answers``) judges the answers written so far once more than half of
    enough of them are empty, and all of them at the end; a chunk keeps its answers' counts, so a
    rerun judges the chunks it reuses again."""
    wanted, size = settings.conversations, settings.chunk_size
    max_chunks = MAX_CHUNKS_FACTOR * math.ceil(wanted / size) + 1
    kept: list[dict] = []
    seen: set[str] = set()
    dropped: Counter = Counter()
    reused = tries = answers_cut = 0
    answers = TurnCounts()
    progress = tqdm(total=wanted, desc="writing conversations", unit=" conversations", file=sys.stderr,
                    mininterval=PROGRESS_INTERVAL_S)
    index = 0
    while len(kept) < wanted:
        if index >= max_chunks:
            raise DataError(f"the target wrote {len(kept)} distinct usable conversations in {tries} tries, short of "
                            f"synthesize.conversations={wanted} (dropped: {dict(dropped)})", where=str(work_dir),
                            fix="lower synthesize.conversations, add synthesize.system_prompts to vary the topics, "
                                "or raise synthesize.temperature")
        path = work_dir / f"chunk-{index:06d}.json"
        if path.is_file():
            chunk = read_json(path)
            reused += 1
        else:
            chunk = write_chunk(index)
            atomic_write_json(path, chunk)
        dropped.update(chunk["dropped"])
        answers_cut += chunk["answers_cut"]
        answers.add(TurnCounts(turns=chunk["answers"], empty=chunk["empty_answers"],
                               first_empty=chunk["first_empty"]))
        if mostly_empty_so_far(answers):
            judge(answers)  # not hours of chunks later
        tries += size
        for row in chunk["rows"]:
            key = normalized(_user_text(row))
            if key in seen:
                dropped["duplicate"] += 1
                continue
            seen.add(key)
            if len(kept) < wanted:
                kept.append(row)
        progress.update(len(kept) - progress.n)
        if len(seen) < MIN_YIELD * tries:
            raise DataError(f"the target kept {len(seen)} of {tries} requests it wrote (dropped: {dict(dropped)}): it "
                            "does not write user requests after its chat template's user-turn opening",
                            where=str(work_dir), fix="use data.sources of your own, or try synthesize.system_prompts")
        index += 1
    progress.close()
    judge(answers)
    return kept, {"format": SYNTHESIZE_FORMAT, "conversations": len(kept), "tries": tries, "chunks": index,
                  "chunks_reused": reused, "dropped": dict(dropped), "answers_cut": answers_cut,
                  "empty_answers": answers.empty,
                  "system_prompts": len(settings.system_prompts), "excluded_prompts": len(excluded)}


def _user_text(row: dict) -> str:
    return next(m["content"] for m in row["messages"] if m["role"] == "user")


# ---------------------------------------------------------------------------------------------
# The work folder


def _fingerprint(settings: SynthesizeSettings, answers: RegenerateSettings, model: dict, excluded: set[str]) -> str:
    """Everything that decides a chunk's rows: the user turns' settings, the answers' as they decide
    regenerated text (``regeneration_fingerprint``: the engine's numerics, the model, its code), the
    excluded prompts and this module's code; chunks written under another are stale."""
    from draftsmith.fingerprint import code_fingerprint

    payload = {"format": SYNTHESIZE_FORMAT, "settings": settings.section_values(),
               "answers": regeneration_fingerprint(answers, model=model, sources=[]),
               "excluded": hashlib.sha256("\n".join(sorted(excluded)).encode()).hexdigest(),
               "code": code_fingerprint("draftsmith.synthesize")}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=list).encode()).hexdigest()


def _prepare_work_dir(work_dir: Path, fingerprint: str) -> None:
    work_dir.mkdir(parents=True, exist_ok=True)
    marker = work_dir / "fingerprint.json"
    if not marker.is_file() or read_json(marker).get("fingerprint") != fingerprint:
        stale = sorted(work_dir.glob("chunk-*"))
        if stale:
            log.info("settings, model or code changed since %d chunk files were written in %s: discarding them",
                     len(stale), work_dir)
        for path in stale:
            path.unlink()
        atomic_write_json(marker, {"format": SYNTHESIZE_FORMAT, "fingerprint": fingerprint})
