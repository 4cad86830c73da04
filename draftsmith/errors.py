"""The one exception family users see: each error says what went wrong, where, and how to fix it."""

from __future__ import annotations


class DraftsmithError(Exception):
    """An error the user can act on.

    ``where`` names the file, line, config key or layer; ``fix`` says what to change.
    """

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None) -> None:
        self.what, self.where, self.fix = what, where, fix
        parts = [what]
        if where:
            parts.append(f"  where: {where}")
        if fix:
            parts.append(f"  fix:   {fix}")
        super().__init__("\n".join(parts))


class StorageError(DraftsmithError, OSError):
    """A file could not be written (disk full, read-only or unwritable folder).

    Also an ``OSError``, so code that handles failed writes as ``OSError`` keeps doing so.
    """

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None,
                 errno: int | None = None) -> None:
        super().__init__(what, where=where, fix=fix)
        self.errno = errno


class ConfigError(DraftsmithError):
    """The workflow configuration is invalid."""


class DataError(DraftsmithError):
    """A dataset cannot be read or yields no usable rows."""


class TargetError(DraftsmithError):
    """The target model (config, tokenizer, layers, weights) cannot be used as asked."""


class ExtractionError(DraftsmithError):
    """Hidden-state extraction or the shard store failed."""


class TrainingError(DraftsmithError):
    """Training the draft failed (e.g. a NaN loss)."""


class EvaluationError(DraftsmithError):
    """Evaluating the draft failed, e.g. speculative output differs from greedy output."""
