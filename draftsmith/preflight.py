"""Stage check_setup: the preflight checks that need no weights and no regenerated data.

Beside inspect_target (which describes the target from its config in target.json), this stage
checks the rest of what later stages will need, in seconds, so a mistake surfaces before any model
loads: each raw data source is readable and in a known format, the target's chat template renders
rows spread over each whole source (every kind of row among them: tool calls, system turns, ...)
and they tokenise with a loss mask on the assistant's tokens, no more of them unusable (too long for
data.max_seq_len, unreadable) than prepare_dataset allows (data.max_bad_fraction), the draft vocabulary
fits the target's, and every stage that runs the target through vLLM has a vLLM that can capture
it. It reads the target folder's config.json and tokenizer itself rather than target.json, so the
two preflight jobs run side by side (each pays seconds of imports).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from draftsmith.bad_rows import REASON_FIXES, BadRow
from draftsmith.conversations import Conversation, answer_turns, load_conversations, to_row
from draftsmith.errors import ConfigError, DataError, TargetError
from draftsmith.io import atomic_write_json, read_json
from draftsmith.settings import StageSettings, check_settings, data_format, from_schema
from draftsmith.source_sample import SAMPLE_STREAM_BYTES, SampledRow, sample_rows
from draftsmith.sources import max_line_bytes, source_type

log = logging.getLogger(__name__)

MAX_ROWS_READ = 256  # rows read per source: enough to see its format, cheap for any size
# Rows read per source, spread over the whole of it: a kind of row that is 2% of a source goes
# unseen in one source of 175.
SAMPLE_ROWS = 256
# Of them rendered, one of each kind first: at most this many, and past the first of each kind no
# longer than RENDER_SECONDS (a long agentic row takes tens of milliseconds to render and mask).
RENDER_ROWS = 32
RENDER_SECONDS = 1.0
# The reasons prepare_dataset drops a row for that only rendering it finds
RENDER_REASONS = ("too_long_prompt", "template_error", "tokenizer_error")
# The share of a source's rows prepare_dataset would drop is estimated from the rows rendered: it
# refuses the source when even the low end of a one-sided 95% interval is over data.max_bad_fraction
NOISE_Z = 1.645


@dataclass(frozen=True)
class PreflightSettings(StageSettings):
    """What check_setup checks the setup against: how the sources will be read (``format``, auto
    with regeneration on, as ``DataSettings``), the draft vocabulary, the backend each stage runs
    the target with (``engines``), and the sizes draftsmith.fits checks (a training batch that
    cannot fit the trainer's memory, generation past the target's context); defaults and ranges
    from the schema."""

    format: str = from_schema("data.format")
    max_seq_len: int = from_schema("data.max_seq_len")
    max_bad_fraction: float = from_schema("data.max_bad_fraction")
    draft_vocab_size: int = from_schema("vocab.draft_vocab_size")
    device: str = from_schema("device")
    num_layers: int = from_schema("draft.num_layers")
    batch_tokens: int = from_schema("train.batch_tokens")
    ttt_steps: int = from_schema("train.ttt_steps")
    eval_max_new_tokens: int = from_schema("eval.max_new_tokens")
    regenerate_enabled: bool = from_schema("regenerate.enabled")
    regenerate_max_new_tokens: int = from_schema("regenerate.max_new_tokens")
    extraction_backend: str = from_schema("extraction.backend")
    eval_backend: str = from_schema("eval.backend")
    regenerate_backend: str = from_schema("regenerate.backend")
    # Python-only: False skips draftsmith.fits, whose checks need the target's shape (tests' targets
    # without one); the workflow always checks
    check_fits: bool = True

    SECTION = "data"
    NOT_SETTINGS = {"sources": "the rule's inputs (check_setup's sources argument)",
                    "heldout_fraction": "prepare_dataset's held-out split (DataSettings)",
                    "max_heldout": "prepare_dataset's held-out split (DataSettings)",
                    "max_samples": "prepare_dataset's training sample (DataSettings)"}

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def from_config(cls, config: Mapping) -> PreflightSettings:
        # the sources are read as the stage after preflight reads them: regeneration reads any format
        return replace(super().from_config(config), format=data_format(config))

    def engines(self, synthesizing: bool) -> dict[str, str]:
        """Which backend each stage that runs the target uses (check_engines refuses a vLLM that cannot);
        "regenerate" where regeneration's engine writes answers, or whole conversations
        (``synthesizing``: data.sources holds self)."""
        engines = {"extraction": self.extraction_backend, "eval": self.eval_backend}
        if self.regenerate_enabled or synthesizing:
            engines["regenerate"] = self.regenerate_backend
        return engines


def check_source(source: str | Path, format: str, max_seq_len: int, max_rows: int = MAX_ROWS_READ,
                 regenerating: bool = False) -> tuple[Conversation, dict]:
    """The first usable row of ``source`` (read as ``format``, and as regeneration reads it when
    ``regenerating``) and counts of the rows looked at; a DataError when the source cannot be read or
    none of its first rows is usable, with each reason's fix."""
    bad: Counter = Counter()
    first_bad: BadRow | None = None
    read = 0
    for row in load_conversations([source], format, max_line_bytes(max_seq_len), regenerating):
        read += 1
        if isinstance(row, Conversation):
            return row, {"rows_read": read, "bad_rows": dict(bad)}
        bad[row.reason] += 1
        first_bad = first_bad or row
        if read >= max_rows:
            break
    raise DataError(f"none of the first {read} rows of {source} is usable: {dict(bad)}",
                    where=f"{first_bad.where} ({first_bad.reason}: {first_bad.detail})" if first_bad else str(source),
                    fix="; ".join(f"{reason}: {REASON_FIXES[reason]}" for reason, _ in bad.most_common()))


