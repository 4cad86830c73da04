"""Stage check_setup: the preflight checks that need no weights and no regenerated data.

Beside inspect_target (which describes the target from its config in target.json), this stage
checks the rest of what later stages will need, in seconds, so a mistake surfaces before any model
loads: each raw data source is readable and in a known format, the target's chat template renders
rows spread over each whole source (every kind of row among them: tool calls, system turns, ...)
and they tokenise with a loss mask on the assistant's tokens, the draft vocabulary
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
from dataclasses import dataclass, replace
from pathlib import Path

from draftsmith.conversations import (
    SAMPLE_STREAM_BYTES,
    BadRow,
    Conversation,
    SampledRow,
    load_conversations,
    max_line_bytes,
    sample_rows,
    to_row,
)
from draftsmith.errors import ConfigError, DataError, TargetError
from draftsmith.io import atomic_write_json, read_json
from draftsmith.settings import StageSettings, check_settings, data_format, from_schema

log = logging.getLogger(__name__)

MAX_ROWS_READ = 256  # rows read per source: enough to see its format, cheap for any size
# Rows read per source, spread over the whole of it: a kind of row that is 2% of a source goes
# unseen in one source of 175.
SAMPLE_ROWS = 256
# Of them rendered, one of each kind first: at most this many, and past the first of each kind no
# longer than RENDER_SECONDS (a long agentic row takes tens of milliseconds to render and mask).
RENDER_ROWS = 32
RENDER_SECONDS = 1.0


@dataclass(frozen=True)
class PreflightSettings(StageSettings):
    """What check_setup checks the setup against: how the sources will be read (``format``, auto
    with regeneration on, as ``DataSettings``), the draft vocabulary, the backend each stage runs
    the target with (``engines``), and the sizes draftsmith.fits checks (a training batch that
    cannot fit the trainer's memory, generation past the target's context); defaults and ranges
    from the schema."""

    format: str = from_schema("data.format")
    max_seq_len: int = from_schema("data.max_seq_len")
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
                    "max_bad_fraction": "prepare_dataset's (DataSettings): it bounds malformed rows, while preflight "
                                        "refuses any kind of row the chat template cannot render, whatever its share",
                    "max_samples": "prepare_dataset's training sample (DataSettings)"}

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def from_config(cls, config: Mapping) -> PreflightSettings:
        # the sources are read as the stage after preflight reads them: regeneration reads any format
        return replace(super().from_config(config), format=data_format(config))

    @property
    def engines(self) -> dict[str, str]:
        """Which backend each stage that runs the target uses (check_engines refuses a vLLM that cannot)."""
        engines = {"extraction": self.extraction_backend, "eval": self.eval_backend}
        if self.regenerate_enabled:
            engines["regenerate"] = self.regenerate_backend
        return engines


def check_source(source: str | Path, format: str, max_seq_len: int,
                 max_rows: int = MAX_ROWS_READ) -> tuple[Conversation, dict]:
    """The first usable row of ``source`` (read as ``format``) and counts of the rows looked at;
    a DataError when the source cannot be read or none of its first rows is usable."""
    bad: Counter = Counter()
    first_bad: BadRow | None = None
    read = 0
    for row in load_conversations([source], format, max_line_bytes(max_seq_len)):
        read += 1
        if isinstance(row, Conversation):
            return row, {"rows_read": read, "bad_rows": dict(bad)}
        bad[row.reason] += 1
        first_bad = first_bad or row
        if read >= max_rows:
            break
    raise DataError(f"none of the first {read} rows of {source} is usable: {dict(bad)}",
                    where=f"{first_bad.where} ({first_bad.reason}: {first_bad.detail})" if first_bad else str(source),
                    fix="check data.format and the rows' fields: rows need 'messages' (OpenAI), "
                        "'conversations' (ShareGPT) or 'text'")


def check_sample(tokenizer, row: Conversation, max_seq_len: int) -> dict:
    """Render and tokenise one row as prepare_dataset will; a DataError when no token gets loss."""
    from draftsmith.chat import ChatTemplateError, TokenizerFailure, encode_text, tokenize_conversation

    try:
        if row.is_chat:
            ids, mask = tokenize_conversation(tokenizer, row.messages, row.tools)
        else:
            ids = list(encode_text(tokenizer, row.text)["input_ids"])
            mask = [1] * len(ids)
    except (ChatTemplateError, TokenizerFailure) as e:
        raise DataError(f"the target's {'chat template' if isinstance(e, ChatTemplateError) else 'tokenizer'} "
                        f"cannot render {row.where}: {e.what}", where=row.where,
                        fix=e.fix or "check the chat template and tokenizer in the target folder") from e
    if not any(mask[:max_seq_len]):
        raise DataError(f"{row.where} has no assistant token within data.max_seq_len={max_seq_len} tokens "
                        f"({len(ids)} tokens rendered)", where=row.where,
                        fix="raise data.max_seq_len, or check that the chat template marks the assistant's turns")
    return {"id": row.id, "tokens": len(ids), "loss_tokens": sum(mask)}


def check_rows(source: str | Path, format: str, max_seq_len: int, renderer) -> dict:
    """Read SAMPLE_ROWS rows spread over the whole of ``source`` and render some of them, every kind
    among them, as prepare_dataset will; a DataError naming an example when the chat template or the
    tokenizer cannot render a kind of row (prepare_dataset would drop each such row)."""
    from draftsmith.chat import ChatTemplateError, TokenizerFailure

    sampled, whole = sample_rows(source, SAMPLE_ROWS, max_line_bytes(max_seq_len))
    usable, bad = [], Counter()
    for sample in sampled:
        row = to_row(sample.raw_row, format)
        if isinstance(row, BadRow):
            bad[row.reason] += 1
        else:
            usable.append((sample, row, row_kind(row)))
    kinds = Counter(kind for _, _, kind in usable)
    rendered, failures, too_long = [], [], 0
    started = time.perf_counter()
    for index in render_order([kind for _, _, kind in usable], RENDER_ROWS):
        sample, row, kind = usable[index]
        if len(rendered) >= len(kinds) and time.perf_counter() - started > RENDER_SECONDS:
            break  # every kind is rendered once, whatever the time; more only while it is cheap
        rendered.append(kind)
        try:
            too_long += not any(_loss_mask(renderer, row)[:max_seq_len])
        except (ChatTemplateError, TokenizerFailure) as e:
            failures.append((index, kind, e))
    if failures:
        index, kind, error = min(failures, key=lambda failure: failure[0])  # the first in the source
        failed = sum(k == kind for _, k, _ in failures)
        raise _cannot_render(source, usable[index][0], kind, error, failed, rendered.count(kind), kinds[kind],
                             len(sampled)) from error
    if not whole:
        log.warning("%s: a gzip stream cannot be seeked, so the preflight sampled only its first %d MiB",
                    source, SAMPLE_STREAM_BYTES >> 20)
    return {"rows_sampled": len(sampled), "whole_source": whole, "bad_rows": dict(bad), "kinds": dict(kinds),
            "rendered": len(rendered), "no_loss_within_max_seq_len": too_long}


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
        "several answers": roles.count("assistant") > 1,
        "two turns in a row from one role": any(a == b != "tool" for a, b in zip(roles, roles[1:])),
        "an answer first": next((r for r in roles if r != "system"), None) == "assistant",
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


def _cannot_render(source: str | Path, example: SampledRow, kind: str, error: Exception, failed: int,
                   rendered: int, of_kind: int, sampled: int) -> DataError:
    """The refusal of a kind of row the chat template or the tokenizer cannot render: ``failed`` of the
    ``rendered`` rows of that kind failed, ``of_kind`` of the ``sampled`` rows are of it."""
    from draftsmith.chat import ChatTemplateError

    part, reason = ("chat template", "template_error") if isinstance(error, ChatTemplateError) \
        else ("tokenizer", "tokenizer_error")
    return DataError(
        f"the target's {part} cannot render the {kind} in {source}: {failed} of the {rendered} rendered fail "
        f"({error.what}); rows of this kind are {of_kind} of the {sampled} rows sampled across the file "
        f"({of_kind / sampled:.0%}), and prepare_dataset would drop each one it cannot render as {reason}",
        where=f"{example.where} (one of them)",
        fix=error.fix or f"make the target's {part} render these rows, or remove them from the source")


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
    report = {"engines": check_engines(architecture, settings.engines)}
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
        row, counts = check_source(source, settings.format, settings.max_seq_len)
        if row.is_chat:
            require_chat_template(tokenizer, model_path)
        sample = check_sample(tokenizer, row, settings.max_seq_len)
        spread = check_rows(source, settings.format, settings.max_seq_len, renderer)
        checked.append({"source": str(source), **counts, "sample": sample, "spread": spread})
        log.info("%s: readable; %s renders to %d tokens, %d with loss; %d rows sampled across it, %d of them "
                 "rendered: %s", source, row.where, sample["tokens"], sample["loss_tokens"], spread["rows_sampled"],
                 spread["rendered"], ", ".join(f"{n} {kind}" for kind, n in spread["kinds"].items()))
    report.update(sources=checked, draft_vocab_size=settings.draft_vocab_size, target_vocab_size=text.get("vocab_size"))
    atomic_write_json(out_path, report)
    log.info("preflight passed: %d data source(s), vocab, engines (vLLM for %s)", len(checked),
             ", ".join(report["engines"]["vllm"]["stages"]) or "no stage")
    return report
