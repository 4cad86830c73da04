"""Stage regenerate_responses: replace the assistant turns of the training conversations with the
target's own answers, so the draft learns the distribution it will be asked to predict.

Conversations are read with ``draftsmith.conversations.load_conversations`` as regeneration reads
them: an empty assistant turn is one for the target to write, and a conversation that ends with a
user turn gets one after it, so a source of prompts alone is answered whole. Bad rows are counted
and skipped here, and more than data.max_bad_fraction of them stop the stage before the target
loads, as prepare_dataset would stop (it sees the regenerated rows only, where they are gone). They
are grouped into chunks of ``chunk_size`` conversations, and each chunk is regenerated turn by
turn: round r answers the r-th answer (an assistant turn after a user turn) of every conversation in
the chunk, conditioned on the original user turns, the row's tool definitions, any assistant turn
that opens the conversation, and the answers regenerated in earlier rounds.
A round runs as left-padded ``model.generate`` batches sorted by prompt length (``backend: hf``), or
as one ``LLM.generate`` call of vLLM's offline engine at full tensor parallelism (``backend: vllm``,
draftsmith.engines.vllm_generation); both return token ids, decoded here alike, up to the first stop
token and with the special tokens the target wrote inside its answer kept, so they write the same rows.
More than data.max_bad_fraction empty answers (nothing but whitespace) stop the stage naming the
target, since prepare_dataset would drop their conversations as bad data. Each finished chunk
is renamed into ``work_dir`` atomically, so a killed job resumes at the first missing chunk; a
fingerprint of the settings, the model, the sources and this code guards the chunks against reuse
under different conditions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from draftsmith.conversations import BadRow, Tally, answer_turns, load_conversations, uses_tools
from draftsmith.engines.hf_model import (
    load_target_model,
    model_dtype_name,
    resolve_device,
    stop_ids_from_files,
    stop_token_ids,
)
from draftsmith.engines.shared import SharedEngine
from draftsmith.errors import DataError, TargetError, out_of_memory_as
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
from draftsmith.settings import PROGRESS_INTERVAL_S, StageSettings, check_settings, from_schema
from draftsmith.targets.identity import weights_identity
from draftsmith.targets.vllm_install import engine_release

log = logging.getLogger(__name__)

REGENERATE_FORMAT = "draftsmith.regenerate/1"
MAX_CHARACTER_BYTES = 4  # UTF-8's longest character
# Once this many answers are written, a target that left more than half of them empty stops the stage
# there, rather than after every chunk (hours, for a large target and data set).
EARLY_JUDGE_ANSWERS = 256


# ---------------------------------------------------------------------------------------------
# Settings and fingerprint


@dataclass(frozen=True)
class RegenerateSettings(StageSettings):
    """The regenerate section of the config (``enabled`` is the workflow's switch, unused here), and
    the target's engine: its dtype, the device, vLLM's tensor parallel size and the sampling seed.
    Defaults and ranges from the schema."""

    enabled: bool = from_schema("regenerate.enabled")
    backend: str = from_schema("regenerate.backend")  # hf: transformers' generate; vllm: vLLM's engine
    max_new_tokens: int = from_schema("regenerate.max_new_tokens")
    temperature: float = from_schema("regenerate.temperature")
    top_p: float = from_schema("regenerate.top_p")
    batch_size: int = from_schema("regenerate.batch_size")
    chunk_size: int = from_schema("regenerate.chunk_size")  # conversations per resumable chunk
    enforce_eager: bool = from_schema("regenerate.enforce_eager")  # vLLM without CUDA graphs on a GPU
    seed: int = from_schema("seed")
    model_dtype: str = from_schema("target.dtype")  # dtype the target runs in; auto = bf16 on GPU, fp32 on CPU
    device: str = from_schema("device")
    tensor_parallel_size: int = from_schema("extraction.tensor_parallel_size")  # vLLM's; hf runs on one device
    max_bad_fraction: float = from_schema("data.max_bad_fraction")  # checked here, before the target loads

    SECTION = "regenerate"

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    numerics = {"dtype": model_dtype_name(settings.model_dtype, device), "device": device.split(":")[0],
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
        "code": code_fingerprint("draftsmith.regenerate"),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------
# Generation


@dataclass
class TurnCounts:
    """What a chunk's regeneration produced, for the log."""

    turns: int = 0
    tokens: int = 0
    truncated: int = 0  # answers cut at max_new_tokens
    empty: int = 0  # answers that are empty or whitespace (prepare_dataset drops their conversations)
    unchanged: int = 0  # conversations passed through (template failure, tool use)
    unanswered: int = 0  # turns not answered: the conversation before them fills the engine's context
    # The first empty answer, for the message that reports them: its tokens and text, and where
    # regenerate() met it (the message's index, and the conversation's id, file and line when named).
    first_empty: dict | None = None

    def add(self, other: TurnCounts) -> None:
        for key, value in asdict(other).items():
            if key == "first_empty":
                self.first_empty = self.first_empty or value
            else:
                setattr(self, key, getattr(self, key) + value)


class Regenerator:
    """Answers the assistant turns of conversations with one loaded model and tokenizer."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, settings: RegenerateSettings, *,
                 stop_ids: Sequence[int] | None = None) -> None:
        self.model, self.tokenizer, self.settings, self.seed = model, tokenizer, settings, settings.seed
        self.stop_ids = list(stop_ids) if stop_ids is not None else stop_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.stop_ids[0])
        self.device = next(model.parameters()).device
        self.on_answers: Callable[[int], Any] | None = None  # called with each batch's answer count

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The conversation so far, rendered with the chat template (and the row's tools, as
        prepare_dataset renders them) and ending in the generation prompt, tokenized as prepare_dataset
        tokenizes held-out prompts (no extra special tokens)."""
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int] | None]:
        """New tokens per prompt (the stop token excluded), in ``prompts`` order (None for a prompt
        that leaves no room in the engine's context: vLLM's); left-padded batches of similar length
        keep padding small."""
        s = self.settings
        out: list[list[int]] = [[] for _ in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for b, start in enumerate(range(0, len(order), s.batch_size)):
            batch = order[start:start + s.batch_size]
            width = max(len(prompts[i]) for i in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            # top_k=0: generate fills in a top-k of 50 where the config leaves it unset; vLLM has none
            sampling = {} if s.greedy else {"temperature": s.temperature, "top_p": s.top_p, "top_k": 0}
            if not s.greedy:
                # One seed per batch, derived from the chunk's and the round's, so a resumed run
                # draws what an uninterrupted run would have drawn.
                torch.manual_seed(derived_seed(seed, b))
            with torch.no_grad(), out_of_memory_as(
                    TargetError, "generating answers", where=f"a batch of {len(batch)} prompts of up to {width} tokens",
                    fix="lower regenerate.batch_size (or regenerate.max_new_tokens), or use regenerate.backend: vllm"):
                generated = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                    max_new_tokens=s.max_new_tokens, do_sample=not s.greedy, **sampling,
                    eos_token_id=self.stop_ids, pad_token_id=self.pad_id)
            for row, i in enumerate(batch):
                tokens = generated[row, width:].tolist()
                out[i] = tokens
            if self.on_answers is not None:
                self.on_answers(len(batch))
        return out

    def answer(self, tokens: list[int], counts: TurnCounts) -> str:
        """The text of one answer's new tokens, up to the first stop token (what follows it is padding)."""
        stop = next((j for j, t in enumerate(tokens) if t in self.stop_ids), None)
        counts.turns += 1
        counts.truncated += stop is None
        # Special tokens the target wrote inside its answer (tool-call or thinking markers) are part
        # of what the draft must learn: kept, so the text re-encodes to the target's ids.
        tokens = tokens[:stop]
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        if stop is None:
            # A character max_new_tokens cut in half decodes to U+FFFD, which re-encodes to other ids
            # than the target wrote: its byte tokens (all but one of a character's at most) are left out.
            for _ in range(MAX_CHARACTER_BYTES - 1):
                if not text.endswith("\ufffd"):
                    break
                tokens = tokens[:-1]
                text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        counts.tokens += len(tokens)
        if not text.strip():
            counts.empty += 1
            if counts.first_empty is None:
                counts.first_empty = {"tokens": list(tokens), "text": text}
        return text

    def regenerate(self, conversations: list[list[dict]], seed: int = 0,
                   tools: Sequence[list[dict] | None] | None = None,
                   names: Sequence[dict] | None = None) -> tuple[list[list[dict]], TurnCounts]:
        """The conversations with every answer (``answer_turns``) replaced by the model's, in order (an
        empty one is written: a turn left for the target to answer); ``tools``: each conversation's tool
        definitions (or None), given to the chat template; ``names``: each conversation's ``id``,
        ``file`` and ``line``, for the message about empty answers. Assistant turns that open a
        conversation before any user turn answer nothing: they stay as written, as context of the
        answers after them.

        A conversation the chat template cannot render is returned unchanged: prepare_dataset drops
        and counts it with its reason. So is one with tool calls or tool results (``uses_tools``): the
        tools cannot be run here to answer the target's own calls. A turn whose prompt leaves no
        room in the engine's context is not answered, nor any turn after it (counted in
        ``unanswered``): none of it could be trained. A conversation with answers before such a turn
        ends after the last of them (an empty answer, or a placeholder left empty, would make
        prepare_dataset drop the answers before it too); one without stays as written.
        """
        messages = [[dict(m) for m in conv] for conv in conversations]
        tools = list(tools) if tools is not None else [None] * len(conversations)
        turns = [answer_turns(conv) for conv in messages]
        skipped: set[int] = {c for c, conv in enumerate(messages) if uses_tools(conv)}
        counts = TurnCounts()
        for r in range(max(map(len, turns), default=0)):
            jobs, prompts = [], []
            for c, t in enumerate(turns):
                if len(t) <= r or c in skipped:
                    continue
                try:
                    prompts.append(self.prompt_ids(messages[c][:t[r]], tools[c]))
                except Exception as e:  # noqa: BLE001 - Jinja templates raise anything; see docstring
                    log.debug("conversation %d: the chat template failed (%s); left unchanged", c, e)
                    skipped.add(c)
                    continue
                jobs.append((c, t[r]))
            answers = self.generate(prompts, seed=derived_seed(self.seed, seed, r))
            for (c, k), tokens in zip(jobs, answers):
                if tokens is None:  # no room left: nothing from this turn on is answered
                    counts.unanswered += len(turns[c]) - r
                    turns[c] = turns[c][:r]
                    if r:
                        del messages[c][turns[c][-1] + 1:]
                    continue
                messages[c][k] = {"role": "assistant", "content": self.answer(tokens, counts)}
                if counts.first_empty is not None and "message" not in counts.first_empty:
                    counts.first_empty.update(message=k, **(names[c] if names is not None else {}))
        for c in skipped:
            messages[c] = [dict(m) for m in conversations[c]]
        counts.unchanged += len(skipped)
        return messages, counts


class VllmRegenerator(Regenerator):
    """A ``Regenerator`` whose rounds run in vLLM's engine (``VllmGenerator``): one call per round,
    vLLM batching the prompts itself (up to ``batch_size`` sequences at once, its max_num_seqs)."""

    def __init__(self, generator: Any, tokenizer: Any, settings: RegenerateSettings, *, stop_ids: Sequence[int]) -> None:
        self.generator, self.tokenizer, self.settings, self.seed = generator, tokenizer, settings, settings.seed
        self.stop_ids = list(stop_ids)
        self.on_answers = None

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        s = self.settings
        # One seed per request (vLLM samples each request from its own generator), derived from the
        # chunk's and the round's, so a resumed run draws what an uninterrupted run would have drawn.
        out = self.generator.generate(prompts, max_new_tokens=s.max_new_tokens, stop_ids=self.stop_ids,
                                      temperature=s.temperature, top_p=s.top_p,
                                      seeds=[derived_seed(seed, n) for n in range(len(prompts))])
        if self.on_answers is not None:
            self.on_answers(len(prompts))
        return out


def derived_seed(*parts: int) -> int:
    """A seed for one batch of one round of one chunk, independent of what ran before it."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:7], "big")


# ---------------------------------------------------------------------------------------------
# Chunks


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


def mostly_empty_so_far(counts: TurnCounts) -> bool:
    """Enough answers written to judge them before the last chunk, and more than half of them empty."""
    return counts.turns >= EARLY_JUDGE_ANSWERS and counts.empty > counts.turns / 2


def check_answers(counts: TurnCounts, settings: RegenerateSettings, tokenizer: Any, target: str | Path) -> None:
    """Judge the answers the target wrote (with ``settings``): more than data.max_bad_fraction of
    them empty (nothing but whitespace) raise ``TargetError`` naming the target; fewer, if any, are a
    warning."""
    if not counts.empty:
        return
    share = counts.empty / counts.turns
    said = f"the target wrote {counts.empty} empty answers of {counts.turns} ({100 * share:.1f}%)"
    first = f"; the first: {_describe_empty(counts.first_empty, tokenizer)}" if counts.first_empty else ""
    if share <= settings.max_bad_fraction:
        log.warning("%s; prepare_dataset drops their conversations%s", said, first)
        return
    raise TargetError(
        f"{said}, more than data.max_bad_fraction={settings.max_bad_fraction}: prepare_dataset would drop their "
        f"conversations as empty turns{first}",
        where=f"the target {target}, regenerating with regenerate.backend={settings.backend}, "
              f"regenerate.temperature={settings.temperature}, regenerate.top_p={settings.top_p}, "
              f"regenerate.max_new_tokens={settings.max_new_tokens}",
        fix="check that the target's weights and tokenizer belong together (a model whose vocabulary is larger than "
            "its tokenizer's writes ids that decode to nothing), that its chat template is the one it was trained "
            "with, and the sampling settings regenerate.temperature, regenerate.top_p and "
            "regenerate.max_new_tokens; then rerun (every answer is regenerated)")


def _describe_empty(first: dict, tokenizer: Any) -> str:
    """Where the first empty answer was, its tokens, and why they decode to nothing."""
    tokens, text = first["tokens"], first["text"]
    where = f"conversation {first['id']!r} ({first['file']}:{first['line']}), message {first['message']}" \
        if "id" in first else "one answer"
    if not tokens:
        return f"{where}: no tokens (the target stopped at once)"
    unknown = sum(tokenizer.convert_ids_to_tokens(int(t)) is None for t in tokens)
    shown = f"{tokens[:8]}"[:-1] + (", ...]" if len(tokens) > 8 else "]")
    why = (f"{unknown} of them outside the tokenizer's {len(tokenizer)} ids" if unknown
           else "only whitespace")
    return f"{where}: {len(tokens)} token{'s' * (len(tokens) != 1)} {shown} ({why}) decoded to {text!r}"


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
    same ids, plus ``source``). ``engine_kwargs`` are vLLM's; with ``shared_engine`` instead vLLM decodes
    in the engine capture and evaluation share (``engines.shared``), started here when none is warm."""
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


@contextmanager
def open_regenerators(model_path: str | Path, tokenizer: Any, settings: Sequence[RegenerateSettings], *,
                      trust_remote_code: bool = False, engine_kwargs: dict | None = None,
                      stop_ids: Sequence[Sequence[int] | None] = (), shared_engine: SharedEngine | None = None
                      ) -> Iterator[list[Regenerator]]:
    """The target in ``model_path`` loaded once (transformers or vLLM, per ``settings[0].backend``),
    and one Regenerator on it per entry of ``settings``, each with its own sampling and lengths;
    ``stop_ids[i]``, where given, adds stop tokens to the i-th (a user turn's end, say).
    ``engine_kwargs`` are vLLM's; ``shared_engine`` as ``regenerate_responses`` says."""
    first = settings[0]
    torch_device = resolve_device(first.device)
    dtype_name = model_dtype_name(first.model_dtype, torch_device)
    sampling = ("greedy" if first.greedy else f"temperature {first.temperature}, top_p {first.top_p}, seed {first.seed}")
    extra = list(stop_ids) + [None] * (len(settings) - len(stop_ids))
    if first.backend != "vllm":
        model = load_target_model(model_path, dtype=first.model_dtype, device=first.device,
                                  trust_remote_code=trust_remote_code)
        log.info("generating with %s on %s (%s): %s", model_path, torch_device, dtype_name, sampling)
        defaults = stop_token_ids(model, tokenizer)
        yield [Regenerator(model, tokenizer, s, stop_ids=[*defaults, *(more or ())]) for s, more in zip(settings, extra)]
        return

    if shared_engine is not None and engine_kwargs:
        # The shared engine's arguments are capture's (SharedEngine.slot_engine): others would name another engine.
        raise ValueError(f"engine_kwargs {sorted(engine_kwargs)} and shared_engine exclude each other: the shared "
                         "engine is built with capture's arguments; pass one or the other")
    from draftsmith.engines.vllm_generation import VllmGenerator

    defaults = stop_ids_from_files(model_path, trust_remote_code=trust_remote_code)
    if shared_engine is not None:
        generator = VllmGenerator(str(model_path), slot_engine=shared_engine.slot_engine(
            str(model_path), tensor_parallel_size=first.tensor_parallel_size, dtype=dtype_name,
            trust_remote_code=trust_remote_code))
        log.info("regeneration decodes in the engine capture and evaluation share (eager, with a speculator slot "
                 "of k=%d; regenerate.batch_size does not apply): the run loads the target once",
                 shared_engine.speculative_tokens)
    else:
        generator = VllmGenerator(str(model_path), tensor_parallel_size=first.tensor_parallel_size, dtype=dtype_name,
                                  trust_remote_code=trust_remote_code, max_num_seqs=first.batch_size,
                                  enforce_eager=first.enforce_eager, **(engine_kwargs or {}))
    with generator:
        log.info("generating with %s in vLLM, tensor parallel %d (%s): %s", model_path,
                 first.tensor_parallel_size, dtype_name, sampling)
        yield [VllmRegenerator(generator, tokenizer, s, stop_ids=[*defaults, *(more or ())])
               for s, more in zip(settings, extra)]
