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
import os
from functools import cache
from pathlib import Path

from draftsmith.errors import DraftsmithError

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def engine_release(backend: str) -> dict:
    """What an engine's numbers depend on beyond the model, its dtype and its device: the vLLM
    release where ``backend`` is vLLM (its kernels). Part of what keys the output a stage keeps to
    resume (regenerated chunks, extracted shards), so the rerun a vLLM upgrade causes
    (the rules' ``engine`` parameter) never reuses the older release's output."""
    return {"vllm": installed_vllm_version()} if backend == "vllm" else {}


def installed_vllm_version() -> str | None:
    found = _installed_distribution()
    return found[1] if found else None


def _installed_distribution() -> tuple[str, str] | None:
    """The vLLM distribution installed (name, version), the first of ``VLLM_DISTRIBUTIONS`` found, as
    vLLM reads its own version."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
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


def vllm_cpu_build() -> bool:
    """Whether vLLM runs on the CPU whatever the machine has: ``VLLM_TARGET_DEVICE=cpu``, or the
    installed build is the CPU one (the ``vllm-cpu`` distribution, or a version that names it)."""
    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return True
    name, version = _installed_distribution() or ("", "")
    return name == "vllm-cpu" or "cpu" in version


@cache
def vllm_device_type() -> str:
    """``cpu`` or ``cuda``, as ``vllm.platforms.current_platform.device_type`` says it, by vLLM's own
    rule: the CPU where ``VLLM_TARGET_DEVICE=cpu`` or the installed build is the CPU one (the
    ``vllm-cpu`` distribution, or a version that names it), else CUDA where NVML counts a GPU (all of
    them, as vLLM counts them, without initialising CUDA in this process); anything else from vLLM."""
    if vllm_cpu_build():
        return "cpu"
    import torch

    try:
        gpus = torch.cuda._raw_device_count_nvml()  # NVML's count; -1 where NVML does not answer
    except OSError:  # no NVML library: no NVIDIA driver here
        gpus = -1
    if gpus > 0:
        return "cuda"
    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        raise vllm_import_error(e) from e
    return current_platform.device_type


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

    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError as e:
        raise vllm_import_error(e) from e
    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


def vllm_import_error(e: ImportError) -> DraftsmithError:
    """An installed vLLM that does not import (built for another torch, a library missing)."""
    return DraftsmithError(f"vLLM cannot be imported: {e}", where="the job's Python environment",
                           fix="run in the vLLM environment (envs/vllm.yaml, or scripts/setup.sh --cuda), "
                               "or use the hf backends")
