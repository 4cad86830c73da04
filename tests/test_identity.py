"""The target's identity is its content: swapped weights, even of the same size, change it."""

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


def test_hidden_folders_are_not_part_of_the_model(tmp_path):
    folder = _folder(tmp_path, 1.0)
    before = weights_fingerprint(folder)
    (folder / ".cache").mkdir()
    (folder / ".cache" / "download.lock").write_text("x")
    assert weights_fingerprint(folder) == before
    assert set(weights_identity(folder)["files"]) == {"config.json", "model.safetensors"}
