"""Crash-safe file writing and checksums shared by every stage."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

from draftsmith.errors import DraftsmithError, StorageError


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def storage_error(path: str | Path, error: OSError) -> StorageError:
    """A failed write as an error that says what to do: free space, or make the folder writable."""
    if isinstance(error, StorageError):
        return error
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free disk space (or move the results folder to a larger disk) and rerun: finished work is kept"
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "make the folder writable (or run the workflow from a folder you can write to) and rerun"
    else:
        fix = "check the disk and the folder, then rerun: finished work is kept"
    return StorageError(f"cannot write {Path(path).name}: {error.strerror or error}", where=str(path), fix=fix,
                        errno=error.errno)


_HELD_LOCKS: set[Path] = set()


def lock_beside(folder: Path) -> Path:
    """The ``sole_writer`` lock of the files in ``folder``: beside it, so that clearing the folder
    whole leaves the lock alone."""
    folder = Path(folder)
    return folder.parent / f"{folder.name}.lock"


def _superseded_mark(lock: Path) -> Path:
    return lock.with_name(f"{lock.name}.superseded")


@contextmanager
def sole_writer(lock: Path, doing: str, where: str, error: type[DraftsmithError]) -> Iterator[Path]:
    """Hold ``lock`` for this process alone while the block runs (again within it: a no-op).

    An orphaned job (its Snakemake killed) and the rerun's job would otherwise write the same
    files side by side. The lock is ``flock`` on ``lock``, taken without waiting: the kernel drops
    it when the holder's last descriptor closes, so a writer killed any way (SIGKILL, the OOM killer)
    leaves no stale lock. It holds the holder's pid@host while held and nothing after. A second
    writer gets ``error``: "another process ... is ``doing``", ``where`` and how to find the first,
    and marks the first superseded (``check_not_superseded``).
    """
    lock = Path(lock).absolute()
    if lock in _HELD_LOCKS:
        yield lock
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
            pid, _, host = holder.partition("@")
            # Snakemake runs one job per output, so the holder is left over from a killed run. This
            # job's failure is recorded against the outputs, and whatever the holder writes there later
            # would pass for this job's work: the mark stops it from writing them.
            _superseded_mark(lock).write_text(f"{os.getpid()}@{socket.gethostname()}\n")
            raise error(
                f"another process ({f'pid {pid} on {host}' if pid else 'pid not yet written'}) is {doing}",
                where=f"{where} (lock {lock})",
                fix="wait for it to finish, or stop it if it is left over from a killed run "
                    f"({f'kill {pid} on {host}' if pid else 'fuser ' + str(lock) + ' names it'}), then rerun: "
                    "it leaves its result to the rerun, which resumes from the work it kept") from None
        # This writer is the latest. (A refusal in the instant between the flock and this unlink is
        # lost: it comes from a job started as this one was, not from the rerun of an orphan.)
        _superseded_mark(lock).unlink(missing_ok=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode(), 0)
        _HELD_LOCKS.add(lock)
        try:
            yield lock
        finally:
            _HELD_LOCKS.discard(lock)
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def check_not_superseded(lock: Path, doing: str, error: type[DraftsmithError], written: Iterable[Path] = ()) -> None:
    """Around the holder of ``lock`` writing a rule's outputs (before, and after with ``written``,
    which it then removes): stop if a later job was refused the lock meanwhile (``sole_writer``).
    This process then outlived its own Snakemake (or shares a results folder with another run), and
    the outputs belong to that job's rerun, which resumes from the work this process kept."""
    mark = _superseded_mark(Path(lock).absolute())
    if mark.exists():
        for path in written:  # written while the later job failed: Snakemake would take them for its
            Path(path).unlink(missing_ok=True)
        later = mark.read_text(errors="replace").strip()
        raise error(f"a later job ({later}) asked for the same work while this process was {doing}: this "
                    "process, which outlived its own Snakemake (or shares the results folder with another "
                    "run), leaves the rule's outputs to that job's rerun",
                    where=str(mark), fix="rerun the workflow: it resumes from the work this process kept")


@contextmanager
def publishing(lock: Path, doing: str, error: type[DraftsmithError], outputs: Iterable[Path]) -> Iterator[None]:
    """The block writes a rule's ``outputs`` as the holder of ``lock``: ``check_not_superseded``
    before it, and after it, removing the outputs, since a later job may be refused meanwhile."""
    check_not_superseded(lock, doing, error)
    yield
    check_not_superseded(lock, doing, error, written=outputs)


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read once at import: os.umask can only be read by setting it, which races with writer threads.
_UMASK = _read_umask()


