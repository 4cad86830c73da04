"""Stage prepare_eval_prompts: one evaluation prompt set (eval.sources) rendered with the target's
chat template into heldout.jsonl's format, so evaluate_draft reads it as it reads the held-out split.

Rows are read, counted and dropped as prepare_dataset reads them (the bad-row tally of
``draftsmith.bad_rows``, ``draftsmith.data``'s output files); an instruction keeps its input
(Alpaca's ``input``, Dolly's ``context``) and a row's ``system`` field is a system turn. This
module is apart from that stage's so that a change here reruns the evaluation only, not the
dataset, extraction and training downstream of prepare_dataset.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from draftsmith.bad_rows import REASON_FIXES, BadRow, Tally
from draftsmith.chat import ChatRenderer, ChatTemplateError, TokenizerFailure, load_tokenizer, require_chat_template
from draftsmith.conversations import PROMPT_FIELDS, load_prompts
from draftsmith.data import REASONS, PendingFile, render_failure, unique_id
from draftsmith.errors import DataError
from draftsmith.io import atomic_write_json
from draftsmith.settings import StageSettings, check_settings, from_schema
from draftsmith.sources import max_line_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalPromptsSettings(StageSettings):
    """What prepare_eval_prompts reads of the config: how many prompts of an eval.sources set it
    keeps, and the data section's length limit and bad-row tolerance, applied as prepare_dataset
    applies them to the held-out prompts."""

    max_prompts: int = from_schema("eval.max_prompts")
    max_seq_len: int = from_schema("data.max_seq_len")
    max_bad_fraction: float = from_schema("data.max_bad_fraction")

    SECTION = "data"
    NOT_SETTINGS = {"sources": "prepare_dataset's sources; an eval.sources set is the rule's input",
                    "format": "an evaluation set is read by its prompt fields (load_prompts), in any format",
                    "heldout_fraction": "prepare_dataset's held-out split (DataSettings)",
                    "max_heldout": "prepare_dataset's held-out split (DataSettings)",
                    "max_samples": "prepare_dataset's training sample (DataSettings)"}

    def __post_init__(self) -> None:
        check_settings(self)


def prepare_eval_prompts(source: str | Path, tokenizer_dir: str | Path, out_path: str | Path,
                         settings: EvalPromptsSettings) -> dict:
    """Write ``out_path`` in heldout.jsonl's format (id, messages, prompt_ids, source) from the
    first ``settings.max_prompts`` usable prompts of the evaluation set ``source``, rendered with the chat
    template of ``tokenizer_dir``, and ``<out_path stem>.stats.json``; return the stats.

    Rows are read and dropped as prepare_dataset reads them (``data.max_bad_fraction`` applies).
    """
    out_path = Path(out_path)
    max_prompts, max_seq_len = settings.max_prompts, settings.max_seq_len
    tally = Tally(settings.max_bad_fraction)
    tally.fixes["unknown_format"] = ("rows need 'messages', 'conversations' or a prompt in one of the fields "
                                     + ", ".join(PROMPT_FIELDS))
    tokenizer = load_tokenizer(tokenizer_dir)
    require_chat_template(tokenizer, tokenizer_dir)
    renderer = ChatRenderer(tokenizer)
    seen: set[str] = set()
    tokens = 0
    with PendingFile(out_path) as out:
        for row in load_prompts([source], max_line_bytes(max_seq_len)):
            if len(seen) >= max_prompts:
                break
            tally.read += 1
            if isinstance(row, BadRow):
                tally.bad(row)
                continue
            try:
                prompt = renderer.prompt_ids(row.messages, row.tools)
            except (ChatTemplateError, TokenizerFailure) as e:
                tally.bad(render_failure(row, e), e.fix)
                continue
            if len(prompt) >= max_seq_len:  # as held-out prompts: the target must have room to answer
                tally.bad(BadRow(row.file, row.line, "too_long_prompt",
                                 f"{len(prompt)} tokens, data.max_seq_len is {max_seq_len}"))
                continue
            row_id = unique_id(row.id, seen)
            seen.add(row_id)
            out.write_row({"id": row_id, "messages": row.messages, "prompt_ids": prompt,
                           **({"tools": row.tools} if row.tools else {}),
                           "source": {"file": row.file, "line": row.line}})
            tokens += len(prompt)
        tally.check()
        if not seen:
            reason = tally.dropped.most_common(1)[0][0] if tally.dropped else ""
            raise DataError(f"no usable prompt in the evaluation set {source} ({dict(tally.dropped)})",
                            where=f"config key eval.sources, {source}",
                            fix={**REASON_FIXES, **tally.fixes}.get(reason, "give rows with a prompt"))
        out.commit()
    stats = {"source": str(source), "rows_read": tally.read, "prompts": len(seen), "prompt_tokens": tokens,
             "rows_dropped": {reason: tally.dropped[reason] for reason in REASONS},
             "first_bad_rows": tally.first_bad, "max_prompts": max_prompts, "max_seq_len": max_seq_len}
    atomic_write_json(out_path.with_suffix(".stats.json"), stats)
    log.info("%d prompts (%d tokens) from %s; dropped %s", len(seen), tokens, source,
             {r: n for r, n in stats["rows_dropped"].items() if n} or "none")
    return stats
