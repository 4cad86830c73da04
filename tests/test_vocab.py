"""The draft vocabulary: most frequent assistant tokens, the d2t/t2d convention, coverage."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from draftsmith.errors import ConfigError, DataError
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


def test_the_count_is_the_same_for_any_number_of_workers(tmp_path, monkeypatch):
    import tiny
    from draftsmith import vocab

    monkeypatch.setattr(vocab, "CHUNK_BYTES", 2048)  # several chunks for each worker
    train = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.random_train_rows(300, seed=1))
    expected = np.zeros(384, dtype=np.int64)
    for row in tiny.random_train_rows(300, seed=1):
        for token, on in zip(row["input_ids"], row["loss_mask"]):
            expected[token] += on
    outputs = {}
    for workers in (1, 2, 3):
        assert (vocab.count_loss_tokens(train, 384, workers) == expected).all()
        out = tmp_path / f"w{workers}"
        build_vocab_mapping(train, 384, 256, out / "mapping.safetensors", out / "stats.json", workers=workers)
        outputs[workers] = [(out / name).read_bytes() for name in ("mapping.safetensors", "stats.json")]
    assert outputs[2] == outputs[1] and outputs[3] == outputs[1]


def test_a_damaged_line_late_in_train_jsonl_is_named_for_any_number_of_workers(tmp_path, monkeypatch):
    import tiny
    from draftsmith import vocab

    monkeypatch.setattr(vocab, "CHUNK_BYTES", 2048)
    train = tiny.write_jsonl(tmp_path / "train.jsonl", tiny.random_train_rows(300) + ['{"input_ids": [1, 2'])
    for workers in (1, 2):
        with pytest.raises(DataError) as info:
            vocab.count_loss_tokens(train, 384, workers)
        assert info.value.where == f"{train}:301" and info.value.fix == "rerun the prepare_dataset rule"
