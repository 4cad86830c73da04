"""Rows spread over the whole of a data source without reading all of it: the sample the preflight
judges a source by (``draftsmith.preflight``). Kept apart from ``draftsmith.sources``, whose
reading regeneration's cache is keyed by, so a change to how the preflight samples does not
discard regenerated answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.bad_rows import BadRow, row_where
from draftsmith.errors import DataError
from draftsmith.sources import (
    MIN_MAX_LINE_BYTES,
    RawRow,
    load_saved_dataset,
    open_binary,
    read_source,
    source_problem,
    source_type,
)

# A gzip stream cannot be seeked: its sample is spread over this much of its start.
SAMPLE_STREAM_BYTES = 64 << 20
# Bytes read past a seek to find where the next line starts: a longer line is found from an
# offset before it instead.
SEEK_SKIP_BYTES = 1 << 20
# A line found by seeking is numbered by counting the newlines before it up to this far into the
# file (a fraction of a second); further in, it is named by its byte offset.
LINE_COUNT_BYTES = 256 << 20


@dataclass(frozen=True)
class SampledRow:
    """A row of a source's sample, as ``read_rows`` gives it; ``offset``: where a jsonl line found by
    seeking starts (its ``line`` is 0 until counted: ``line_number`` reads the file up to it)."""

    file: str
    line: int
    raw: Any
    offset: int | None = None

    @property
    def raw_row(self) -> RawRow:
        return self.file, self.line, self.raw

    @property
    def where(self) -> str:
        """``row_where`` of the row, its line counted if seeking left it unknown and it is not too far
        in to count; else the byte it starts at (``tail -c +<byte + 1> file | head -1`` shows it)."""
        if self.offset is None:
            return row_where(self.file, self.line)
        if self.offset > LINE_COUNT_BYTES:
            return f"{self.file} at byte {self.offset:,}"
        return row_where(self.file, line_number(self.file, self.offset))


def sample_rows(source: str | Path, n: int, max_line: int = MIN_MAX_LINE_BYTES) -> tuple[list[SampledRow], bool]:
    """About ``n`` rows of ``source`` spread evenly from its first row to its end, and whether they
    span all of it. A .jsonl file is read at ``n`` byte offsets, a parquet file in the row groups
    that hold the rows, a save_to_disk folder by index, a .json file (parsed whole to be read at
    all) by index; a .gz file cannot be seeked, so only its first SAMPLE_STREAM_BYTES are sampled."""
    path = Path(source)
    if path.is_dir():
        dataset = load_saved_dataset(path)
        return [SampledRow(str(path), i, dataset[i]) for i in _spread(len(dataset), n)], True
    if source_problem(path) is None and source_type(path) == ".jsonl":
        return _sample_jsonl(path, n, max_line), True
    if source_problem(path) is None and source_type(path) == ".parquet":
        return _sample_parquet(path, n), True
    return _sample_stream(path, n, max_line)  # read_source names a source that cannot be read


def line_number(file: str | Path, offset: int) -> int:
    """The number of the jsonl line that starts at byte ``offset``: one more than the newlines before it."""
    newlines, left = 0, offset
    with open_binary(Path(file)) as f:
        while left > 0 and (chunk := f.read(min(left, 1 << 20))):
            newlines += chunk.count(b"\n")
            left -= len(chunk)
    return newlines + 1


def _spread(total: int, n: int) -> list[int]:
    """``n`` row indexes evenly spaced over ``total`` rows, the first and the last among them."""
    return sorted({k * total // n for k in range(n)} | {total - 1}) if total else []


def _sample_jsonl(path: Path, n: int, max_line: int) -> list[SampledRow]:
    """The line that starts first at or after each of ``n`` evenly spaced byte offsets of ``path``."""
    file, size, found = str(path), path.stat().st_size, {}
    with path.open("rb") as f:
        for offset in sorted({k * size // n for k in range(n)}):
            start = _next_line_start(f, offset)
            if start is None or start in found:
                continue
            f.seek(start)
            raw = f.readline(max_line + 1)
            if len(raw) > max_line and not raw.endswith(b"\n"):
                raw = BadRow(file, 0, "line_too_long", f"over the {max_line:,}-byte limit")
            elif not raw.strip():
                continue
            found[start] = raw
    return [SampledRow(file, 1, raw) if start == 0 else SampledRow(file, 0, raw, start) for start, raw in found.items()]


def _next_line_start(f, offset: int) -> int | None:
    """Where the first line that starts at or after ``offset`` begins; None at the end of the file,
    or past SEEK_SKIP_BYTES of one line."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    rest = f.readline(SEEK_SKIP_BYTES)
    return f.tell() if rest.endswith(b"\n") else None


def _sample_parquet(path: Path, n: int) -> list[SampledRow]:
    """``n`` rows of a parquet file spread evenly over it, reading only the row groups that hold them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    file, rows, first = str(path), [], 0  # first: the index of the next batch's first row in the file
    try:
        parquet = pq.ParquetFile(path)
        wanted = _spread(parquet.metadata.num_rows, n)
        for group in range(parquet.num_row_groups):
            size = parquet.metadata.row_group(group).num_rows
            if any(first <= i < first + size for i in wanted):
                for batch in parquet.iter_batches(batch_size=1024, row_groups=[group]):
                    local = [i - first for i in wanted if first <= i < first + batch.num_rows]
                    rows += [SampledRow(file, first + i, row) for i, row in zip(local, batch.take(local).to_pylist())]
                    first += batch.num_rows
            else:
                first += size
    except (pa.ArrowException, OSError) as e:  # a codec this pyarrow lacks, a damaged page
        raise DataError(f"{path} cannot be read as parquet near row {first}: {e}", where=str(path),
                        fix="re-write the file with a codec pyarrow reads (snappy, gzip, zstd, brotli, lz4), "
                            "or check it is complete") from e
    return rows


def _sample_stream(path: Path, n: int, max_line: int) -> tuple[list[SampledRow], bool]:
    """``n`` rows spread over what is read in order: a .json file whole (parsed whole to be read at
    all), a .gz file up to SAMPLE_STREAM_BYTES; and whether that was all of it."""
    rows, size = [], 0
    for line, raw in read_source(path, max_line):
        rows.append(SampledRow(str(path), line, raw))
        size += len(raw) if isinstance(raw, bytes) else 0
        if size >= SAMPLE_STREAM_BYTES:
            return [rows[i] for i in _spread(len(rows), n)], False
    return [rows[i] for i in _spread(len(rows), n)], True
