"""Code fingerprints follow the draftsmith modules a stage imports, and nothing else."""

from draftsmith.fingerprint import PACKAGE_DIR, code_fingerprint, module_closure


def names(files):
    return {str(f.relative_to(PACKAGE_DIR)) for f in files}


def test_closure_follows_imports_transitively():
    closure = names(module_closure("draftsmith.targets.weights"))
    assert {"targets/weights.py", "targets/inspect.py", "errors.py", "io.py"} <= closure
    assert "vocab.py" not in closure


def test_closure_of_a_stage_excludes_other_stages():
    assert "targets/inspect.py" not in names(module_closure("draftsmith.vocab"))


def test_fingerprint_changes_with_the_code(tmp_path, monkeypatch):
    package = tmp_path / "draftsmith"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from draftsmith import b\n")
    (package / "b.py").write_text("X = 1\n")
    (package / "c.py").write_text("Y = 1\n")
    monkeypatch.setattr("draftsmith.fingerprint.PACKAGE_DIR", package)
    before = code_fingerprint("draftsmith.a")
    (package / "c.py").write_text("Y = 2\n")
    assert code_fingerprint("draftsmith.a") == before
    (package / "b.py").write_text("X = 2\n")
    assert code_fingerprint("draftsmith.a") != before
