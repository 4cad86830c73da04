"""Code fingerprints for honest caching: a rule reruns when the package code it uses changes.

Snakemake tracks a rule's ``script:`` file but not the modules that script imports, so each rule
takes as a parameter the hash of its draftsmith modules and everything they import from draftsmith.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PACKAGE = PACKAGE_DIR.name


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = PACKAGE_DIR.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_modules(file: Path, module: str) -> set[str]:
    """draftsmith modules that ``file`` imports anywhere (lazy imports inside functions too)."""
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            # `from draftsmith.targets import inspect` imports a module, not a name
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if _module_file(m) is not None}


def module_closure(*modules: str) -> list[Path]:
    """The files of ``modules`` and of every draftsmith module they import, transitively."""
    seen: dict[str, Path] = {}
    todo = list(modules)
    while todo:
        module = todo.pop()
        file = _module_file(module)
        if file is None:
            raise ValueError(f"{module} is not a module of the {PACKAGE} package")
        if module in seen:
            continue
        seen[module] = file
        todo.extend(_imported_modules(file, module))
    return sorted(set(seen.values()))


def code_fingerprint(*modules: str) -> str:
    """A short hash of the source of ``modules`` and their draftsmith imports."""
    digest = hashlib.sha256()
    for file in module_closure(*modules):
        digest.update(str(file.relative_to(PACKAGE_DIR)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]