def check_rows(source: str | Path, settings: PreflightSettings, renderer, first: Conversation) -> tuple[dict, dict]:
    """Read SAMPLE_ROWS rows spread over the whole of ``source``, and ``first`` (its first usable row),
    as prepare_dataset reads them (as regeneration does when it is on: an empty answer, or one after a
    last user turn, the target's to write), and render some of them, every kind among them, as
    prepare_dataset will; return what was seen and ``first`` rendered. A DataError naming every kind of row the chat template or the tokenizer cannot
    render (prepare_dataset would drop each such row), or when more of the sample than
    data.max_bad_fraction would be unusable (prepare_dataset would stop)."""
    from draftsmith.chat import ChatTemplateError, TokenizerFailure

    picked, whole = sample_rows(source, SAMPLE_ROWS, max_line_bytes(settings.max_seq_len))
    sample = _Sample(source, settings, every_row=_every_row(source, picked, whole))
    for sampled in picked:
        row = to_row(sampled.raw_row, settings.format, settings.regenerate_enabled)
        if isinstance(row, BadRow):
            sample.bad[row.reason] += 1
            sample.bad_examples.setdefault(row.reason, (sampled, row.detail))
        else:
            sample.usable.append((sampled, row, row_kind(row)))
    sample.rows = len(picked)
    if not sample.usable or not _same_row(sample.usable[0][1], first):
        # the source's first row is bad: its first usable row joins the sample, so that what preflight
        # says of it comes from this accounting like any other row's
        sample.usable.insert(0, (SampledRow(first.file, first.line, None), first, row_kind(first)))
        sample.rows += 1
    kinds = sample.kinds
    described = {}
    started = time.perf_counter()
    for index in render_order([kind for _, _, kind in sample.usable], RENDER_ROWS):
        _, row, kind = sample.usable[index]
        if sum(sample.rendered.values()) >= len(kinds) and time.perf_counter() - started > RENDER_SECONDS:
            break  # every kind is rendered once, whatever the time; more only while it is cheap
        sample.rendered[kind] += 1
        try:
            mask = _loss_mask(renderer, row)
        except (ChatTemplateError, TokenizerFailure) as e:
            sample.failed.append(_Failure(index, kind, e))
            continue
        if index == 0:
            described = {"id": row.id, "tokens": len(mask), "loss_tokens": sum(mask)}
        if not any(mask[:settings.max_seq_len]):
            sample.failed.append(_Failure(index, kind, prompt_tokens=mask.index(1)))
    if errors := [f.error for f in sample.failed if f.error]:  # whatever their share: training never sees them
        raise sample.cannot_render() from errors[0]
    if not whole:
        log.warning("%s: a gzip stream cannot be seeked, so the preflight sampled only its first %d MiB",
                    source, SAMPLE_STREAM_BYTES >> 20)
    share, lowest = sample.unusable_share()
    if lowest > settings.max_bad_fraction:
        raise DataError(sample.unusable_summary(share, lowest) + "; prepare_dataset would stop on this source",
                        where=sample.examples(), fix=sample.fix())
    if sample.bad or sample.failed:
        log.warning("%s", sample.unusable_warning(share, lowest))
    too_long = sum(f.error is None for f in sample.failed)
    return {"rows_sampled": sample.rows, "whole_source": whole, "bad_rows": dict(sample.bad), "kinds": dict(kinds),
            "rendered": sum(sample.rendered.values()), "no_loss_within_max_seq_len": too_long,
            "unusable": dict(sample.unusable_counts()), "unusable_share": round(share, 4)}, described


