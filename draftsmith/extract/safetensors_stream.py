"""Safetensors files written front to back while their tensors are still being produced: the bytes
of ``safetensors.torch.save``, checksummed while written.

On a local disk file system (ext4, XFS, Btrfs) a stream writes with ``O_DIRECT``: the store is
written once and read later, so the page cache only costs the writer's CPU (the kernel's copy and
the cache's upkeep: about 3 times the store's CPU seconds on an ext4 disk, ``bench/store_rate.py``).
Direct I/O wants whole blocks at block-aligned addresses and offsets, so the bytes pass through an
aligned staging buffer, and the file's last partial block is written padded and truncated back.
Elsewhere it writes through the page cache (``DIRECT_IO_FILE_SYSTEMS`` says why). A file that is
read back soon after it is written (``read_soon``: the online window, whose trainer reads each shard
seconds later) goes through the page cache everywhere and its pages are left there (as long as
memory allows), so that its reader reads memory rather than the disk the writer is busy with.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import json
import math
import mmap
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from draftsmith.errors import ExtractionError
from draftsmith.io import checksum_digest, checksum_hasher

SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
}
_WRITE_CHUNK = 1 << 24
_BLOCK = 4096  # O_DIRECT's unit of address, length and offset (the logical block size or a multiple)
_STAGING_BYTES = 1 << 23


# Local disk file systems, where direct writes of whole staged blocks go at the disk's rate. Elsewhere
# the page cache stays: tmpfs and ramfs have no disk to bypass (direct I/O would only add the staging
# copy), and on network file systems (NFS, Lustre, ...) a direct write waits for the server, one at a time.
DIRECT_IO_FILE_SYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs"}


@functools.lru_cache(maxsize=64)
def file_system_type(folder: str) -> str | None:
    """The type of the file system holding ``folder`` (the longest mount point above it), on Linux."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # \040 is a space
        # >=: of mounts stacked on one point, the last listed is the one visible
        if (folder == mount or folder.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


def direct_io_pays(folder: str | Path) -> bool:
    """Whether files in ``folder`` are written with ``O_DIRECT``: on a local disk file system."""
    kind = file_system_type(os.path.realpath(os.path.abspath(folder)))
    return hasattr(os, "O_DIRECT") and kind in DIRECT_IO_FILE_SYSTEMS


@functools.cache
def _sync_file_range():
    """Linux's ``sync_file_range`` (absent from ``os``), or None where libc has none."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the dirty pages, without waiting and without dropping them


def _open_for_writing(path: str | Path, direct_if_it_pays: bool):
    """An unbuffered file object, with ``O_DIRECT`` where asked, where it pays and where the file
    system accepts it at open."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    direct = os.O_DIRECT if direct_if_it_pays and direct_io_pays(os.path.dirname(os.path.abspath(path))) else 0
    try:
        fd = os.open(path, flags | direct, 0o644) if direct else os.open(path, flags, 0o644)
    except OSError as error:
        if error.errno != errno.EINVAL:  # EINVAL: this file system has no direct I/O (tmpfs, some FUSE)
            raise
        fd = os.open(path, flags, 0o644)
    return open(fd, "wb", buffering=0)


class SafetensorsStream:
    """A safetensors file written front to back while its tensors are still being produced.

    ``layout`` fixes every tensor's name, dtype and final shape, in file order, so the header
    goes out first; ``write`` then takes the next bytes in that order (a tensor may come in row
    blocks), hashing them on the way with the GIL released. ``close`` checks that every byte came,
    syncs the file and returns its checksum (``draftsmith.io``). ``read_soon``: the file is read back
    soon after it is written, so it goes through the page cache and its pages are left there.
    """

    def __init__(self, path: str | Path, layout: Sequence[tuple[str, torch.dtype, Sequence[int]]], *,
                 read_soon: bool = False) -> None:
        header, offset = {}, 0
        for name, dtype, shape in layout:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        self.dtypes = [dtype for _, dtype, _ in layout]
        self.ends = [header[name]["data_offsets"][1] for name, _, _ in layout]
        self.expected, self.written, self.current = offset, 0, 0
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        self.path, self.file_bytes = str(path), 8 + len(text) + offset
        self.digest = checksum_hasher()
        self.read_soon = read_soon
        self.file = _open_for_writing(path, direct_if_it_pays=not read_soon)
        try:
            self.direct = bool(fcntl.fcntl(self.file.fileno(), fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
            # Direct writes leave from this page-aligned buffer in whole blocks; numpy copies into it
            # with the GIL released, as the other layer files' threads need.
            private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self.staging = (np.frombuffer(mmap.mmap(-1, _STAGING_BYTES, flags=private), dtype=np.uint8)
                            if self.direct else None)
            self.staged = 0
            self._put(memoryview(len(text).to_bytes(8, "little") + text))
        except BaseException:
            self.file.close()
            raise

    def _put(self, buffer: memoryview) -> None:
        for start in range(0, len(buffer), _WRITE_CHUNK):
            chunk = buffer[start:start + _WRITE_CHUNK]
            self.digest.update(chunk)
            if self.staging is None:
                self._write(chunk)
                continue
            data = np.frombuffer(chunk, dtype=np.uint8)
            while len(data):
                n = min(len(data), _STAGING_BYTES - self.staged)
                self.staging[self.staged:self.staged + n] = data[:n]
                self.staged, data = self.staged + n, data[n:]
                if self.staged == _STAGING_BYTES:
                    self._write(memoryview(self.staging))
                    self.staged = 0

    def _write(self, data: memoryview) -> None:
        while len(data):
            try:
                n = self.file.write(data)
            except OSError as error:
                if not (self.direct and error.errno == errno.EINVAL):
                    raise
                # The file system took O_DIRECT at open but refuses its writes: go through the page cache.
                fd = self.file.fileno()
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False
                continue
            data = data[n:]

    def write(self, tensor: torch.Tensor) -> None:
        data = tensor.detach().cpu().contiguous()
        size = data.numel() * data.element_size()
        if not size:
            return
        while self.current < len(self.ends) - 1 and self.written == self.ends[self.current]:
            self.current += 1
        if data.dtype != self.dtypes[self.current] or self.written + size > self.ends[self.current]:
            raise ExtractionError(f"{size} bytes of {data.dtype} do not fit tensor {self.current} of the file "
                                  f"({self.dtypes[self.current]}, {self.ends[self.current] - self.written} bytes left)",
                                  where=self.path)
        self._put(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self.written += size

    def start_writeback(self) -> None:
        """Without direct I/O: hand what is written so far to the disk now (asynchronously), so the
        sync at the end waits for the last bytes only. A file read later drops its pages, so that the
        page cache does not fill with the store; one read soon keeps them for its reader."""
        if self.direct:
            return
        if self.read_soon:
            if (sync_file_range := _sync_file_range()) is not None:  # a hint: close's fsync does the rest
                sync_file_range(self.file.fileno(), 0, 0, _SYNC_FILE_RANGE_WRITE)
        elif hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> str:
        if self.written != self.expected:
            raise ExtractionError(f"{self.written} of {self.expected} data bytes written", where=self.path)
        if self.staged:  # the last partial block goes out whole, zero-padded, and the file is cut back
            padded = -(-self.staged // _BLOCK) * _BLOCK
            self.staging[self.staged:padded] = 0
            self._write(memoryview(self.staging[:padded]))
            os.ftruncate(self.file.fileno(), self.file_bytes)
        os.fsync(self.file.fileno())
        self.file.close()
        self.staging = None  # its 8 MiB go back now, not when the stream is collected
        return checksum_digest(self.digest)

    def discard(self) -> None:
        """Close without syncing; the caller removes the file (a full disk may refuse the flush)."""
        self.staging = None
        try:
            self.file.close()
        except OSError:
            pass


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], *, read_soon: bool = False) -> str:
    """Write ``tensors`` as a safetensors file, fsync it, and return its checksum; the bytes equal
    ``safetensors.torch.save``'s (its order: larger elements first, then by name)."""
    items = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    stream = SafetensorsStream(path, [(name, t.dtype, tuple(t.shape)) for name, t in items], read_soon=read_soon)
    try:
        for _, tensor in items:
            stream.write(tensor)
        return stream.close()
    except BaseException:
        stream.discard()
        raise
