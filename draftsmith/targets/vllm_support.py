"""Can the installed vLLM capture this target? Answered from vLLM's source text, without importing
vLLM (an import costs seconds and may touch the accelerator), so preflight stays fast."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from draftsmith.targets.vllm_compat import NEWEST_VLLM, OLDEST_VLLM, TESTED_VLLM, release_series, support_range_problem
from draftsmith.targets.vllm_install import installed_vllm_version, vllm_package_dir


def _vllm_models_dir() -> Path | None:
    root = vllm_package_dir()
    return root / "model_executor" / "models" if root else None


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
    """Whether ``cls`` of vLLM's models/<module>.py (or a ``vllm.``-dotted module, as the registry
    names some) has ``interface`` among its bases, followed through imports across vLLM's files:
    Phi-3's and Mistral's classes subclass llama.py's, which declares the interface."""
    module = module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"
    return _has_base(module, cls, interface, frozenset())


def _has_base(module: str, name: str, interface: str, seen: frozenset) -> bool:
    """Whether ``name`` of ``module`` is ``interface`` or has it among its bases, at any depth."""
    if name == interface:
        return True
    if (module, name) in seen or _module_file(module) is None:  # a cycle, or outside vLLM (torch.nn.Module)
        return False
    seen = seen | {(module, name)}
    for definition in _module_names(module).get(name, ()):
        if isinstance(definition, ast.Subscript):  # Generic[T]
            definition = definition.value
        if isinstance(definition, ast.Name):
            found = _has_base(module, definition.id, interface, seen)
        else:  # an import, or a dotted base (llama.LlamaForCausalLM) through an import
            target = definition if isinstance(definition, str) else _absolute(module, definition)
            owner, _, attr = (target or "").rpartition(".")
            found = bool(target) and _has_base(owner, attr, interface, seen)
        if found:
            return True
    return False


@cache
def _module_names(module: str) -> dict[str, list[ast.expr | str]]:
    """What defines each top-level name of a vLLM module: a class's bases or an alias's value (as
    expressions to read in this module), or the absolute dotted name an import binds it to. ``if``
    and ``try`` blocks count (of ``if TYPE_CHECKING`` the runtime branch only); a name defined
    several ways keeps every way."""
    names: dict[str, list[ast.expr | str]] = {}
    for node in _top_level(ast.parse(_module_file(module).read_text(encoding="utf-8")).body):
        if isinstance(node, ast.ClassDef):
            names.setdefault(node.name, []).extend(node.bases)
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Name, ast.Attribute)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.ImportFrom):
            source = _import_source(module, node)
            for alias in node.names:
                names.setdefault(alias.asname or alias.name, []).append(f"{source}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:  # import a.b.c binds a; import a.b.c as m binds m to a.b.c
                bound = alias.asname or alias.name.partition(".")[0]
                names.setdefault(bound, []).append(alias.name if alias.asname else bound)
    return names


def _top_level(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, ast.If):
            type_checking = _dotted(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            yield from _top_level(node.orelse if type_checking else node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + [s for h in node.handlers for s in h.body] + node.orelse)
        else:
            yield node


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        owner = _dotted(expr.value)
        return owner and f"{owner}.{expr.attr}"
    return None


def _absolute(module: str, expr: ast.expr) -> str | None:
    """The absolute dotted name of ``llama.LlamaForCausalLM`` in ``module``, through the import
    that binds ``llama`` there; None for anything else (a call, a name no import binds)."""
    head, _, rest = (_dotted(expr) or "").partition(".")
    bound = [d for d in _module_names(module).get(head, ()) if isinstance(d, str)] if rest else []
    return f"{bound[0]}.{rest}" if bound else None


def _import_source(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from, relative levels resolved."""
    if not node.level:
        return node.module or ""
    package = module if _module_file(module).name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _module_file(module: str) -> Path | None:
    """The source file of a vLLM module (a ``.py`` file or a package's ``__init__.py``)."""
    root = vllm_package_dir()
    if root is None or not module.startswith("vllm."):
        return None
    path = root.joinpath(*module.split(".")[1:])
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


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
