"""Code fingerprints follow the draftsmith modules a stage imports, and nothing else."""

import pytest

from draftsmith.fingerprint import PACKAGE_DIR, code_fingerprint, module_closure


def names(files):
    return {str(f.relative_to(PACKAGE_DIR)) for f in files}


def test_closure_follows_imports_transitively():
    closure = names(module_closure("draftsmith.engines.weights"))
    assert {"engines/weights.py", "targets/inspect.py", "errors.py", "io.py"} <= closure
    assert "vocab.py" not in closure


def test_closure_of_a_stage_excludes_other_stages():
    assert "targets/inspect.py" not in names(module_closure("draftsmith.vocab"))


def test_online_training_is_fingerprinted_with_the_processes_it_starts():
    # the producer and the trainer's workers run as `python -m` processes of the job: a patch to
    # either must train again
    from draftsmith.fingerprint import script_closure

    closure = names(script_closure(PACKAGE_DIR.parent / "workflow_scripts" / "train_draft_online.py"))
    assert {"online/producer.py", "online/worker.py"} <= closure


@pytest.fixture
def toy_package(tmp_path, monkeypatch):
    """A package of three modules in place of draftsmith's: a imports b, c stands alone."""
    package = tmp_path / "draftsmith"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from draftsmith import b\n")
    (package / "b.py").write_text("X = 1\n")
    (package / "c.py").write_text("Y = 1\n")
    monkeypatch.setattr("draftsmith.fingerprint.PACKAGE_DIR", package)
    return package


def test_fingerprint_changes_with_the_code(toy_package):
    package = toy_package
    before = code_fingerprint("draftsmith.a")
    (package / "c.py").write_text("Y = 2\n")
    assert code_fingerprint("draftsmith.a") == before
    (package / "b.py").write_text("X = 2\n")
    assert code_fingerprint("draftsmith.a") != before


def test_a_package_keys_its_code_not_a_stale_module_of_its_name(toy_package):
    """A module that became a package (regenerate.py -> regenerate/) leaves the old file behind
    where a copy does not delete files; Python imports the package, so the package is what counts."""
    package = toy_package
    (package / "a.py").write_text("from draftsmith.b import stage\n")
    (package / "b.py").unlink()
    (package / "b").mkdir()
    (package / "b" / "__init__.py").write_text("")
    (package / "b" / "stage.py").write_text("X = 1\n")
    before = code_fingerprint("draftsmith.a")
    (package / "b.py").write_text("X = 2\n")  # stale: never imported
    assert code_fingerprint("draftsmith.a") == before
    (package / "b" / "stage.py").write_text("X = 2\n")
    assert code_fingerprint("draftsmith.a") != before


def test_a_script_is_fingerprinted_with_the_modules_it_imports(tmp_path):
    from draftsmith.fingerprint import script_closure, script_fingerprint

    script = tmp_path / "prepare.py"
    script.write_text("from draftsmith.data import prepare_dataset\nfrom draftsmith.logs import setup_logging\n")
    closure = names(script_closure(script))
    assert {"__init__.py", "data.py", "conversations.py", "logs.py", "errors.py", "io.py"} <= closure
    assert not any(n.startswith(("regenerate/", "train/")) for n in closure)
    before = script_fingerprint(script)
    script.write_text(script.read_text() + "setup_logging(None)\n")
    assert script_fingerprint(script) != before


def test_comments_and_blank_lines_change_no_fingerprint(toy_package):
    """A comment edit reruns nothing; code, a docstring and a block's structure rerun what uses them."""
    package = toy_package
    b = package / "b.py"
    b.write_text('def f(x):\n    """Double x."""\n    return x * 2\n')
    before = code_fingerprint("draftsmith.a")
    b.write_text('# why f doubles\n\ndef f(x):  # a note\n    """Double x."""\n\n    return x*2  # spacing too\n')
    assert code_fingerprint("draftsmith.a") == before
    b.write_text('def f(x):\n  """Double x."""\n  return x * 2\n')  # another indentation width
    assert code_fingerprint("draftsmith.a") == before
    for edited in ('def f(x):\n    """Double x, twice."""\n    return x * 2\n',
                   'def f(x):\n    """Double x."""\n    return x * 3\n',
                   'def f(x):\n    """Double x."""\n    return x * 2\nX = "# not a comment"\n',
                   'def f(x):\n    """Double x."""\nreturn x * 2\n'):  # out of the function: not valid code
        b.write_text(edited)
        assert code_fingerprint("draftsmith.a") != before, edited


def test_reading_conversations_does_not_pull_in_tokenising():
    """Regeneration's code is what reads conversations, not what tokenises them: a patch to
    prepare_dataset's masking keeps hours of regenerated answers."""
    closure = names(module_closure("draftsmith.regenerate.stage"))
    assert "conversations.py" in closure and "data.py" not in closure


