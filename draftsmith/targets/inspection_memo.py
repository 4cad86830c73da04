"""Descriptions of targets kept between preflights, reused where nothing they were made from changed.

Most of a preflight's CPU is ``inspect_target``'s meta build: importing torch and transformers'
model code to build the module tree (3.6 of its 5-6 CPU-seconds on a 2-core machine, whatever the
model's size). A user runs the preflight against one target again and again (another config, other
data, a results folder wiped), so each description is kept in ``$DRAFTSMITH_CACHE_DIR`` (default
``$XDG_CACHE_HOME/draftsmith``, else ``~/.cache/draftsmith``), under ``targets/``, keyed by all it is
made from:

* the model folder's ``weights_identity`` (targets.identity): every small file by its contents
  (config, tokenizer, chat template, remote code), the weight files by size, times and header,
  which the inspection never reads;
* the inspection's settings (aux layers, layers path, remote code);
* the code that makes it: draftsmith's (its code fingerprint), the Python packages' (their
  releases, and the time each site-packages folder of ``sys.path`` last changed, which any install,
  upgrade or removal moves).

So an edited config, a patch or an upgrade is a new key, never an old answer; only successful
inspections are kept, and a kept one that cannot be read is made again. Where the key cannot see
all the code, nothing is kept: torch, transformers or vLLM installed in editable mode (a ``git
pull`` changes their code under the same release), or remote code that ``auto_map`` takes from
another repository. A cache that cannot be read or written is no error: the target is inspected.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from draftsmith.io import atomic_write_json
from draftsmith.targets.vllm_install import VLLM_DISTRIBUTIONS, installed_vllm_version

log = logging.getLogger(__name__)

CACHE_ENV = "DRAFTSMITH_CACHE_DIR"
MEMO_FORMAT = "draftsmith.inspection-memo/1"
PACKAGES = ("torch", "transformers", *VLLM_DISTRIBUTIONS)  # whose code builds the description
MEMO_MAX_ENTRIES = 256


def cache_dir() -> Path:
    """Draftsmith's cache folder on this machine (``DRAFTSMITH_CACHE_DIR``, else the XDG cache)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "draftsmith"


def inspection_key(model_path: Path, settings: Mapping) -> str | None:
    """What a description of the target in ``model_path`` (resolved) depends on, hashed; None where
    that cannot all be seen (module docstring), so nothing is kept or taken."""
    from draftsmith.fingerprint import code_fingerprint
    from draftsmith.targets.identity import weights_identity

    try:
        auto_map = json.loads((model_path / "config.json").read_text(encoding="utf-8")).get("auto_map") or {}
        if "--" in json.dumps(auto_map) or any(_editable(name) for name in PACKAGES):
            return None
        head = {"format": MEMO_FORMAT, "model_path": str(model_path), "settings": dict(settings),
                "files": weights_identity(model_path), "code": code_fingerprint("draftsmith.targets.inspect"),
                "python": sys.version, "torch": _release("torch"), "transformers": _release("transformers"),
                "vllm": installed_vllm_version(),
                "environment": _environment_changes()}
    except (OSError, ValueError, AttributeError):  # an unreadable file or config: the inspection says what
        return None
    return hashlib.sha256(json.dumps(head, sort_keys=True, default=str).encode()).hexdigest()


def recall(key: str) -> dict | None:
    """The description kept under ``key``, or None."""
    try:
        kept = json.loads((cache_dir() / "targets" / f"{key}.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: no home folder to find the cache in
        log.warning("the kept description of the target is unreadable (%s): inspecting it again", e)
        return None
    return kept if isinstance(kept, dict) else None


def remember(key: str, info: dict) -> None:
    """Keep ``info`` under ``key``, and the newest ``MEMO_MAX_ENTRIES`` descriptions; a cache folder
    that cannot be written keeps nothing."""
    try:
        folder = cache_dir() / "targets"
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(folder / f"{key}.json", info)
        kept = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
        for old in kept[:-MEMO_MAX_ENTRIES]:  # each code edit is a new key: the old ones go
            old.unlink(missing_ok=True)
    except (OSError, RuntimeError) as e:
        log.info("the target's description is not kept for the next preflight: %s (set %s to a writable folder)",
                 e, CACHE_ENV)


def _release(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _environment_changes() -> list[tuple[str, int]]:
    """When each folder Python imports from last changed: an install or removal changes its listing."""
    folders = []
    for entry in sys.path:
        if not entry.endswith(("site-packages", "dist-packages")):  # not the working folder: runs write there
            continue
        try:
            folders.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            continue
    return folders


def _editable(name: str) -> bool:
    """Whether the distribution is installed in editable mode (pip's ``direct_url.json``)."""
    try:
        direct_url = importlib.metadata.distribution(name).read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return False
    return bool(direct_url) and bool(json.loads(direct_url).get("dir_info", {}).get("editable"))