def share_mode(fd: int) -> None:
    """Give a file made by mkstemp (0600) the mode of any file the user writes (0644 under umask 022):
    results are shared artifacts."""
    os.fchmod(fd, 0o666 & ~_UMASK)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a part.

    A failed write (disk full, unwritable folder) leaves no file behind and raises StorageError.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise storage_error(path, e) from e
    try:
        share_mode(fd)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, StorageError):
            raise storage_error(path, e) from e
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | Path, *, error: type[DraftsmithError] | None = None, fix: str = "") -> Any:
    """A JSON file's value; with ``error``, a file that is not JSON (damaged, or cut by a full disk)
    raises it, naming the file, with ``fix``."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except ValueError as e:
            if error is None:
                raise
            raise error(f"{Path(path).name} is not JSON ({e})", where=str(path), fix=fix) from None


def check_safetensors(path: str | Path, *, error: type[DraftsmithError], fix: str) -> None:
    """Raise ``error`` naming ``path`` when it is missing or not a whole safetensors file (its header
    unreadable, or its tensors past the file's end), rather than safetensors' own message later."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt"):
            pass
    except Exception as e:  # safetensors raises its own SafetensorError, an OSError, or a ValueError
        raise error(f"{Path(path).name} cannot be read as safetensors ({e})", where=str(path), fix=fix) from None


def read_jsonl(path: str | Path, *, error: type[DraftsmithError] | None,
               fix: str | None = None) -> Iterator[tuple[int, Any]]:
    """The rows of a JSON-lines file with their line numbers, blank lines skipped. A line that is
    not JSON raises ``error`` naming the file and line, with ``fix``; with ``error=None`` it is
    passed over instead (a log's last line, torn by a kill)."""
    with open(path, encoding="utf-8") as f:
        yield from parse_jsonl_lines(path, 1, f, error=error, fix=fix)


def read_jsonl_chunks(path: str | Path, chunk_bytes: int) -> Iterator[tuple[int, list[bytes]]]:
    """The lines of a JSON-lines file, unparsed, in chunks of about ``chunk_bytes``, each with the
    number of its first line: for ``parse_jsonl_lines`` in whichever process takes the chunk."""
    with open(path, "rb") as f:
        first = 1
        while lines := f.readlines(chunk_bytes):
            yield first, lines
            first += len(lines)


def parse_jsonl_lines(path: str | Path, first_line: int, lines: Iterable[str | bytes], *,
                      error: type[DraftsmithError] | None, fix: str | None = None) -> Iterator[tuple[int, Any]]:
    """``read_jsonl`` of ``lines``, the lines of ``path`` from line ``first_line`` on."""
    for lineno, line in enumerate(lines, start=first_line):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if error is None:
                continue
            raise error(f"line {lineno} is not valid JSON: {e.msg} (column {e.colno})",
                        where=f"{path}:{lineno}", fix=fix) from e
        yield lineno, row


def sha256_file(path: str | Path, chunk_size: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in chunks so large shards do not fill memory."""
    digest = hashlib.sha256()
    _feed_file(digest, path, chunk_size)
    return digest.hexdigest()


def _feed_file(digest, path: str | Path, chunk_size: int = 1 << 22) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)


# Hidden-state files are checksummed with XXH3-128: it catches what their checksums are for
# (flipped bits, torn or truncated writes) as surely as SHA-256, at memory speed. SHA-256 runs at
# ~1.5 GB/s a core: it was the shard writer's largest CPU cost, and checking a 5.7 TB store cost
# an hour of CPU. A digest names its algorithm; a bare hex one is SHA-256 (older stores).
CHECKSUM = "xxh3_128"


def checksum_hasher():
    """A hasher for the store's checksum, fed with ``update`` as the bytes are written."""
    return xxhash.xxh3_128()


def checksum_digest(hasher) -> str:
    """The digest to record for a ``checksum_hasher``: ``xxh3_128:<hex>``."""
    return f"{CHECKSUM}:{hasher.hexdigest()}"


def _hasher_for(expected: str) -> tuple[Any, str]:
    """The hasher a recorded digest was made with, and the hex it must give."""
    algorithm, _, hex_digest = expected.rpartition(":")
    return (checksum_hasher() if algorithm == CHECKSUM else hashlib.sha256()), hex_digest


def bytes_match(data: bytes, expected: str) -> bool:
    """Whether ``data`` has the recorded checksum ``expected`` (either algorithm)."""
    hasher, hex_digest = _hasher_for(expected)
    hasher.update(data)
    return hasher.hexdigest() == hex_digest


def file_matches(path: str | Path, expected: str) -> bool:
    """Whether the file at ``path`` has the recorded checksum ``expected`` (either algorithm)."""
    hasher, hex_digest = _hasher_for(expected)
    _feed_file(hasher, path)
    return hasher.hexdigest() == hex_digest
