"""Stage prepare_dataset: read conversations, apply the target's chat template, mask the
assistant's tokens, and split off held-out prompts.

Data flows top-down through this module: sources are read row by row (``draftsmith.sources``)
and normalized (``draftsmith.conversations``: each row to OpenAI-style messages or plain text, or
reported as a bad row with its reason), ids and prompts are collected and split (``split_heldout``:
one row per held-out prompt, every other row asking it kept out of training), and a second pass
tokenizes the rows that are kept (``ChatRenderer``) and streams them to ``train.jsonl`` and
``heldout.jsonl``. Both passes hand chunks of rows to worker processes (``draftsmith.parallel``)
and take the results back in row order: the main process alone counts, names bad rows and writes,
so the output is the same for any number of workers.

prepare_eval_prompts (``draftsmith.eval_prompts``) reads its prompt sets with the bad-row accounting
this stage uses (``draftsmith.bad_rows``, which regeneration shares) and this
stage's output files (``PendingFile``) and id deduplication (``unique_id``).
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import json
import logging
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

from draftsmith.bad_rows import READ_REASONS, REASON_FIXES, BadRow, Tally, row_where
from draftsmith.chat import (
    ChatRenderer,
    ChatTemplateError,
    TokenizerFailure,
    encode_text,
    load_tokenizer,
    require_chat_template,
)
from draftsmith.conversations import (  # noqa: F401 - Conversation and load_conversations are part of this stage's API too
    Conversation,
    Row,
    check_format,
    first_answer,
    line_id,
    load_conversations,
    to_row,
)
from draftsmith.errors import DataError
from draftsmith.io import atomic_write_json, fsync_dir, share_mode, storage_error
from draftsmith.parallel import ordered_map
from draftsmith.settings import PROGRESS_INTERVAL_S, StageSettings, check_settings, data_format, from_schema
from draftsmith.sources import RawRow, max_line_bytes, read_rows

log = logging.getLogger(__name__)

# Every reason a row can be dropped for; stats.json lists them all, zeros included, so its
# schema does not depend on the data.
REASONS = (*READ_REASONS, "too_long_prompt", "template_error", "tokenizer_error")

# Rows a worker takes at a time: at 700 tokens a row, 0.7 s of one core's rendering and tokenizing
# (bench/data_stages.py), so handing them over costs little beside it; and at most CHUNK_BYTES of
# jsonl, so long rows do not make a chunk large.
CHUNK_ROWS = 256
CHUNK_BYTES = 8 << 20

CHANGED_FIX = "do not modify the data sources while the workflow runs"


@dataclass(frozen=True)
class DataSettings(StageSettings):
    """The data section of the config (plus the run's seed); defaults and ranges from the schema."""

    max_seq_len: int = from_schema("data.max_seq_len")
    heldout_fraction: float = from_schema("data.heldout_fraction")
    max_heldout: int = from_schema("data.max_heldout")
    max_bad_fraction: float = from_schema("data.max_bad_fraction")
    max_samples: int | None = from_schema("data.max_samples")
    seed: int = from_schema("seed")
    format: str = from_schema("data.format")

    SECTION = "data"
    # config keys of the section that are not settings of this stage, and why
    NOT_SETTINGS = {"sources": "the rule's inputs (prepare_dataset's sources argument)"}
    ALSO_READS = ("regenerate.enabled",)

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def from_config(cls, config: Mapping) -> DataSettings:
        # regenerate_responses writes its conversations as messages rows, whatever format the sources had
        return replace(super().from_config(config), format=data_format(config))


# ---------------------------------------------------------------------------------------------
# Held-out split


def _score(seed: int, salt: str, row_id: str) -> int:
    digest = hashlib.sha256(f"{seed}\0{salt}\0{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def prompt_key(messages: list[dict], tools: list[dict] | None = None) -> bytes:
    """Identifies a conversation's prompt: its turns before the first answer (and its tools)."""
    first = first_answer(messages)
    prompt = messages[:first] if tools is None else [tools, messages[:first]]
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode("utf-8")).digest()[:16]


def split_heldout(prompt_keys: Mapping[str, bytes], settings: DataSettings) -> set[str]:
    """The ids held out for evaluation, one row per held-out prompt (``prompt_keys``: each chat
    row's id -> its prompt key): round(heldout_fraction * distinct prompts), at least 1, at most
    max_heldout. The prompts, and each one's row, are chosen by a hash of the seed and the prompt
    (the id), so the choice depends on neither row order nor the other rows beyond the count."""
    rows_of: dict[bytes, list[str]] = {}
    for row_id, key in prompt_keys.items():
        rows_of.setdefault(key, []).append(row_id)
    if not rows_of:
        return set()
    n = min(settings.max_heldout, len(rows_of), max(1, round(settings.heldout_fraction * len(rows_of))))
    # A prompt asked in several rows is decoded once: evaluating it twice would weigh it twice.
    prompts = heapq.nsmallest(n, rows_of, key=lambda key: _score(settings.seed, "heldout", key.hex()))
    return {min(rows_of[key], key=lambda i: _score(settings.seed, "heldout", i)) for key in prompts}


def _sample_train(ids: Iterable[str], settings: DataSettings) -> set[str] | None:
    """The train ids kept under max_samples (None = all), a seeded hash sample, not the first N,
    so a source sorted by topic still gives a mixed sample."""
    if settings.max_samples is None:
        return None
    return set(heapq.nsmallest(settings.max_samples, ids, key=lambda i: _score(settings.seed, "train", i)))


# ---------------------------------------------------------------------------------------------
# The stage


def render_failure(row: Conversation, error: ChatTemplateError | TokenizerFailure) -> BadRow:
    """A row the chat template or the tokenizer could not render, as a bad row."""
    reason = "template_error" if isinstance(error, ChatTemplateError) else "tokenizer_error"
    return BadRow(row.file, row.line, reason, error.what)


class _TooLong(Exception):
    """Internal: nothing trainable survives truncation to max_seq_len."""


def _json_line(row: dict) -> str:
    return json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n"


class PendingFile:
    """A file written under a temporary name beside its destination and renamed into place by
    ``commit``; dropped when the ``with`` block fails, so a crash leaves no partial output."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, self.tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            share_mode(fd)
        except OSError as e:
            raise storage_error(path, e) from e
        self.file = os.fdopen(fd, "w", encoding="utf-8")

    def write_row(self, row: dict) -> None:
        self.write_line(_json_line(row))

    def write_line(self, line: str) -> None:
        try:
            self.file.write(line)
        except OSError as e:
            raise storage_error(self.path, e) from e

    def __enter__(self) -> PendingFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.file.closed:
            with contextlib.suppress(OSError):  # a full disk fails the close's flush too
                self.file.close()
        if exc_type is not None:
            Path(self.tmp).unlink(missing_ok=True)

    def commit(self) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise storage_error(self.path, e) from e
        fsync_dir(self.path.parent)


def unique_id(row_id: str, seen: set[str]) -> str:
    if row_id not in seen:
        return row_id
    n = 2
    while f"{row_id}#{n}" in seen:
        n += 1
    return f"{row_id}#{n}"


def _progress(rows: Iterable, desc: str, total: int | None = None) -> Iterable:
    return tqdm(rows, desc=desc, total=total, unit=" rows", file=sys.stderr,
                mininterval=PROGRESS_INTERVAL_S)


def _chunks(rows: Iterable, raw_of=lambda row: row) -> Iterator[list]:
    """``rows`` in lists of CHUNK_ROWS, or fewer when their jsonl lines (``raw_of`` a row: its
    ``RawRow``) reach CHUNK_BYTES."""
    chunk, size = [], 0
    for row in rows:
        chunk.append(row)
        raw = raw_of(row)[2]
        size += len(raw) if isinstance(raw, bytes) else 0
        if len(chunk) == CHUNK_ROWS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _nothing_to_train(names: str, tally: Tally, counts: Counter, heldout: int,
                      settings: DataSettings) -> DataError:
    """Why no train row is left, naming the cause that removed the most rows and its fix."""
    causes = {f"held out for evaluation: {heldout}": heldout,
              f"same prompt as a held-out row: {counts['same_prompt_as_heldout']}": counts["same_prompt_as_heldout"],
              **{f"{reason}: {n}": n for reason, n in tally.dropped.items() if n}}
    summary = ", ".join(c for c, n in causes.items() if n)
    if counts["same_prompt_as_heldout"] and counts["same_prompt_as_heldout"] >= max(tally.dropped.values(), default=0):
        return DataError(
            f"no trainable rows in {names}: every row that is not held out shares its prompt (the turns "
            f"before the first answer) with a held-out row, and is kept out of training so the evaluation "
            f"prompts stay unseen ({summary})", where=names,
            fix="give conversations with more distinct prompts (many answers to one prompt leave nothing "
                "to train on once that prompt is held out)")
    reason, _ = tally.dropped.most_common(1)[0] if tally.dropped else ("", 0)
    fix = {**REASON_FIXES, **tally.fixes}.get(reason, "see the bad rows in the log")
    if reason == "too_long_prompt":
        fix = f"raise data.max_seq_len (now {settings.max_seq_len})"
    first = tally.first_bad[0] if tally.first_bad else None
    return DataError(f"no trainable rows in {names} ({summary or 'every row was held out'})",
                     where=f"first bad row {row_where(first['file'], first['line'])} ({first['reason']}: "
                           f"{first['detail']})" if first else names,
                     fix=fix if reason else "give more usable rows")


def _no_prompts(names: str, rows: int) -> DataError:
    """Why nothing can be held out: no usable row is a conversation."""
    return DataError(
        f"no prompt to hold out for evaluation in {names}: all {rows} usable rows are plain text (data.format: "
        "text, or rows with a 'text' field), which hold no prompt for evaluate_draft to answer", where=names,
        fix="add conversation rows (user and assistant turns in 'messages') to data.sources, with data.format: auto "
            "(or messages); text rows still train the draft beside them")


def _no_heldout_prompt(names: str, bad_heldout: list[BadRow], tally: Tally) -> DataError:
    """Why no held-out prompt is left: every row the split held out is a bad row (held-out rows are
    rendered whole, as train rows are, so a row is bad wherever the split puts it)."""
    counts = Counter(row.reason for row in bad_heldout)
    reason, _ = counts.most_common(1)[0]
    first = bad_heldout[0]
    how = {**REASON_FIXES, **tally.fixes}.get(reason, "repair or drop the rows the log names")
    return DataError(
        f"no held-out prompt left in {names}: each of the {len(bad_heldout)} rows held out for evaluation is a bad "
        f"row ({', '.join(f'{r}={n}' for r, n in counts.most_common())}), so evaluate_draft would have no prompt "
        "to decode", where=f"first held-out bad row {first.where} ({first.reason}: {first.detail})",
        fix=f"{reason}: {how}; or raise data.heldout_fraction (and data.max_heldout) so more prompts are held out")


def prepare_dataset(sources: Sequence[str | Path], tokenizer_dir: str | Path, out_dir: str | Path,
                    settings: DataSettings, workers: int = 1) -> dict:
    """Write ``out_dir``/train.jsonl, heldout.jsonl and stats.json from ``sources`` rendered with the
    chat template of the tokenizer in ``tokenizer_dir``; return the stats. ``workers`` processes
    read and tokenize the rows; the files are the same for any number of them."""
    if not sources:
        raise DataError("no data sources given", where="config key data.sources",
                        fix="list at least one .jsonl/.json/.parquet file or save_to_disk folder")
    out_dir = Path(out_dir)
    names = ", ".join(map(str, sources))
    tally = Tally(settings.max_bad_fraction)
    max_line = max_line_bytes(settings.max_seq_len)
    check_format(settings.format)
    log.info("reading and tokenizing %s with %d worker process%s", names, workers, "es" if workers > 1 else "")
    ids, bad_rows, prompt_keys, duplicates = _read_ids(sources, settings, max_line, tally, names, workers)

    tokenizer = load_tokenizer(tokenizer_dir)
    if prompt_keys:
        require_chat_template(tokenizer, tokenizer_dir)
    renderer = ChatRenderer(tokenizer)

    heldout_ids = split_heldout(prompt_keys, settings)
    if not heldout_ids:  # before tokenizing anything: evaluate_draft would meet it after training
        raise _no_prompts(names, len(ids))
    if len(heldout_ids) == len(ids):
        raise DataError(f"only {len(ids)} usable row in {names}: nothing is left to train on once a "
                        "prompt is held out for evaluation", where=names,
                        fix="give at least two usable rows")
    # A train row that shares its prompt with a held-out one would leak the evaluation prompt
    # (and, after regeneration, the very answer) into training.
    heldout_prompts = {prompt_keys[i] for i in heldout_ids}
    leaked = {i for i, key in prompt_keys.items() if key in heldout_prompts and i not in heldout_ids}
    del prompt_keys
    sampled = _sample_train((i for i in ids if i not in heldout_ids and i not in leaked), settings)
    counts = _write_rows(sources, out_dir, settings, max_line, tally, names, ids, bad_rows, heldout_ids, leaked,
                         sampled, renderer, workers)

    stats = {
        "rows_read": tally.read,
        "rows_kept": counts["train_rows"] + counts["heldout_rows"],
        "rows_dropped": {reason: tally.dropped[reason] for reason in REASONS},
        "rows_over_max_samples": counts["over_max_samples"],
        "rows_same_prompt_as_heldout": counts["same_prompt_as_heldout"],
        "train_rows": counts["train_rows"],
        "heldout_rows": counts["heldout_rows"],
        "tokens": counts["tokens"],
        "loss_tokens": counts["loss_tokens"],
        "heldout_prompt_tokens": counts["heldout_prompt_tokens"],
        "truncated_rows": counts["truncated_rows"],
        "duplicate_ids": duplicates,
        "first_bad_rows": tally.first_bad,
        "max_seq_len": settings.max_seq_len,
        "sources": [str(s) for s in sources],
        "tokenizer": str(tokenizer_dir),
        "settings": asdict(settings),
    }
    atomic_write_json(out_dir / "stats.json", stats)
    log.info("prepared %d train rows (%d tokens, %d with loss) and %d held-out prompts from %d rows; "
             "%d rows kept out of training for a held-out prompt; dropped %s", stats["train_rows"],
             stats["tokens"], stats["loss_tokens"], stats["heldout_rows"], stats["rows_read"],
             stats["rows_same_prompt_as_heldout"], {r: n for r, n in stats["rows_dropped"].items() if n} or "none")
    return stats


class _Read(NamedTuple):
    """What pass 1 keeps of a usable row: its own id, where it is, and its prompt key (None: a text row)."""

    id: str
    file: str
    line: int
    prompt_key: bytes | None


@dataclass(frozen=True)
class _ReadChunk:
    """Pass 1's work on a chunk of rows, in a worker: each row parsed and normalized, reduced to
    what the split needs of it."""

    format: str

    def __call__(self, chunk: list[RawRow]) -> list[_Read | BadRow]:
        out: list[_Read | BadRow] = []
        for raw in chunk:
            row = to_row(raw, self.format)
            if isinstance(row, BadRow):
                out.append(row)
            else:
                key = prompt_key(row.messages, row.tools) if row.is_chat else None
                out.append(_Read(row.id, row.file, row.line, key))
        return out


def _read_ids(sources: Sequence[str | Path], settings: DataSettings, max_line: int, tally: Tally,
              names: str, workers: int) -> tuple[list[str], set[int], dict[str, bytes], int]:
    """Pass 1: read and normalize every row; return the kept ids (made unique, in row order), the
    indexes of the bad rows among all rows read, each chat row's prompt key by id (in row order),
    and how many ids were repeated."""
    ids: list[str] = []
    bad_rows: set[int] = set()
    prompt_keys: dict[str, bytes] = {}
    seen: set[str] = set()
    duplicates = 0
    with ordered_map(_ReadChunk(settings.format), workers) as run:
        read = itertools.chain.from_iterable(run(_chunks(read_rows(sources, max_line))))
        for row in _progress(read, "reading rows"):
            tally.read += 1
            if isinstance(row, BadRow):
                bad_rows.add(tally.read - 1)
                tally.bad(row)
                continue
            row_id = unique_id(row.id, seen)
            if row_id != row.id and row.id != line_id(row.file, row.line):
                if not duplicates:
                    log.warning("row %s repeats the id %r; it is kept as %r (stats.json counts such rows under "
                                "duplicate_ids)", row_where(row.file, row.line), row.id, row_id)
                duplicates += 1
            seen.add(row_id)
            ids.append(row_id)
            if row.prompt_key is not None:
                prompt_keys[row_id] = row.prompt_key
    del seen
    tally.check()  # fail before tokenizing anything
    if not ids:
        counts = ", ".join(f"{r}={n}" for r, n in tally.dropped.most_common())
        top = tally.dropped.most_common(1)[0][0] if tally.dropped else ""
        raise DataError(f"no usable rows in {names}: every row was dropped ({counts or 'none read'})",
                        where=f"first bad row {row_where(tally.first_bad[0]['file'], tally.first_bad[0]['line'])}"
                              if tally.first_bad else names,
                        fix=REASON_FIXES.get(top, "check data.format and the rows' fields (see the bad rows in "
                                                  "the log)"))
    return ids, bad_rows, prompt_keys, duplicates


class _Made(NamedTuple):
    """What pass 2 made of a row, for the main process to write and count in row order."""

    kind: str  # "train", "heldout" or "bad"
    line: str = ""  # the row's line of train.jsonl or heldout.jsonl
    tokens: int = 0  # train: the row's tokens; heldout: its prompt's
    loss_tokens: int = 0
    truncated: bool = False
    bad: BadRow | None = None
    fix: str | None = None  # how to fix a row the template or the tokenizer could not render
    heldout: bool = False  # a bad row the split had held out


@dataclass(frozen=True)
class _RenderChunk:
    """Pass 2's work on a chunk of (row, the id pass 1 gave it, "train", "heldout" or "check"), in
    a worker: each row checked against pass 1's read of it and, unless only checked, rendered,
    tokenized and serialized."""

    renderer: ChatRenderer
    format: str
    max_seq_len: int

    def __call__(self, chunk: list[tuple[RawRow, str, str]]) -> list[_Made | None]:
        return [self._make(*planned) for planned in chunk]

    def _make(self, raw: RawRow, row_id: str, use: str) -> _Made | None:
        row = to_row(raw, self.format)
        if isinstance(row, BadRow) or not (row_id == row.id or row_id.startswith(row.id + "#")):
            where = row_where(row.file, row.line)
            raise DataError(f"{where} changed while it was being read", where=where, fix=CHANGED_FIX)
        if use == "check":
            return None
        source = {"file": row.file, "line": row.line}
        try:
            if use == "heldout":
                # Rendered whole too: a row the template cannot render is bad wherever the split
                # puts it, or which rows count as bad would hang on the held-out draw.
                self.renderer.tokenize(row.messages, row.tools)
                prompt = self.renderer.prompt_ids(row.messages, row.tools)
                if len(prompt) >= self.max_seq_len:
                    raise _TooLong()
                return _Made("heldout", _json_line({"id": row_id, "messages": row.messages, "prompt_ids": prompt,
                                                    **({"tools": row.tools} if row.tools else {}),
                                                    "source": source}), tokens=len(prompt))
            if row.is_chat:
                input_ids, loss_mask = self.renderer.tokenize(row.messages, row.tools)
                if not any(loss_mask):
                    raise ChatTemplateError("no assistant token found in the rendered conversation")
            else:  # with BOS etc., as text is fed
                input_ids = list(encode_text(self.renderer.tokenizer, row.text)["input_ids"])
                loss_mask = [1] * len(input_ids)
            truncated = len(input_ids) > self.max_seq_len
            if truncated:
                input_ids = input_ids[: self.max_seq_len]
                loss_mask = loss_mask[: self.max_seq_len]
                if not any(loss_mask):
                    raise _TooLong()
        except (ChatTemplateError, TokenizerFailure) as e:
            return _Made("bad", bad=render_failure(row, e), fix=e.fix, heldout=use == "heldout")
        except _TooLong:
            return _Made("bad", bad=BadRow(row.file, row.line, "too_long_prompt",
                                           f"the first answer starts after data.max_seq_len={self.max_seq_len} tokens"),
                         heldout=use == "heldout")
        return _Made("train", _json_line({"id": row_id, "input_ids": input_ids, "loss_mask": loss_mask,
                                          "source": source}),
                     tokens=len(input_ids), loss_tokens=sum(loss_mask), truncated=truncated)


def _write_rows(sources: Sequence[str | Path], out_dir: Path, settings: DataSettings, max_line: int, tally: Tally,
                names: str, ids: list[str], bad_rows: set[int], heldout_ids: set[str], leaked: set[str],
                sampled: set[str] | None, renderer: ChatRenderer, workers: int) -> Counter:
    """Pass 2: tokenize the rows kept and stream them to train.jsonl and heldout.jsonl (renamed into
    place only when complete); return the counts for stats.json."""
    counts = Counter()
    bad_heldout: list[BadRow] = []
    kept = iter(ids)

    def planned() -> Iterator[tuple[RawRow, str, str]]:
        """The rows pass 1 did not find bad, read again, with their ids and what to make of them."""
        for index, raw in enumerate(read_rows(sources, max_line)):
            if index in bad_rows:
                continue
            row_id = next(kept, None)
            if row_id is None:
                where = row_where(raw[0], raw[1])
                raise DataError(f"{where} changed while it was being read", where=where, fix=CHANGED_FIX)
            if row_id in leaked:
                counts["same_prompt_as_heldout"] += 1
                yield raw, row_id, "check"
            elif row_id not in heldout_ids and sampled is not None and row_id not in sampled:
                counts["over_max_samples"] += 1
                yield raw, row_id, "check"
            else:
                yield raw, row_id, "heldout" if row_id in heldout_ids else "train"

    task = _RenderChunk(renderer, settings.format, settings.max_seq_len)
    # The workers first: forked before the output files are open, they hold none of them.
    with (ordered_map(task, workers) as run, PendingFile(out_dir / "train.jsonl") as train,
          PendingFile(out_dir / "heldout.jsonl") as held):
        made = itertools.chain.from_iterable(run(_chunks(planned(), raw_of=lambda planned: planned[0])))
        for row in _progress(made, "tokenizing rows", len(ids)):
            if row is None:
                continue
            if row.kind == "bad":
                tally.bad(row.bad, row.fix)
                if row.heldout:
                    bad_heldout.append(row.bad)
            elif row.kind == "heldout":
                held.write_line(row.line)
                counts["heldout_rows"] += 1
                counts["heldout_prompt_tokens"] += row.tokens
            else:
                train.write_line(row.line)
                counts["train_rows"] += 1
                counts["tokens"] += row.tokens
                counts["loss_tokens"] += row.loss_tokens
                counts["truncated_rows"] += row.truncated
        if next(kept, None) is not None:
            raise DataError(f"{names} yielded fewer rows on the second read", where=names, fix=CHANGED_FIX)
        tally.check()
        if counts["train_rows"] == 0:
            raise _nothing_to_train(names, tally, counts, len(heldout_ids), settings)
        if counts["heldout_rows"] == 0:
            raise _no_heldout_prompt(names, bad_heldout, tally)
        train.commit()
        held.commit()
    return counts
