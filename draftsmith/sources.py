"""Reading data sources: every row of a jsonl, json or parquet file (each optionally
gzip-compressed as .jsonl.gz/.json.gz) or a datasets save_to_disk folder, as read, before it is
parsed and normalized (``draftsmith.conversations``): a jsonl line too long to load or not JSON is
a ``BadRow`` here, a file that cannot be read at all a ``DataError`` naming it."""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from draftsmith.bad_rows import BadRow
from draftsmith.errors import DataError

# The source file types read, each with its gzip-compressed form (parquet compresses inside).
SOURCE_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")

# A jsonl line longer than this is not loaded: it is a bad row, not a reason to run out of memory.
MIN_MAX_LINE_BYTES = 16 << 20
LINE_BYTES_PER_TOKEN = 64


# A row as read, before parsing: (file, line, raw), raw a jsonl line's bytes, a json, parquet or
# datasets row, or a BadRow (read_rows; draftsmith.conversations.to_row parses and normalizes it).
RawRow = tuple[str, int, Any]


def source_type(path: str | Path) -> str | None:
    """The supported suffix ``path`` ends with (``.jsonl.gz`` before ``.jsonl``), or None."""
    name = str(path).lower()
    return next((s for s in sorted(SOURCE_SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def source_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as a data source, judged from its name and first bytes (no rows
    are parsed), or None; for the config check."""
    path = Path(path)
    if not path.exists():
        return "does not exist"
    if path.is_dir():
        return None  # a save_to_disk folder: checked when read
    kind = source_type(path)
    if kind is None:
        return (f"unsupported file type {''.join(path.suffixes[-2:]) or '(none)'!r}; give "
                + ", ".join(SOURCE_SUFFIXES) + " files, or a folder written by datasets' save_to_disk")
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    if kind.endswith(".gz") and head[:2] != b"\x1f\x8b":
        return f"is named {kind} but is not gzip-compressed; rename it to {kind[:-3]} or compress it"
    if kind == ".parquet" and head != b"PAR1":
        return "is named .parquet but is not a parquet file"
    if not kind.endswith(".gz") and head[:2] == b"\x1f\x8b":
        return f"is gzip-compressed but named {kind}; rename it to {kind}.gz"
    return None


def max_line_bytes(max_seq_len: int) -> int:
    """The longest jsonl line read as a row: far more than ``max_seq_len`` tokens could take."""
    return max(MIN_MAX_LINE_BYTES, LINE_BYTES_PER_TOKEN * max_seq_len)


def read_rows(sources: Sequence[str | Path], max_line: int = MIN_MAX_LINE_BYTES,
              key: str = "data.sources") -> Iterator[RawRow]:
    """Every row of ``sources`` in order as read, before it is parsed and normalized
    (``draftsmith.conversations.to_row``, which may run in another process): ``(file, line, raw)``, raw being a jsonl line's bytes, a
    json, parquet or datasets row, or a ``BadRow``. A source without rows raises ``DataError``."""
    for source in sources:
        rows = 0
        for line, raw in read_source(Path(source), max_line):
            rows += 1
            yield str(source), line, raw
        if rows == 0:
            raise DataError(f"data source {source} holds no rows", where=str(source),
                            fix=f"fill it or remove it from {key}")


def read_source(path: Path, max_line: int = MIN_MAX_LINE_BYTES) -> Iterator[tuple[int, Any]]:
    if not path.exists():
        raise DataError(f"data source {path} does not exist", where=str(path),
                        fix="check the path in data.sources (relative paths start at the workflow folder)")
    if path.is_dir():
        return _read_saved_dataset(path)
    kind = source_type(path)
    problem = source_problem(path)
    if problem and kind is not None:
        raise DataError(f"cannot read data source {path}: it {problem}", where=str(path),
                        fix="give the file the name of its format (.jsonl, .json, .parquet, .jsonl.gz, .json.gz)")
    if kind in (".jsonl", ".jsonl.gz"):
        return _read_jsonl(path, max_line)
    if kind in (".json", ".json.gz"):
        return _read_json(path)
    if kind == ".parquet":
        return _read_parquet(path)
    suffix = "".join(path.suffixes[-2:]).lower()
    raise DataError(f"cannot read data source {path}: unsupported file type {suffix or '(none)'!r}",
                    where=str(path),
                    fix="give " + ", ".join(SOURCE_SUFFIXES) + " files, or a folder written by datasets' save_to_disk")


def open_binary(path: Path):
    return gzip.open(path, "rb") if source_type(path).endswith(".gz") else path.open("rb")


def _read_jsonl(path: Path, max_line: int = MIN_MAX_LINE_BYTES) -> Iterator[tuple[int, Any]]:
    file = str(path)
    with open_binary(path) as f:
        for lineno in itertools.count(1):
            try:
                raw = f.readline(max_line + 1)
            except (OSError, EOFError) as e:  # a truncated or damaged gzip stream
                raise DataError(f"{path} cannot be decompressed after line {lineno - 1}: {e}", where=f"{file}:{lineno}",
                                fix="re-create the .gz file (it is truncated or damaged)") from e
            if not raw:
                return
            if len(raw) > max_line and not raw.endswith(b"\n"):
                size = len(raw)
                while (chunk := f.readline(1 << 20)) and not chunk.endswith(b"\n"):
                    size += len(chunk)  # skip the rest of the line without keeping it
                size += len(chunk)
                yield lineno, BadRow(file, lineno, "line_too_long",
                                     f"{size:,} bytes, over the {max_line:,}-byte limit")
                continue
            if raw.strip():
                yield lineno, raw  # parsed by parse_row, in whichever process normalizes the row


def parse_row(file: str, line: int, raw: Any) -> Any:
    """A jsonl line (bytes) parsed, or a ``BadRow`` saying why it cannot be; any other row as it is."""
    if not isinstance(raw, bytes):
        return raw
    try:
        # utf-8-sig on line 1: editors on Windows start files with a byte-order mark.
        text = raw.decode("utf-8-sig" if line == 1 else "utf-8")
    except UnicodeDecodeError as e:
        return BadRow(file, line, "not_utf8", f"byte {e.start}: {e.reason}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return BadRow(file, line, "invalid_json", f"{e.msg} (column {e.colno})")


def _read_json(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        with open_binary(path) as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"{path} cannot be read: {e}", where=str(path),
                        fix="re-create the file (a .gz file may be truncated or damaged)") from e
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})", where=str(path),
                        fix="re-save the file as UTF-8") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON: {e.msg}", where=f"{path}:{e.lineno}:{e.colno}",
                        fix="repair the file, or write one row per line as .jsonl so a bad row "
                            "costs only itself") from e
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{path} holds a JSON {type(data).__name__}, not a list of rows",
                        where=str(path), fix='write a list of rows, or an object {"data": [rows]}')
    yield from enumerate(data)


def _read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} cannot be read as parquet: {e}", where=str(path),
                        fix="check the file is complete and really parquet") from e
    index = itertools.count()
    try:
        for batch in parquet.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield next(index), row
    except (pa.ArrowException, OSError) as e:  # a codec this pyarrow lacks, a damaged page
        raise DataError(f"{path} cannot be read as parquet after row {next(index)}: {e}", where=str(path),
                        fix="re-write the file with a codec pyarrow reads (snappy, gzip, zstd, brotli, lz4), "
                            "or check it is complete") from e


def _read_saved_dataset(path: Path) -> Iterator[tuple[int, Any]]:
    yield from enumerate(load_saved_dataset(path))


def load_saved_dataset(path: Path):
    """The dataset (its 'train' split) of a save_to_disk folder, memory-mapped: rows are read as used."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise DataError(f"{path} is a folder but not one written by datasets' save_to_disk: {e}",
                        where=str(path),
                        fix="give a save_to_disk folder, or list the folder's .jsonl/.json/.parquet files "
                            "in data.sources") from e
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path} holds the splits {sorted(ds)} and none is named 'train'",
                            where=str(path),
                            fix=f"give the folder of the split to use, e.g. {path / sorted(ds)[0]}")
        ds = ds["train"]
    return ds
