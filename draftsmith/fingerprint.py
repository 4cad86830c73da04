"""Code fingerprints for honest caching: a rule reruns when the package code it uses changes.

Snakemake tracks a rule's ``script:`` file but not the modules that script imports, so each rule
takes as a parameter the hash of its script and of every draftsmith module the script imports,
directly or through other draftsmith modules (lazy imports inside functions included). The same
closure keys the caches inside a stage (training checkpoints, extraction shards, regeneration
chunks): a resume is only ever a resume of the same code.

What is hashed is each file's token stream, not its bytes: comments, blank lines and spacing
within a line change nothing, so a comment edit reruns nothing; code, docstrings (string tokens)
and indentation (which is Python's structure) change the fingerprint.

Parsing and tokenizing the package takes most of a second, and every Snakemake command (a plan, a
dry run, each job a cluster executor starts) fingerprints every rule again, so what earlier
processes computed is kept in the package's ``__pycache__`` (``MEMO_NAME``), keyed by the files'
contents: an edit is a new key, never a stale answer.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import json
import os
import sys
import tempfile
import tokenize
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PACKAGE = PACKAGE_DIR.name
MEMO_MAX_ENTRIES = 4096  # past this, a save keeps only what this process used
# A memo is read only by the Python version (tokenize's and ast's output may differ between them)
# and the fingerprinting code that wrote it: a fix to either must not meet the old answers.
MEMO_NAME = "fingerprints-{}.{}.json".format(*sys.version_info[:2])
MEMO_VERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = PACKAGE_DIR.joinpath(*parts[1:])
    # A package before a module of its name, as Python's import finds them (a stale regenerate.py
    # beside the regenerate/ package is never imported, so it keys nothing).
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


class _Memo:
    """What earlier processes computed, by content: a file's imports (by its bytes' hash and package)
    and a script's fingerprint (by the names and hashes of the files it covers)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.entries: dict[str, dict] = {}
        self.used: dict[str, set] = {"imports": set(), "fingerprints": set()}
        self.dirty = False

    def _load(self) -> None:
        path = PACKAGE_DIR / "__pycache__" / MEMO_NAME
        if path == self.path:
            return
        self.path, self.entries, self.dirty = path, {"imports": {}, "fingerprints": {}}, False
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            return  # none yet, or damaged: computed again
        if isinstance(saved, dict) and saved.get("version") == MEMO_VERSION:
            self.entries = {kind: dict(saved.get(kind) or {}) for kind in self.entries}

    def get(self, kind: str, key: str):
        self._load()
        self.used[kind].add(key)
        return self.entries[kind].get(key)

    def put(self, kind: str, key: str, value) -> None:
        self._load()
        self.used[kind].add(key)
        self.entries[kind][key] = value
        self.dirty = True

    def save(self) -> None:
        """Write what is new; a folder that cannot be written to (a read-only install) keeps none."""
        if not self.dirty or self.path is None:
            return
        entries = self.entries
        if sum(map(len, entries.values())) > MEMO_MAX_ENTRIES:
            entries = {kind: {k: v for k, v in found.items() if k in self.used[kind]} for kind, found in entries.items()}
        temporary = None
        try:
            self.path.parent.mkdir(exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as f:
                temporary = f.name
                json.dump({"version": MEMO_VERSION, **entries}, f)
            os.chmod(temporary, 0o644)  # like the bytecode beside it: whoever runs the workflow may read it
            os.replace(temporary, self.path)  # whole or not at all, whoever else writes it meanwhile
        except OSError:
            if temporary:
                Path(temporary).unlink(missing_ok=True)
            return
        self.dirty = False


_MEMO = _Memo()


def _contents(file: Path) -> tuple[bytes, str]:
    """``file``'s bytes and their SHA-256."""
    stat = file.stat()
    return _read(file, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)


@functools.lru_cache(maxsize=4096)
def _read(file: Path, mtime_ns: int, ctime_ns: int, size: int) -> tuple[bytes, str]:
    # Every rule's closure shares most files: each is read once a process. A write to a file, or a
    # modification time set back, moves its status-change time (to the kernel's clock tick), so an
    # edit is read again; the memo on disk is keyed by the bytes read, whatever the stat says.
    data = file.read_bytes()
    return data, hashlib.sha256(data).hexdigest()


def _imports(file: Path, package: str | None) -> set[str]:
    """Every module ``file`` names in an import statement; relative ones resolved against ``package``."""
    data, sha = _contents(file)
    key = f"{sha}:{package or ''}"
    found = _MEMO.get("imports", key)
    if found is None:
        found = sorted(_parsed_imports(data, package))
        _MEMO.put("imports", key, found)
    return set(found)


def _parsed_imports(data: bytes, package: str | None) -> set[str]:
    found = set()
    for node in _statements(ast.parse(data.decode("utf-8")).body):
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
    return found


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
    return _code_tokens(_contents(file)[0])


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
    named = [(script.name, script)] if script else []
    named += [(str(file.relative_to(PACKAGE_DIR)), file) for file in files]
    # each file read once: the memo's key and the tokens hashed come from the same bytes, even while
    # a checkout rewrites the files
    read = [(name, *_contents(file)) for name, file in named]
    key = hashlib.sha256("\0".join(f"{name}\0{sha}" for name, _, sha in read).encode()).hexdigest()
    found = _MEMO.get("fingerprints", key)
    if found is None:
        digest = hashlib.sha256()
        for name, data, _ in read:
            tokens = _code_tokens(data)
            digest.update(f"{name}\0{len(tokens)}\0".encode())
            digest.update(tokens)
        found = digest.hexdigest()[:16]
        _MEMO.put("fingerprints", key, found)
    _MEMO.save()
    return found


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