def test_eval_prompt_sets_and_training_rows_fingerprint_apart():
    """A patch to prepare_eval_prompts reruns the evaluation, not prepare_dataset and the training
    after it; the prompt sets share prepare_dataset's bad-row accounting, so data.py keys both."""
    from draftsmith.fingerprint import script_closure

    scripts = PACKAGE_DIR.parent / "workflow_scripts"
    dataset = names(script_closure(scripts / "prepare_dataset.py"))
    prompts = names(script_closure(scripts / "prepare_eval_prompts.py"))
    assert "data.py" in dataset and "eval_prompts.py" not in dataset
    assert {"eval_prompts.py", "data.py"} <= prompts


def test_rerun_table_follows_imports_and_the_rule_graph(toy_package, tmp_path):
    from draftsmith.fingerprint import rerun_table

    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("import draftsmith.c\n")
    second.write_text("from draftsmith.a import X\n")
    table = rerun_table({"first": first, "second": second, "third": first}, [("first", "second")])
    assert table["draftsmith.b"] == ["second"]
    assert table["draftsmith.c"] == ["first", "second", "third"]
    assert table["draftsmith"] == ["first", "second", "third"]


def _fresh_memo(monkeypatch):
    """A new process's memo: nothing of this one's in memory, only what is on disk."""
    from draftsmith import fingerprint

    monkeypatch.setattr(fingerprint, "_MEMO", fingerprint._Memo())
    fingerprint._read.cache_clear()
    fingerprint._code_tokens.cache_clear()


def test_a_later_process_takes_fingerprints_from_the_memo_and_an_edit_is_computed_again(toy_package, monkeypatch):
    from draftsmith import fingerprint

    before = code_fingerprint("draftsmith.a")
    memo = toy_package / "__pycache__" / fingerprint.MEMO_NAME
    assert memo.is_file()
    _fresh_memo(monkeypatch)
    computed = []
    tokens = fingerprint._code_tokens.__wrapped__
    monkeypatch.setattr(fingerprint, "_code_tokens", lambda data: computed.append(data) or tokens(data))
    assert code_fingerprint("draftsmith.a") == before and computed == []  # nothing tokenized again
    (toy_package / "b.py").write_text("X = 2\n")
    edited = code_fingerprint("draftsmith.a")
    assert edited != before and computed  # the new content is a new key
    (toy_package / "b.py").write_text("X = 1\n")
    assert code_fingerprint("draftsmith.a") == before


def test_an_edit_that_keeps_size_and_modification_time_is_still_seen(toy_package):
    import os

    b = toy_package / "b.py"
    before = code_fingerprint("draftsmith.a")
    stat = b.stat()
    b.write_text("X = 7\n")  # the same size
    os.utime(b, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the modification time set back
    assert code_fingerprint("draftsmith.a") != before


def test_a_damaged_or_foreign_memo_is_computed_again_and_an_unwritable_one_is_left(toy_package, monkeypatch):
    import json

    from draftsmith import fingerprint

    expected = code_fingerprint("draftsmith.a")
    memo = toy_package / "__pycache__" / fingerprint.MEMO_NAME
    saved = json.loads(memo.read_text())
    # damaged, or written by other fingerprinting code (whose answers this code need not give)
    for damaged in ("{not json", json.dumps({**saved, "version": "0" * 64,
                                             "fingerprints": {k: "0" * 16 for k in saved["fingerprints"]}})):
        memo.write_text(damaged)
        _fresh_memo(monkeypatch)
        assert code_fingerprint("draftsmith.a") == expected
        assert json.loads(memo.read_text())["version"] == fingerprint.MEMO_VERSION  # written again, whole
    memo.unlink()
    monkeypatch.setattr(fingerprint.os, "replace", lambda *a: (_ for _ in ()).throw(PermissionError(13, "read-only")))
    _fresh_memo(monkeypatch)
    assert code_fingerprint("draftsmith.a") == expected and not memo.exists()
    assert not list(memo.parent.glob("*.tmp"))


def test_a_file_rewritten_while_it_is_fingerprinted_keeps_the_memo_true(toy_package, monkeypatch):
    """A checkout rewriting b.py while a plan tokenizes it: what the memo keeps under the old bytes'
    key is the old bytes' fingerprint."""
    from draftsmith import fingerprint

    b = toy_package / "b.py"
    old = code_fingerprint("draftsmith.a")
    b.write_text("X = 22\n")
    new = code_fingerprint("draftsmith.a")
    for stale in toy_package.joinpath("__pycache__").iterdir():
        stale.unlink()
    b.write_text("X = 1\n")
    _fresh_memo(monkeypatch)
    contents, reads = fingerprint._contents, []

    def read_then_rewrite(file):
        found = contents(file)
        if file == b:
            reads.append(file)
            if len(reads) == 2:  # the closure's read, then the digest's: the checkout lands after it
                b.write_text("X = 22\n")
        return found
    monkeypatch.setattr(fingerprint, "_contents", read_then_rewrite)
    assert code_fingerprint("draftsmith.a") == old
    monkeypatch.setattr(fingerprint, "_contents", contents)
    _fresh_memo(monkeypatch)
    assert code_fingerprint("draftsmith.a") == new  # b.py as the checkout left it
    b.write_text("X = 1\n")
    _fresh_memo(monkeypatch)
    assert code_fingerprint("draftsmith.a") == old

