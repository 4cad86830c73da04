"""The one exception family users see: each error says what went wrong, where, and how to fix it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


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


# What torch's allocators say when they cannot allocate: torch.OutOfMemoryError ("CUDA out of
# memory") and the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory").
_OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and any(s in str(e).lower() for s in _OUT_OF_MEMORY))


@contextmanager
def out_of_memory_as(error: type[DraftsmithError], what: str, *, where: str, fix: str) -> Iterator[None]:
    """Re-raise an allocator's out-of-memory error inside the block as ``error`` naming the setting
    to change; anything else passes through."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise error(f"{what} ran out of memory: {first}", where=where, fix=fix) from e
