"""Security: remote code only when the config asks for it (and named), weights as safetensors only,
no shell commands, and no output outside the workflow's folders."""

from __future__ import annotations

import ast
import json
import logging
import pickle
import re
from pathlib import Path

import pytest

import tiny
from draftsmith.config import check_config
from draftsmith.engines.hf_model import load_hf_model
from draftsmith.errors import ConfigError, TargetError
from draftsmith.targets.inspect import inspect_target
from workflow_helpers import ROOT, copy_workflow, snakemake, write_config

PACKAGE = ROOT / "draftsmith"
PYTHON = sorted([*PACKAGE.rglob("*.py"), *(ROOT / "workflow_scripts").glob("*.py")])


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


# ---------------------------------------------------------------------------------------------
# Remote code


CUSTOM_CONFIG = '''
from pathlib import Path
from transformers import LlamaConfig

Path({marker!r}).touch()  # proof that this code ran


class CustomConfig(LlamaConfig):
    model_type = "draftsmith_custom_lm"
'''


def test_remote_code_runs_only_when_the_config_turns_it_on_and_is_named(tmp_path, monkeypatch, caplog):
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    folder = tiny.build_llama(tmp_path / "model", num_layers=4)
    marker = tmp_path / "remote-code-ran"
    (folder / "configuration_custom.py").write_text(CUSTOM_CONFIG.format(marker=str(marker)))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="draftsmith_custom_lm", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (folder / "config.json").write_text(json.dumps(config))

    with pytest.raises(TargetError, match=re.escape(str(folder / "configuration_custom.py"))):
        inspect_target(folder)
    assert not marker.exists()

    with caplog.at_level(logging.WARNING):
        info = inspect_target(folder, trust_remote_code=True)
    assert marker.exists() and info["trust_remote_code"] is True
    warning = next(r.getMessage() for r in caplog.records if "trust_remote_code is on" in r.getMessage())
    assert str(folder / "configuration_custom.py") in warning


def test_the_package_never_turns_remote_code_on_by_itself():
    for path in PYTHON:
        for call, _ in _calls(ast.parse(path.read_text())):
            value = _keyword(call, "trust_remote_code")
            assert not (isinstance(value, ast.Constant) and value.value is True), f"{path}:{call.lineno}"


# ---------------------------------------------------------------------------------------------
# Safetensors only


class _Payload:
    """A pickle that, when loaded, creates a file: what a hostile .bin checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickled_checkpoint_is_never_unpickled(tmp_path):
    folder = tiny.build_llama(tmp_path / "model", num_layers=4)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"weight": _Payload(marker)}))
    with pytest.raises(TargetError, match="weights are pickled"):
        inspect_target(folder)
    with pytest.raises(TargetError, match="safetensors"):
        load_hf_model(folder, device="cpu")
    assert not marker.exists()


def test_tensors_are_read_as_safetensors_and_torch_load_never_unpickles_code():
    for path in PYTHON:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not {"pickle", "dill", "cloudpickle", "joblib"} & {n.split(".")[0] for n in names}, path
        for call, func in _calls(tree):
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            if func == "torch.load":
                value = _keyword(call, "weights_only")
                assert isinstance(value, ast.Constant) and value.value is True, where
            if func.endswith("np.load") or func.endswith("numpy.load"):
                assert _keyword(call, "allow_pickle") is None, where
            if func.endswith(".from_pretrained") and re.search(r"(AutoModel\w*|For\w+|classes\[0\]|auto_cls)\.", func):
                # model weights: safetensors, or the demo's GGUF (not a pickle)
                assert _keyword(call, "use_safetensors") is not None or _keyword(call, "gguf_file") is not None \
                    or "**kwargs" in ast.unparse(call), where


def test_no_tensor_is_written_as_a_pickle():
    writers = [f"{p.relative_to(ROOT)}:{call.lineno}" for p in PYTHON
               for call, func in _calls(ast.parse(p.read_text())) if func == "torch.save"]
    assert writers == []


# ---------------------------------------------------------------------------------------------
# No shell commands; outputs only in the workflow's folders


def test_no_rule_or_function_builds_a_shell_command():
    for smk in [ROOT / "Snakefile", *(ROOT / "rules").glob("*.smk")]:
        text = smk.read_text()
        assert not re.search(r"^\s+(shell|run|wrapper):", text, flags=re.M), f"{smk}: rules run script: files only"
    for path in PYTHON:
        for call, func in _calls(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            assert func not in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput"), where
            shell = _keyword(call, "shell")
            assert not (isinstance(shell, ast.Constant) and shell.value), where
            if func.startswith("subprocess.") and call.args:
                assert not isinstance(call.args[0], (ast.Constant, ast.JoinedStr, ast.BinOp)), \
                    f"{where}: a command is an argument list, never a string"


@pytest.mark.parametrize("run", ["../elsewhere", "/tmp/elsewhere", "a/../../b", "..", ".hidden", "a b", "~x"])
def test_a_run_name_cannot_point_outside_results(run):
    import yaml

    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    config["run"] = run
    with pytest.raises(ConfigError, match="run: "):
        check_config(config, ROOT / "config" / "schema.yaml")


@pytest.mark.slow
def test_every_rule_writes_inside_the_run_folders(tmp_path):
    """Every output, log and benchmark of the whole workflow (regeneration on, target and data
    outside the workflow folder) lies under results/<run>/, logs/<run>/ or benchmarks/<run>/."""
    workdir = copy_workflow(tmp_path / "wf")
    model = tiny.build_llama(tmp_path / "elsewhere" / "model", num_layers=4)
    data = tiny.write_jsonl(tmp_path / "elsewhere" / "chats.jsonl", [{"text": "one two three"}] * 4)
    config = write_config(workdir, {"run": "r.1", "device": "cpu", "target": {"source": "path", "path": str(model)},
                                    "data": {"sources": [str(data)]}, "regenerate": {"enabled": True},
                                    "extraction": {"parts": 2}})
    plan = snakemake(workdir, "-n", "--forceall", configfile=config)
    paths = []
    for line in plan.stdout.splitlines():
        match = re.match(r"\s+(output|log|benchmark): (.*)", line)
        if match:
            paths += [p.strip() for p in match.group(2).split(",")]
    assert len(paths) > 20, plan.stdout[-2000:]
    for path in paths:
        assert re.match(r"(results|logs|benchmarks)/r\.1/", path) and ".." not in Path(path).parts, path
