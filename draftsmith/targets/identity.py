"""The target's identity is its content: a fingerprint of a model folder that changes when its
weights, config or tokenizer change, computed in milliseconds without reading the weights.

Hashing a trillion-parameter checkpoint would take longer than the work it guards, so weight files
are identified by size, modification and status-change times (nanoseconds) and, for safetensors, a
hash of the header (every tensor's name, dtype, shape and offsets); all other files of the folder
(config, tokenizer, chat template, the safetensors index) are hashed whole. The status-change time
(``st_ctime``) is the kernel's: any write moves it, and so does putting an old modification time
back (``touch -d``, ``os.utime``, ``rsync -t``), so weights edited in place are seen whatever
their modification time says. It costs one ``stat`` per file (``bench/identity.py``: a 2 TB
checkpoint of 64 files in milliseconds). What it also sees, at the price of a rerun and never a
stale result: a ``chmod``/``chown`` of the files, a copy (``cp -p`` included) or a move to another
disk.

The data sources are identified the same way, by stat alone (``files_fingerprint``): a source
replaced by an older file (``mv``, ``cp -p``, ``rsync -t``) or a save_to_disk folder written again
is seen, where Snakemake's comparison of modification times sees neither.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

from draftsmith.io import sha256_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SMALL_FILE_BYTES = 64 << 20  # files up to this size (not weights) are hashed whole
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def _safetensors_header(path: Path) -> str | None:
    """The hash of a safetensors file's header, or None when the file has no valid header."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None
        (size,) = struct.unpack("<Q", head)
        if size > _MAX_HEADER_BYTES:
            return None
        return hashlib.sha256(f.read(size)).hexdigest()


def weights_identity(model_path: str | Path) -> dict:
    """What identifies a model folder's content: small files by hash, weights by size, modification
    and status-change times and safetensors header; not where the folder is, so a project or a
    model folder moved on its file system keeps its results. A missing folder has an empty identity."""
    model_path = Path(model_path)
    files: dict[str, dict] = {}
    if not model_path.is_dir():
        return {"files": files}
    for path in sorted(p for p in model_path.rglob("*") if p.is_file() and not _hidden(p, model_path)):
        stat = path.stat()
        name = str(path.relative_to(model_path))
        if path.suffix in WEIGHT_SUFFIXES:
            entry = _stat_identity(stat)
            if path.suffix == ".safetensors":
                entry["header"] = _safetensors_header(path)
        elif stat.st_size <= SMALL_FILE_BYTES:
            entry = {"sha256": sha256_file(path)}
        else:
            entry = _stat_identity(stat)
        files[name] = entry
    return {"files": files}


def _stat_identity(stat: os.stat_result) -> dict:
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns}


def _hidden(path: Path, root: Path) -> bool:
    # .cache/ (huggingface_hub's download metadata), .git/: not part of the model
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def checkpoint_files(model_path: Path) -> list[Path]:
    """The folder's safetensors files that hold the checkpoint, as vLLM's loader reads them: those
    its index names, else every one (never a copy in another format, nor subfolders)."""
    index = model_path / SAFETENSORS_INDEX
    if index.exists():
        return sorted({model_path / file for file in json.loads(index.read_text())["weight_map"].values()})
    return sorted(model_path.glob("*.safetensors"))


def weights_fingerprint(model_path: str | Path) -> str:
    """A short hash of ``weights_identity``: a parameter of every rule that runs the target's weights."""
    payload = json.dumps(weights_identity(model_path), sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def files_identity(path: str | Path) -> dict | None:
    """What identifies a file's, or a folder's (a save_to_disk dataset's), content without reading
    it: each file's size, modification and status-change times (a folder's files recursively, hidden
    ones left out). None for a missing path."""
    path = Path(path)
    if path.is_file():
        return _stat_identity(path.stat())
    if not path.is_dir():
        return None
    return {str(p.relative_to(path)): _stat_identity(p.stat())
            for p in sorted(path.rglob("*")) if p.is_file() and not _hidden(p, path)}


def files_fingerprint(paths: Iterable[str | Path]) -> str:
    """A short hash of each path's ``files_identity``: a parameter of the rules that read the data
    sources, one stat per file whatever their size."""
    payload = json.dumps({str(p): files_identity(p) for p in paths}, sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:16]
