"""Stage check_setup: the preflight checks that need no weights and no regenerated data.

Beside inspect_target (which describes the target from its config in target.json), this stage
checks the rest of what later stages will need, in seconds, so a mistake surfaces before any model
loads: each raw data source is readable and in a known format, the target's chat template renders
a sample and the sample tokenises with a loss mask on the assistant's tokens, the draft vocabulary
fits the target's, and every stage that runs the target through vLLM has a vLLM that can capture
it. It reads the target folder's config.json and tokenizer itself rather than target.json, so the
two preflight jobs run side by side (each pays seconds of imports).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from draftsmith.conversations import BadRow, Conversation, load_conversations, max_line_bytes
from draftsmith.errors import ConfigError, DataError, TargetError
from draftsmith.io import atomic_write_json, read_json
from draftsmith.settings import StageSettings, check_settings, data_format, from_schema

log = logging.getLogger(__name__)

MAX_ROWS_READ = 256  # rows read per source: enough to see its format, cheap for any size


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
                    "max_bad_fraction": "prepare_dataset's (DataSettings); preflight reads a source's first rows",
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
    wrapper keeps it in."""
    for key in ("text_config", "llm_config", "language_config", "text_model"):
        if isinstance(raw.get(key), dict) and "vocab_size" in raw[key]:
            return raw[key]
    return raw


def check_vocab(vocab_size: int | None, draft_vocab_size: int) -> None:
    if vocab_size is not None and draft_vocab_size > vocab_size:
        raise ConfigError(f"vocab.draft_vocab_size {draft_vocab_size} is larger than the target's vocabulary "
                          f"({vocab_size})", where="vocab.draft_vocab_size",
                          fix=f"use at most {vocab_size} (32000 suits most targets)")


def check_engines(architecture: str, engines: Mapping[str, str]) -> dict:
    """Refuse a stage set to run the target through vLLM when the installed vLLM cannot capture it
    (not installed, an untested release, no implementation of the architecture)."""
    from draftsmith.targets.vllm_support import vllm_support

    users = sorted(stage for stage, backend in engines.items() if backend == "vllm")
    if not users:
        return {"vllm": {"stages": []}}
    vllm = vllm_support({"architecture": architecture}, None)
    if not vllm.get("supported"):
        raise TargetError(f"{', '.join(users)} run(s) the target through vLLM, which cannot: {vllm.get('reason')}",
                          where=", ".join(f"{stage}.backend" for stage in users),
                          fix=vllm.get("fix") or "use the hf backend")
    return {"vllm": {"stages": users, **vllm}}


def check_setup(model_path: str | Path, sources: Sequence[str | Path], out_path: str | Path,
                settings: PreflightSettings) -> dict:
    """Run every weight-free check against the target folder ``model_path`` and write what was
    checked to ``out_path``."""
    from draftsmith.chat import load_tokenizer, require_chat_template

    raw = read_config(model_path)
    text = text_config(raw)
    check_vocab(text.get("vocab_size"), settings.draft_vocab_size)
    architecture = (raw.get("architectures") or [raw.get("model_type", "unknown")])[0]
    report = {"engines": check_engines(architecture, settings.engines)}
    if settings.check_fits:
        from draftsmith.fits import check_context, check_train_fits, trainer_memory

        report["context"] = check_context(text, settings)
        report["train_memory"] = check_train_fits(text, settings, trainer_memory(settings.device))
    if not sources:
        raise DataError("no data sources given", where="config key data.sources",
                        fix="list at least one .jsonl/.json/.parquet file or save_to_disk folder")
    tokenizer = load_tokenizer(model_path)
    checked = []
    for source in sources:
        row, counts = check_source(source, settings.format, settings.max_seq_len)
        if row.is_chat:
            require_chat_template(tokenizer, model_path)
        checked.append({"source": str(source), **counts, "sample": check_sample(tokenizer, row, settings.max_seq_len)})
        log.info("%s: readable; %s renders to %d tokens, %d with loss", source, row.where,
                 checked[-1]["sample"]["tokens"], checked[-1]["sample"]["loss_tokens"])
    report.update(sources=checked, draft_vocab_size=settings.draft_vocab_size, target_vocab_size=text.get("vocab_size"))
    atomic_write_json(out_path, report)
    log.info("preflight passed: %d data source(s), vocab, engines (vLLM for %s)", len(checked),
             ", ".join(report["engines"]["vllm"]["stages"]) or "no stage")
    return report
