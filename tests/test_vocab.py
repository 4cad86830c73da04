"""The draft vocabulary: most frequent assistant tokens, the d2t/t2d convention, coverage."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.errors import ConfigError
from draftsmith.vocab import build_vocab_mapping


def _train_jsonl(path, rows):
    path.write_text("".join(json.dumps({"id": str(i), "input_ids": ids, "loss_mask": mask}) + "\n"
                            for i, (ids, mask) in enumerate(rows)))
    return path


def test_mapping_keeps_the_most_frequent_loss_masked_tokens(tmp_path):
    # Token 7 appears most but only outside the loss mask: it must not count.
    rows = [([7, 7, 7, 7, 3, 3, 5, 9], [0, 0, 0, 0, 1, 1, 1, 1]), ([7, 3, 5, 1], [0, 1, 1, 1])]
    train = _train_jsonl(tmp_path / "train.jsonl", rows)
    stats = build_vocab_mapping(train, 12, 3, tmp_path / "mapping.safetensors", tmp_path / "stats.json")
    mapping = load_file(tmp_path / "mapping.safetensors")
    draft_ids = torch.arange(3) + mapping["d2t"]  # target id = i + d2t[i]
    assert draft_ids.tolist() == [1, 3, 5]  # 3 and 5 twice; 1 and 9 once: the tie goes to the lower id
    assert mapping["d2t"].dtype == torch.int64 and mapping["t2d"].dtype == torch.bool
    assert mapping["t2d"].nonzero().flatten().tolist() == [1, 3, 5]
    assert mapping["t2d"].shape == (12,)
    assert stats["loss_tokens"] == 7
    assert stats["coverage"] == pytest.approx(6 / 7)
    assert json.loads((tmp_path / "stats.json").read_text())["distinct_loss_tokens"] == 4


def test_draft_vocab_larger_than_seen_tokens_is_filled_deterministically(tmp_path):
    train = _train_jsonl(tmp_path / "train.jsonl", [([4, 4, 2], [1, 1, 1])])
    build_vocab_mapping(train, 10, 5, tmp_path / "m.safetensors", tmp_path / "s.json")
    mapping = load_file(tmp_path / "m.safetensors")
    assert (torch.arange(5) + mapping["d2t"]).tolist() == [0, 1, 2, 3, 4]


def test_draft_vocab_larger_than_target_vocab_is_an_error(tmp_path):
    train = _train_jsonl(tmp_path / "train.jsonl", [([1], [1])])
    with pytest.raises(ConfigError, match="vocab.draft_vocab_size") as info:
        build_vocab_mapping(train, 10, 11, tmp_path / "m.safetensors", tmp_path / "s.json")
    assert "at most 10" in str(info.value)
    assert not (tmp_path / "m.safetensors").exists()
