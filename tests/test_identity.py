"""The target's identity is its content: swapped weights, even of the same size, change it."""

import dataclasses
import os

import torch
from safetensors.torch import save_file

from draftsmith.targets.identity import weights_fingerprint, weights_identity


def _folder(tmp_path, value: float):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.full((4, 4), value)}, tmp_path / "model.safetensors")
    return tmp_path


def test_same_size_weights_written_again_change_the_fingerprint(tmp_path):
    folder = _folder(tmp_path, 1.0)
    before = weights_fingerprint(folder)
    assert weights_fingerprint(folder) == before  # stable
    size = (folder / "model.safetensors").stat().st_size
    stat = (folder / "model.safetensors").stat()
    save_file({"w": torch.full((4, 4), 2.0)}, folder / "model.safetensors")
    os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert (folder / "model.safetensors").stat().st_size == size
    assert weights_fingerprint(folder) != before


def test_weights_edited_in_place_with_their_old_mtime_put_back_change_it(tmp_path):
    """Same size, same header, same modification time to the nanosecond: only the bytes differ."""
    folder = _folder(tmp_path, 1.0)
    weights = folder / "model.safetensors"
    stat = weights.stat()
    before = weights_fingerprint(folder)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor, in place
    with open(weights, "r+b") as f:
        f.write(data)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns and weights.stat().st_size == stat.st_size
    assert weights_fingerprint(folder) != before
    again = weights_fingerprint(folder)
    assert weights_fingerprint(folder) == again  # reading (hashing, loading) moves nothing


def test_a_changed_header_or_small_file_changes_it_even_with_the_same_mtime(tmp_path):
    folder = _folder(tmp_path, 1.0)
    stat = (folder / "model.safetensors").stat()
    before = weights_fingerprint(folder)
    save_file({"v": torch.full((4, 4), 1.0)}, folder / "model.safetensors")  # renamed tensor
    os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_fingerprint(folder) != before
    before = weights_fingerprint(folder)
    (folder / "config.json").write_text('{"model_type": "mistral"}')
    assert weights_fingerprint(folder) != before


def test_a_model_folder_moved_on_its_file_system_keeps_its_identity(tmp_path):
    """A rename leaves each file's inode, so its times, as they were: the stages that run the target
    keep their results when the project or the model folder is moved."""
    folder = _folder(tmp_path / "a", 1.0)
    before = weights_fingerprint(folder)
    moved = folder.rename(tmp_path / "b")
    assert weights_fingerprint(moved) == before


def test_hidden_folders_are_not_part_of_the_model(tmp_path):
    folder = _folder(tmp_path, 1.0)
    before = weights_fingerprint(folder)
    (folder / ".cache").mkdir()
    (folder / ".cache" / "download.lock").write_text("x")
    assert weights_fingerprint(folder) == before
    assert set(weights_identity(folder)["files"]) == {"config.json", "model.safetensors"}


def test_the_stage_caches_follow_the_weights_and_their_code(tmp_path, monkeypatch):
    """Extraction shards and regeneration chunks are keyed by the weights' identity and by the
    code that makes them: new weights or a patched capture are never resumed from old work."""
    from draftsmith.extract.extract import part_fingerprint
    from draftsmith.extract.settings import ExtractionSettings
    from draftsmith.regenerate.settings import RegenerateSettings
    from draftsmith.regenerate.stage import regeneration_fingerprint

    folder = _folder(tmp_path / "model", 1.0)
    target = {"model_path": str(folder), "layers_path": "model.layers", "captured_layer_ids": [1, 2],
              "hidden_size": 4}
    shards = [[{"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}]]
    settings = ExtractionSettings(device="cpu")

    def keys() -> tuple[str, str]:
        return (part_fingerprint(target, shards, settings),
                regeneration_fingerprint(RegenerateSettings(model_dtype="float32", device="cpu"),
                                         model=weights_identity(folder), sources=[]))

    before = keys()
    stat = (folder / "model.safetensors").stat()
    save_file({"w": torch.full((4, 4), 2.0)}, folder / "model.safetensors")
    os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    swapped = keys()
    assert swapped[0] != before[0] and swapped[1] != before[1]
    monkeypatch.setattr("draftsmith.fingerprint.code_fingerprint", lambda *modules: "patched")
    patched = keys()
    assert patched[0] != swapped[0] and patched[1] != swapped[1]

    # vLLM's release keys what vLLM wrote (the rules rerun on an upgrade: rules/common.smk,
    # engine_version), and the backend keys the shards: another engine's kernels, other numbers
    def in_vllm() -> tuple[str, str]:
        return (part_fingerprint(target, shards, dataclasses.replace(settings, backend="vllm")),
                regeneration_fingerprint(RegenerateSettings(model_dtype="float32", device="cpu", backend="vllm"),
                                         model=weights_identity(folder), sources=[]))

    release = in_vllm()
    assert release[0] != patched[0] and release[1] != patched[1]
    monkeypatch.setattr("draftsmith.targets.vllm_install.installed_vllm_version", lambda: "0.99.0")
    upgraded = in_vllm()
    assert upgraded[0] != release[0] and upgraded[1] != release[1]
    assert keys() == patched  # where vLLM does not run, its release is nothing to them


def test_a_data_source_replaced_by_an_older_copy_or_written_again_changes_its_fingerprint(tmp_path):
    """Data sources by stat alone (one per file, nothing read): a file replaced by an older copy
    (cp -p) or a save_to_disk folder written again with its old times put back is seen; hidden
    files and a read are not."""
    import shutil

    from draftsmith.targets.identity import files_fingerprint

    source, old = tmp_path / "chats.jsonl", tmp_path / "old.jsonl"
    old.write_text('{"text": "old"}\n')
    os.utime(old, (1_000_000, 1_000_000))
    source.write_text('{"text": "new"}\n')
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "data-00000-of-00001.arrow").write_bytes(b"rows")
    before = files_fingerprint([source, folder])
    source.read_text()
    (folder / ".lock").write_text("x")
    assert files_fingerprint([source, folder]) == before
    shutil.copy2(old, source)
    assert files_fingerprint([source, folder]) != before
    before = files_fingerprint([source, folder])
    stat = (folder / "data-00000-of-00001.arrow").stat()
    (folder / "data-00000-of-00001.arrow").write_bytes(b"ROWS")  # same size, old times put back
    os.utime(folder / "data-00000-of-00001.arrow", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert files_fingerprint([source, folder]) != before
    assert files_fingerprint([tmp_path / "missing.jsonl"]) != files_fingerprint([])
