"""Safetensors files written front to back while their tensors are still being produced: the bytes
of ``safetensors.torch.save``, written straight from tensor memory and checksummed while written."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from draftsmith.errors import ExtractionError
from draftsmith.io import checksum_digest, checksum_hasher

SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
}
_WRITE_CHUNK = 1 << 24


class SafetensorsStream:
    """A safetensors file written front to back while its tensors are still being produced.

    ``layout`` fixes every tensor's name, dtype and final shape, in file order, so the header
    goes out first; ``write`` then takes the next bytes in that order (a tensor may come in row
    blocks), hashing them on the way, straight from the tensors' memory with the GIL released.
    ``close`` checks that every byte came, syncs the file and returns its checksum (``draftsmith.io``).
    """

    def __init__(self, path: str | Path, layout: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> None:
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
        self.digest = checksum_hasher()
        self.file = open(path, "wb")  # noqa: SIM115 - closed by close() or discard()
        self._put(memoryview(len(text).to_bytes(8, "little") + text))

    def _put(self, buffer: memoryview) -> None:
        for start in range(0, len(buffer), _WRITE_CHUNK):
            chunk = buffer[start:start + _WRITE_CHUNK]
            self.file.write(chunk)
            self.digest.update(chunk)

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
                                  where=self.file.name)
        self._put(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self.written += size

    def start_writeback(self) -> None:
        """Hand what is written so far to the disk now (asynchronously), so the sync at the end
        waits for the last bytes only, and the page cache does not fill with the store."""
        self.file.flush()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> str:
        if self.written != self.expected:
            raise ExtractionError(f"{self.written} of {self.expected} data bytes written", where=self.file.name)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return checksum_digest(self.digest)

    def discard(self) -> None:
        """Close without syncing; the caller removes the file (a full disk may refuse the flush)."""
        try:
            self.file.close()
        except OSError:
            pass


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> str:
    """Write ``tensors`` as a safetensors file, fsync it, and return its checksum; the bytes equal
    ``safetensors.torch.save``'s (its order: larger elements first, then by name)."""
    items = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    stream = SafetensorsStream(path, [(name, t.dtype, tuple(t.shape)) for name, t in items])
    try:
        for _, tensor in items:
            stream.write(tensor)
        return stream.close()
    except BaseException:
        stream.discard()
        raise
