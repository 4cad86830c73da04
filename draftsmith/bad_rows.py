"""Bad rows: a row of the data that cannot be used, with its reason, and the accounting the stages
that read sources share (prepare_dataset, regenerate_responses, synthesize_conversations and
prepare_eval_prompts): counts per reason, the first ones logged, the stage refused past
``data.max_bad_fraction`` with how to fix each reason."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass

from draftsmith.errors import DataError

log = logging.getLogger(__name__)

# Every reason reading can drop a row for (prepare_dataset adds its own).
READ_REASONS = (
    "line_too_long",
    "not_utf8",
    "invalid_json",
    "unknown_format",
    "missing_turns",
    "empty_turn",
    "unknown_role",
    "non_text_content",
    "invalid_unicode",
    "invalid_tool_call",
    "no_assistant_turn",
)


@dataclass(frozen=True)
class BadRow:
    """A row that cannot be used, with the reason (one of ``READ_REASONS`` or a stage's own) and a detail for the log."""

    file: str
    line: int
    reason: str
    detail: str = ""

    @property
    def where(self) -> str:
        return row_where(self.file, self.line)


def row_where(file: str, line: int) -> str:
    """Where a row is, for messages: ``file:line`` for jsonl, ``file[row i]`` otherwise."""
    # jsonl rows are numbered by their 1-based line; json/parquet/datasets rows by their 0-based index.
    return f"{file}:{line}" if file.endswith((".jsonl", ".jsonl.gz")) else f"{file}[row {line}]"


# How to fix the rows dropped for a reason, added to the error when too many rows are bad; the
# reasons only prepare_dataset finds (rendering, tokenizing, length) included, so one table says it.
REASON_FIXES = {
    "line_too_long": "a jsonl row over the size limit (a file without newlines between rows?): split it, or "
                     "raise data.max_seq_len (the limit is 64 bytes per token of it, at least 16 MiB)",
    "not_utf8": "re-save the file as UTF-8",
    "invalid_json": "repair the lines named in the log (one JSON object per line)",
    "unknown_format": "rows need a 'messages', 'conversations' or 'text' field (or set data.format)",
    "missing_turns": "give each row a non-empty list of turns in 'messages' (or 'conversations'), or set "
                     "data.format to the field the rows hold",
    "empty_turn": "fill or drop the empty turns (only a tool result may be empty; with regenerate.enabled: true, "
                  "the target writes the empty answers of a conversation without tool calls or results)",
    "unknown_role": "roles must be system, user, assistant or tool (ShareGPT: human, gpt, observation)",
    "non_text_content": "content must be text or a list of text parts; images and audio are not trained on",
    "no_assistant_turn": "every conversation needs an assistant turn after a user (or tool) turn to learn from "
                         "(assistant turns before the first user turn are kept as context only); for prompts "
                         "without answers, set regenerate.enabled: true and the target answers a conversation that "
                         "ends with a user turn (one without tool calls or results)",
    "invalid_unicode": "the rows hold lone surrogate escapes (e.g. \"\\ud800\"), half of an emoji cut by a "
                       "truncating tool: repair or drop them at the source",
    "invalid_tool_call": "assistant tool_calls need a function name and JSON-object arguments (OpenAI's shape); "
                         "'tools' must be a list of tool definitions",
    "tokenizer_error": "the tokenizer rejected the text (the log names the rows and the error)",
    "too_long_prompt": "raise data.max_seq_len",
}

MAX_LOGGED_BAD_ROWS = 10


@dataclass
class Tally:
    """Counts of rows read and dropped, and the first bad rows (logged and kept for stats)."""

    max_bad_fraction: float
    read: int = 0
    dropped: Counter = dataclasses.field(default_factory=Counter)
    first_bad: list[dict] = dataclasses.field(default_factory=list)
    fixes: dict[str, str] = dataclasses.field(default_factory=dict)  # reason -> how to fix, from the first such error

    def bad(self, row: BadRow, fix: str | None = None) -> None:
        """Count a bad row (``fix``: how to fix the rows of its reason, if the reason alone does not say)."""
        self.dropped[row.reason] += 1
        if fix:
            self.fixes.setdefault(row.reason, fix)
        if len(self.first_bad) < MAX_LOGGED_BAD_ROWS:
            self.first_bad.append({"file": row.file, "line": row.line, "reason": row.reason,
                                   "detail": row.detail})
            log.warning("bad row %s: %s (%s)", row.where, row.reason, row.detail)
            if len(self.first_bad) == MAX_LOGGED_BAD_ROWS:
                log.warning("further bad rows are counted (stats.json), not logged")

    def check(self) -> None:
        """Raise ``DataError`` when more than ``max_bad_fraction`` of the rows read are bad."""
        bad = sum(self.dropped.values())
        if self.read == 0 or bad / self.read <= self.max_bad_fraction:
            return
        first = self.first_bad[0]
        counts = ", ".join(f"{r}={n}" for r, n in self.dropped.most_common())
        fix = "clean the data (the log lists the first bad rows and why) or raise data.max_bad_fraction"
        for reason, how in {**REASON_FIXES, **self.fixes}.items():
            if self.dropped[reason]:
                fix += f"; {reason}: {how}"
        raise DataError(
            f"{bad} of {self.read} rows ({bad / self.read:.1%}) are unusable, more than "
            f"data.max_bad_fraction={self.max_bad_fraction}: {counts}",
            where=f"first bad row {row_where(first['file'], first['line'])} "
                  f"({first['reason']}: {first['detail']})",
            fix=fix)
