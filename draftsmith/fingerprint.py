"""Code fingerprints for honest caching: a rule reruns when the package code it uses changes.

Snakemake tracks a rule's ``script:`` file but not the modules that script imports, so each rule
takes as a parameter the hash of its script and of every draftsmith module the script imports,
directly or through other draftsmith modules (lazy imports inside functions included). The same
closure keys the caches inside a stage (training checkpoints, extraction shards, regeneration
chunks): a resume is only ever a resume of the same code.

What is hashed is each file's token stream, not its bytes: comments, blank lines and spacing
within a line change nothing, so a comment edit reruns nothing; code, docstrings (string tokens)
and indentation (which is Python's structure) change the fingerprint.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import tokenize
from collections.abc import Iterable, Mapping
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


def _imports(file: Path, package: str | None) -> set[str]:
    """Every module ``file`` names in an import statement; relative ones resolved against ``package``."""
    stat = file.stat()
    return set(_parsed_imports(file, package, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=1024)
def _parsed_imports(file: Path, package: str | None, mtime_ns: int, size: int) -> frozenset[str]:
    # Parsing is most of a fingerprint's cost, and every rule's closure shares most files; the
    # file's modification time and size in the key let an edited file be parsed again.
    found = set()
    for node in _statements(ast.parse(file.read_text(encoding="utf-8")).body):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if not package:
                    continue  # a relative import outside a package imports nothing of ours
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            # `from draftsmith.targets import inspect` imports a module, not a name
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return frozenset(found)


def _statements(nodes: list) -> Iterable[ast.AST]:
    """Every statement, nested ones (in functions, classes, if/try/with blocks) included: imports
    are statements, so expressions need no visit."""
    for node in nodes:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                yield from _statements(children)


def _imported_modules(file: Path, module: str) -> set[str]:
    """draftsmith modules that ``file`` (the module ``module``) imports, with their parent packages."""
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    return _package_modules(_imports(file, package))


def _package_modules(names: Iterable[str]) -> set[str]:
    # Importing a.b.c runs a/__init__.py and a/b/__init__.py first: they belong to the closure too.
    found = set()
    for name in names:
        parts = name.split(".")
        found.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    return {m for m in found if _module_file(m) is not None}


def module_closure(*modules: str) -> list[Path]:
    """The files of ``modules`` and of every draftsmith module they import, transitively."""
    for module in modules:
        if _module_file(module) is None:
            raise ValueError(f"{module} is not a module of the {PACKAGE} package")
    return _closure(_package_modules(modules))


def _closure(modules: Iterable[str]) -> list[Path]:
    seen: dict[str, Path] = {}
    todo = list(modules)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        file = _module_file(module)
        seen[module] = file
        todo.extend(_imported_modules(file, module))
    return sorted(set(seen.values()))


def script_closure(script: str | Path) -> list[Path]:
    """The draftsmith module files a script (not itself a module of the package) imports, transitively."""
    return _closure(_package_modules(_imports(Path(script), None)))


def code_tokens(file: Path) -> bytes:
    """What of ``file`` the fingerprint hashes: its tokens without comments and blank lines."""
    return _code_tokens(file.read_bytes())


@functools.lru_cache(maxsize=1024)
def _code_tokens(data: bytes) -> bytes:
    # Keyed by the content itself: tokenizing is the cost, and every rule's closure shares most files.
    try:
        tokens = list(tokenize.tokenize(io.BytesIO(data).readline))
    except (tokenize.TokenError, SyntaxError):
        return data  # a file Python cannot read fails its rule at import; its bytes still key it
    kept = []
    for token in tokens:
        if token.type in (tokenize.COMMENT, tokenize.NL):
            continue
        # An INDENT's text is the indentation itself: the block structure is in the INDENT/DEDENT
        # tokens, so re-indenting a file by another width changes nothing either.
        kept.append(f"{token.type}\0{'' if token.type == tokenize.INDENT else token.string}")
    return "\0\0".join(kept).encode()


def _digest(files: Iterable[Path], script: Path | None = None) -> str:
    digest = hashlib.sha256()
    named = [(script.name, script)] if script else []
    named += [(str(file.relative_to(PACKAGE_DIR)), file) for file in files]
    for name, file in named:
        data = code_tokens(file)
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def code_fingerprint(*modules: str) -> str:
    """A short hash of the source of ``modules`` and their draftsmith imports."""
    return _digest(module_closure(*modules))


def script_fingerprint(script: str | Path) -> str:
    """A short hash of a workflow script and of every draftsmith module it imports, transitively."""
    script = Path(script)
    return _digest(script_closure(script), script)


def module_name(file: Path) -> str:
    """The dotted name of a package file (``draftsmith/targets/inspect.py`` -> draftsmith.targets.inspect)."""
    parts = list(file.relative_to(PACKAGE_DIR).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def package_modules() -> list[str]:
    """Every module of the package, by dotted name."""
    return sorted(module_name(f) for f in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in f.parts)


def rerun_table(scripts: Mapping[str, str | Path], edges: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """For each package module, the rules a change to it reruns: the rules whose script imports it
    (``scripts``: rule -> script file) and every rule downstream of them (``edges``: (upstream,
    downstream) pairs of the rule graph)."""
    downstream: dict[str, set[str]] = {}
    for up, down in edges:
        downstream.setdefault(up, set()).add(down)
    users: dict[str, set[str]] = {}
    for rule, script in scripts.items():
        for file in script_closure(script):
            users.setdefault(module_name(file), set()).add(rule)
    table = {}
    for module in package_modules():
        reached, todo = set(), list(users.get(module, ()))
        while todo:
            rule = todo.pop()
            if rule not in reached:
                reached.add(rule)
                todo.extend(downstream.get(rule, ()))
        table[module] = sorted(reached)
    return table