def row_kind(row: Conversation) -> str:
    """What kind of row ``row`` is to a chat template, in words: the features templates render (or
    refuse) each in their own way, so that a sample of a few rows holds every kind."""
    if not row.is_chat:
        return "plain text rows"
    roles = [m["role"] for m in row.messages]
    features = {
        "tool definitions": bool(row.tools),
        "tool calls": any(m.get("tool_calls") for m in row.messages),
        "tool results": "tool" in roles,
        "a system turn": "system" in roles,
        "several answers": len(answer_turns(row.messages)) > 1,
        "two turns in a row from one role": any(a == b != "tool" for a, b in zip(roles, roles[1:])),
        "an assistant turn first": next((r for r in roles if r != "system"), None) == "assistant",
    }
    named = [name for name, present in features.items() if present]
    return "chats with " + ", ".join(named) if named else "plain chats"


def render_order(kinds: list[str], budget: int) -> list[int]:
    """Which of the rows of ``kinds`` (each row's kind, in sample order) to render, in the order to
    render them: up to ``budget``, a first row of every kind, then a second, and so on, each kind's
    rows spread over the sample as the sample is over the source."""
    by_kind: dict[str, list[int]] = {}
    for index, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(index)
    quota = dict.fromkeys(by_kind, 0)
    while budget and any(quota[k] < len(by_kind[k]) for k in by_kind):
        for kind, indexes in by_kind.items():
            if budget and quota[kind] < len(indexes):
                quota[kind] += 1
                budget -= 1
    spread = [[indexes[i * len(indexes) // quota[kind]] for i in range(quota[kind])] for kind, indexes in by_kind.items()]
    return [index for turn in itertools.zip_longest(*spread) for index in turn if index is not None]


def _loss_mask(renderer, row: Conversation) -> list[int]:
    """The loss mask prepare_dataset gives ``row``; a ChatTemplateError or TokenizerFailure where it
    drops the row (as template_error or tokenizer_error)."""
    from draftsmith.chat import ChatTemplateError, encode_text

    if not row.is_chat:
        return [1] * len(encode_text(renderer.tokenizer, row.text)["input_ids"])
    _, mask = renderer.tokenize(row.messages, row.tools)
    if not any(mask):
        raise ChatTemplateError("no assistant token found in the rendered conversation")
    return mask


def _same_row(a: Conversation, b: Conversation) -> bool:
    """Whether two reads of rows are one row (a row found by seeking has no line number yet)."""
    return (a.messages, a.tools, a.text) == (b.messages, b.tools, b.text)


def _every_row(source: str | Path, rows: list[SampledRow], whole: bool) -> bool:
    """Whether ``rows``, sampled from ``source``, are all of its rows: fewer rows than asked of a source
    read by index or in order; every byte of a .jsonl file (its offsets may fall twice in a long line)."""
    if len(rows) >= SAMPLE_ROWS or not whole:
        return False
    if Path(source).is_file() and source_type(source) == ".jsonl":
        return sum(len(r.raw) for r in rows if isinstance(r.raw, bytes)) == Path(source).stat().st_size
    return True


@dataclass
class _Failure:
    """A rendered row prepare_dataset would drop: ``index`` into the sample's usable rows, its kind, and
    the chat template's or tokenizer's ``error``, or none for a row whose first answer token comes
    after data.max_seq_len, ``prompt_tokens`` after its start."""

    index: int
    kind: str
    error: Exception | None = None
    prompt_tokens: int = 0

    @property
    def reason(self) -> str:
        """prepare_dataset's reason for dropping the row."""
        from draftsmith.chat import ChatTemplateError

        if self.error is None:
            return "too_long_prompt"
        return "template_error" if isinstance(self.error, ChatTemplateError) else "tokenizer_error"


@dataclass
class _Sample:
    """What check_rows saw of a source: its ``rows`` sampled, the ``usable`` ones (sampled row, row, kind),
    counts of the ``bad`` ones per reason (an example of each), the rows ``rendered`` of each kind and
    those of them that ``failed``; ``every_row``: the sample is the whole source."""

    source: str | Path
    settings: PreflightSettings
    every_row: bool
    rows: int = 0
    usable: list[tuple[SampledRow, Conversation, str]] = field(default_factory=list)
    bad: Counter = field(default_factory=Counter)
    bad_examples: dict[str, tuple[SampledRow, str]] = field(default_factory=dict)
    rendered: Counter = field(default_factory=Counter)
    failed: list[_Failure] = field(default_factory=list)

    @property
    def kinds(self) -> Counter:
        return Counter(kind for _, _, kind in self.usable)

    def unusable_share(self) -> tuple[float, float]:
        """The share of the sampled rows prepare_dataset would find unusable, and the lowest it may be
        for what so few rows rendered can miss (one-sided, 95%). Every row that cannot be read is
        counted; of each kind of row, the share of those rendered that fail stands for all its rows, the
        kinds weighed by their rows (one of each kind is rendered first, so a rare kind is rendered more
        than its share). A kind rendered whole in a sample that is the whole source is exact."""
        expected, variance, kinds = float(sum(self.bad.values())), 0.0, self.kinds
        for kind, rendered in self.rendered.items():
            rows, failed = kinds[kind], sum(f.kind == kind for f in self.failed)
            expected += rows * failed / rendered
            share = (failed + 2) / (rendered + 4)  # never 0 or 1: 3 of 3 rendered failing is no certainty
            if self.every_row:  # what is left to miss is the kind's rows not rendered
                variance += rows ** 2 * share * (1 - share) / rendered * ((rows - rendered) / max(rows - 1, 1))
            else:
                variance += rows ** 2 * share * (1 - share) / rendered
        return expected / self.rows, max(0.0, expected - NOISE_Z * variance ** 0.5) / self.rows

    def unusable_counts(self) -> Counter:
        """The rows prepare_dataset would drop, per reason: of those read, and of those rendered."""
        return self.bad + Counter(f.reason for f in self.failed)

    def counted(self, counts: Counter) -> str:
        """``counts`` of unusable rows as prepare_dataset writes them, those of rendering out of the rows rendered."""
        rendered = sum(self.rendered.values())
        return ", ".join(f"{reason}={n}" + (f" of the {rendered} rendered" if reason in RENDER_REASONS else "")
                         for reason, n in counts.most_common())

    def unusable_summary(self, share: float, lowest: float) -> str:
        """How many of the sampled rows are unusable, why, and how sure the estimate is."""
        rendered, counts = sum(self.rendered.values()), self.counted(self.unusable_counts())
        limit = self.settings.max_bad_fraction
        if self.every_row and lowest == share:
            how = f"every row of the source, {rendered} of them rendered"
        else:
            how = f"an estimate from {self.rows} sampled rows, {rendered} of them rendered"
            how += f": at least {lowest:.1%} allowing for the sample's size" if share > limit else ""
        return (f"about {round(share * self.rows)} of the {self.rows} rows sampled across {self.source} ({share:.1%}) "
                f"are unusable, {'more than' if share > limit else 'within'} data.max_bad_fraction={limit}: "
                f"{counts} ({how})")

    def unusable_warning(self, share: float, lowest: float) -> str:
        """The log's word on unusable rows that do not stop the preflight."""
        if share > self.settings.max_bad_fraction:  # above the limit, but within what the sample can miss
            return (f"{self.unusable_summary(share, lowest)}; prepare_dataset may stop on this source (e.g. "
                    f"{self.examples(count_lines=False)}); fix: {self.fix()}")
        return (f"{self.unusable_summary(share, lowest)}; prepare_dataset will drop them "
                f"(e.g. {self.examples(count_lines=False)})")

    def examples(self, count_lines: bool = True) -> str:
        """The first row of each reason in the source, where it is and why it is unusable; without
        ``count_lines``, a row found by seeking is named by the byte it starts at (a passing preflight
        reads no file up to a row to count its line)."""
        def where(sampled: SampledRow) -> str:
            return sampled.where if count_lines or sampled.offset is None else f"{sampled.file} at byte {sampled.offset:,}"

        examples = [(where(sampled), reason, detail) for reason, (sampled, detail) in self.bad_examples.items()]
        for reason in dict.fromkeys(f.reason for f in self.failed):
            failure = min((f for f in self.failed if f.reason == reason), key=lambda f: f.index)
            detail = (f"the first answer starts after {failure.prompt_tokens} tokens, past data.max_seq_len="
                      f"{self.settings.max_seq_len}") if failure.error is None else failure.error.what
            examples.append((where(self.usable[failure.index][0]), reason, detail))
        return "; ".join(f"{where} ({reason}: {detail})" for where, reason, detail in examples)

    def fix(self) -> str:
        """How to make prepare_dataset use the rows, reason by reason, or let it drop them."""
        fixes = []
        if prompts := [f.prompt_tokens for f in self.failed if f.error is None]:
            longest = max(prompts)
            fixes.append(f"raise data.max_seq_len from {self.settings.max_seq_len} to at least "
                         f"{-(-(longest + 64) // 64) * 64} (the longest prompt rendered takes {longest} tokens "
                         "before its first answer token; the rest leaves its answer room), or shorten or filter out "
                         "the long prompts")
        fixes += [f"{reason}: {REASON_FIXES[reason]}" for reason in self.bad if reason in REASON_FIXES]
        return "; ".join([*fixes, "or raise data.max_bad_fraction (prepare_dataset then drops these rows)"])

    def cannot_render(self) -> DataError:
        """The refusal of every kind of row the chat template or the tokenizer cannot render, each with
        its count among the rows rendered and sampled and an example."""
        failed = [f for f in self.failed if f.error]
        by_kind = {kind: [f for f in failed if f.kind == kind] for kind in dict.fromkeys(f.kind for f in failed)}
        reasons = sorted({f.reason for f in failed})
        part = " and ".join({"template_error": "chat template", "tokenizer_error": "tokenizer"}[r] for r in reasons)
        kinds, rows = self.kinds, self.rows

        def what(failures: list[_Failure]) -> str:
            return "; ".join(dict.fromkeys(f.error.what for f in failures))

        if len(by_kind) == 1:
            (kind, failures), = by_kind.items()
            told = f"the {kind} in {self.source}: {len(failures)} of the {self.rendered[kind]} rendered fail " \
                   f"({what(failures)}); rows of this kind are"
        else:
            told = f"{len(by_kind)} kinds of row in {self.source}: " + "; ".join(
                f"the {kind}: {len(failures)} of the {self.rendered[kind]} rendered fail ({what(failures)}), "
                f"{kinds[kind]} of the {rows} rows sampled ({kinds[kind] / rows:.0%})" for kind, failures in by_kind.items())
            told += "; rows of these kinds are"
        total = sum(kinds[kind] for kind in by_kind)
        others = self.bad + Counter(f.reason for f in self.failed if not f.error)
        besides = f"; the sample's other unusable rows: {self.counted(others)}" if others else ""
        firsts = [min(failures, key=lambda f: f.index) for failures in by_kind.values()]
        where = f"{self.usable[firsts[0].index][0].where} (one of them)" if len(firsts) == 1 else \
            "; ".join(f"{self.usable[f.index][0].where} (the {f.kind})" for f in firsts)
        fixes = list(dict.fromkeys(f.error.fix for f in failed if f.error.fix))
        return DataError(
            f"the target's {part} cannot render {told} {total} of the {rows} rows sampled across the file "
            f"({total / rows:.0%}), and prepare_dataset would drop each one it cannot render as "
            f"{' or '.join(reasons)}{besides}",
            where=where, fix="; ".join(fixes) or f"make the target's {part} render these rows, or remove them from the source")


def read_config(model_path: str | Path) -> dict:
    """The target's config.json as JSON (building the config class costs seconds of imports)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise TargetError("the target folder has no config.json", where=str(model_path),
                          fix="point target.path at a Hugging Face model folder (config.json, tokenizer, weights)")
    try:
        raw = read_json(config_file)
    except (ValueError, UnicodeDecodeError) as e:
        raise TargetError(f"the target's config.json is not valid JSON: {e}", where=str(config_file),
                          fix="restore config.json from the model's release") from e
    if not isinstance(raw, dict):
        raise TargetError(f"the target's config.json holds a JSON {type(raw).__name__}, not an object",
                          where=str(config_file), fix="restore config.json from the model's release")
    return raw


def text_config(raw: dict) -> dict:
    """The config of the target's text model: the whole config, or the sub-config a multimodal
    wrapper keeps it in, with transformers' standard names (``hidden_size`` for GPT-2's ``n_embd``)."""
    from draftsmith.targets.inspect import standard_names

    for key in ("text_config", "llm_config", "language_config", "text_model"):
        if isinstance(raw.get(key), dict) and "vocab_size" in raw[key]:
            return standard_names(raw[key])
    return standard_names(raw)


def check_vocab(vocab_size: int | None, draft_vocab_size: int) -> None:
    if vocab_size is not None and draft_vocab_size > vocab_size:
        raise ConfigError(f"vocab.draft_vocab_size {draft_vocab_size} is larger than the target's vocabulary "
                          f"({vocab_size})", where="vocab.draft_vocab_size",
                          fix=f"use at most {vocab_size} (32000 suits most targets)")


def check_engines(architecture: str, engines: Mapping[str, str]) -> dict:
    """Refuse a stage set to run the target through vLLM when the installed vLLM cannot capture it
    (not installed, an untested release, no implementation of the architecture), and vLLM serving
    for a target class that cannot feed an EAGLE-3 speculator."""
    from draftsmith.targets.vllm_support import vllm_support

    users = sorted(stage for stage, backend in engines.items() if backend == "vllm")
    if not users:
        return {"vllm": {"stages": []}}
    vllm = vllm_support({"architecture": architecture}, None)
    if not vllm.get("supported"):
        raise TargetError(f"{', '.join(users)} run(s) the target through vLLM, which cannot: {vllm.get('reason')}",
                          where=", ".join(f"{stage}.backend" for stage in users),
                          fix=vllm.get("fix") or "use the hf backend")
    if engines.get("eval") == "vllm" and vllm.get("supports_eagle3") is False:
        # evaluation would refuse it only after training: say so before anything runs
        raise TargetError(f"eval.backend: vllm serves the draft as an EAGLE-3 speculator, but vLLM's "
                          f"{vllm.get('vllm_class')} does not implement SupportsEagle3, so it cannot hand the "
                          "target's aux hidden states to a draft", where="eval.backend",
                          fix="set eval.backend: hf (extraction and regeneration may stay on vLLM)")
    return {"vllm": {"stages": users, **vllm}}


def check_user_turns(tokenizer, model_path: str | Path, systems: Sequence[str | None]) -> dict:
    """The user turn the target writes conversations from (draftsmith.synthesize) can be found in its
    chat template, after each system prompt: refused here, not after its engine has loaded."""
    from draftsmith.chat import require_chat_template, user_turn

    require_chat_template(tokenizer, model_path)
    turns = [user_turn(tokenizer, system, f"{model_path} (its chat template), data.sources: self") for system in systems]
    closing = tokenizer.convert_ids_to_tokens(turns[0].closing)[0]
    log.info("data.sources: self: the target writes its user turns after %d opening(s) and stops them at %s",
             len(turns), closing)
    return {"system_prompts": len([s for s in systems if s]), "user_turn_closes_with": closing}


def check_setup(model_path: str | Path, sources: Sequence[str | Path], out_path: str | Path,
                settings: PreflightSettings, *, self_written: Sequence[str | None] | None = None,
                target: Mapping | None = None) -> dict:
    """Run every weight-free check against the target folder ``model_path`` and write what was
    checked to ``out_path``. ``self_written``: the target also writes conversations itself
    (data.sources: self), after each of these system prompts (None: no system turn). ``target``:
    inspect_target's description of the folder (target.json), whose text config, architecture and
    tokenizer class spare this job importing transformers' model code and torch (seconds of a
    check that takes one); None reads them from the folder."""
    from draftsmith.chat import ChatRenderer, load_tokenizer, require_chat_template

    if target is None:
        raw = read_config(model_path)
        text = text_config(raw)
        architecture = (raw.get("architectures") or [raw.get("model_type", "unknown")])[0]
    else:
        text, architecture = target["text_config"], target["architecture"]
    check_vocab(text.get("vocab_size"), settings.draft_vocab_size)
    report = {"engines": check_engines(architecture, settings.engines(synthesizing=self_written is not None))}
    if settings.check_fits:
        from draftsmith.fits import check_context, check_train_fits, trainer_memory

        report["context"] = check_context(text, settings)
        report["train_memory"] = check_train_fits(text, settings, trainer_memory(settings.device))
    if not sources and self_written is None:
        raise DataError("no data sources given", where="config key data.sources",
                        fix="list at least one .jsonl/.json/.parquet file or save_to_disk folder, or self")
    tokenizer = load_tokenizer(model_path, (target or {}).get("tokenizer_class"))
    if self_written is not None:
        report["self_written"] = check_user_turns(tokenizer, model_path, self_written)
    renderer = ChatRenderer(tokenizer)
    checked = []
    for source in sources:
        row, counts = check_source(source, settings.format, settings.max_seq_len,
                                   regenerating=settings.regenerate_enabled)
        if row.is_chat:
            require_chat_template(tokenizer, model_path)
        spread, sample = check_rows(source, settings, renderer, row)
        checked.append({"source": str(source), **counts, "sample": sample, "spread": spread})
        log.info("%s: readable; %s renders to %d tokens, %d with loss; %d rows sampled across it, %d of them "
                 "rendered: %s", source, row.where, sample["tokens"], sample["loss_tokens"], spread["rows_sampled"],
                 spread["rendered"], ", ".join(f"{n} {kind}" for kind, n in spread["kinds"].items()))
    report.update(sources=checked, draft_vocab_size=settings.draft_vocab_size, target_vocab_size=text.get("vocab_size"))
    atomic_write_json(out_path, report)
    log.info("preflight passed: %d data source(s), vocab, engines (vLLM for %s)", len(checked),
             ", ".join(report["engines"]["vllm"]["stages"]) or "no stage")
    return report
