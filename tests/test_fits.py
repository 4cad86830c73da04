"""Runs that cannot train, refused before any weight is read: a warmup longer than the run, and a
step whose memory exceeds the device, estimated from the batches the store really makes (train_draft)
or, before the store exists, from full batches as an upper bound that says so (check_setup)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.draft.config import Eagle3DraftConfig
from draftsmith.errors import ConfigError
from draftsmith.extract.hidden_states import HiddenStateIndex
from draftsmith.fits import StepShape, attention_span, check_train_fits, process_memory
from draftsmith.io import read_json
from draftsmith.preflight import PreflightSettings
from draftsmith.train import TrainSettings, plan_run, train_draft
from draftsmith.train.batches import batch_positions
from tests.test_train import build_training_inputs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    return build_training_inputs(tmp_path_factory.mktemp("inputs"))  # 24 samples, 649 tokens, 3 shards


def settings(**changes) -> TrainSettings:
    return TrainSettings(**{"batch_tokens": 96, "lr": 3e-3, "epochs": 2, "device": "cpu", "progress": False,
                            **changes})


def planned_steps(inputs: dict, s: TrainSettings) -> list:
    return plan_run(HiddenStateIndex.load(inputs["index"]), s, 1, inputs["index"])[1]


def train(inputs: dict, tmp_path, s: TrainSettings) -> dict:
    return train_draft(inputs["index"], inputs["mapping"], inputs["target"], tmp_path / "draft", tmp_path / "work", s)


@pytest.fixture
def no_weights_read(monkeypatch):
    """Fail the test if training reads the target's embedding and head (its first weights)."""
    import draftsmith.engines.weights

    def read(*args, **kwargs):
        raise AssertionError("the target's weights were read before the refusal")

    monkeypatch.setattr(draftsmith.engines.weights, "load_embedding_and_head", read)


def test_a_warmup_longer_than_the_run_is_refused_with_the_runs_steps(inputs, tmp_path, no_weights_read):
    s = settings(warmup_steps=1000)
    steps = len(planned_steps(inputs, s))
    with pytest.raises(ConfigError) as info:
        train(inputs, tmp_path, s)
    e = info.value
    assert f"train.warmup_steps is 1000, longer than the run ({steps} optimizer steps: 2 epoch(s)" in e.what
    assert f"at {steps / 1000:.0%} of train.lr" in e.what and "649-token store" in e.what
    assert e.where == "config key train.warmup_steps"
    assert f"set train.warmup_steps to at most {steps}" in e.fix
    assert not (tmp_path / "draft").exists()


def test_a_warmup_as_long_as_the_run_trains_and_one_step_longer_is_refused(inputs, tmp_path):
    assert train(inputs, tmp_path / "fits", settings(max_steps=2, warmup_steps=2))["steps"] == 2
    with pytest.raises(ConfigError, match=r"longer than the run \(2 optimizer steps: .*train.max_steps=2"):
        train(inputs, tmp_path / "over", settings(max_steps=2, warmup_steps=3))


def test_train_draft_estimates_the_step_from_the_largest_batch_of_the_store(inputs, tmp_path, monkeypatch):
    """train.batch_tokens a million on a 649-token store: the batch the store makes is what must fit
    (the million would need about 17 GB, that batch about 11 MB), and what the fix offers fits."""
    import draftsmith.placement

    s = settings(batch_tokens=1_000_000, warmup_steps=0, max_steps=1)
    metas, steps = plan_run(HiddenStateIndex.load(inputs["index"]), s, 1, inputs["index"])
    largest = batch_positions(steps, torch.device("cpu"))
    assert largest < 649
    longest = max(int(meta.lengths.max()) for meta in metas)
    config = Eagle3DraftConfig.from_target(read_json(inputs["target"]), draft_vocab_size=200)
    # the CPU computes the dense scores per block of whole samples
    shape = StepShape(s.ttt_steps, config.num_attention_heads, 1, 200, "sdpa", attention_span("sdpa", longest))
    need = shape.bytes(largest)
    assert shape.bytes(s.batch_tokens) > 1000 * need

    monkeypatch.setattr(draftsmith.placement, "host_memory_bytes", lambda: need - 1)
    with pytest.raises(ConfigError) as info:
        train(inputs, tmp_path / "refused", s)
    e = info.value
    assert f"one training step of {largest} positions (the largest micro-batch this run packs from the 649-token " \
           "store with train.batch_tokens=1000000" in e.what
    assert "more than the CPU's memory" in e.what and "train.batch_tokens" in e.where
    fits = shape.most_positions(need - 1)
    assert f"lower train.batch_tokens to {fits} or less" in e.fix
    assert shape.bytes(fits) <= need - 1 < shape.bytes(fits + 1)

    monkeypatch.setattr(draftsmith.placement, "host_memory_bytes", lambda: need)
    assert train(inputs, tmp_path / "fits", s)["steps"] == 1


def test_preflight_estimate_is_an_upper_bound_that_says_what_it_assumed():
    text = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "vocab_size": 384, "max_position_embeddings": 512}
    preflight = PreflightSettings(device="cpu", max_seq_len=1024, draft_vocab_size=100, num_layers=1,
                                  batch_tokens=1_000_000, ttt_steps=3)
    have = 25 * 10**9
    with pytest.raises(ConfigError) as info:
        check_train_fits(text, preflight, ("sdpa", have))
    e = info.value
    assert "one training step of 1,000,000 positions (train.batch_tokens=1000000, an upper bound: it assumes " \
           "full batches, and the store, not extracted yet, may hold fewer tokens" in e.what
    shape = StepShape(3, 2, 1, 100, "sdpa", attention_span("sdpa", 1024))  # blocks of up to data.max_seq_len
    fits = shape.most_positions(have)
    assert f"lower train.batch_tokens to {fits} or less" in e.fix
    assert shape.bytes(fits) <= have < shape.bytes(fits + 1)
    assert check_train_fits(text, PreflightSettings(device="cpu", max_seq_len=1024, draft_vocab_size=100,
                                                    num_layers=1, batch_tokens=fits, ttt_steps=3), ("sdpa", have))


def test_gpu_batches_are_padded_to_the_largest_batch_not_to_batch_tokens(inputs):
    """On GPU every batch is padded to one length: the plan's largest, rounded up to 128, so a
    train.batch_tokens larger than the store costs no memory."""
    steps = planned_steps(inputs, settings(batch_tokens=8192))
    largest = max(pack.tokens for step in steps for pack in step.packs)
    assert batch_positions(steps, torch.device("cuda")) == -(-largest // 128) * 128 < 8192
    assert batch_positions(steps, torch.device("cpu")) == largest


def test_cpu_training_processes_of_one_node_share_its_memory(monkeypatch):
    import draftsmith.placement

    monkeypatch.setattr(draftsmith.placement, "host_memory_bytes", lambda: 10**9)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    have, what = process_memory(torch.device("cpu"))
    assert have == 5 * 10**8 and "a 1/2 share of the CPU's memory" in what


def test_the_automatic_warmup_is_a_twentieth_of_the_run_at_most_50_steps():
    from draftsmith.train import TrainSettings

    auto = TrainSettings(warmup_steps=None)
    assert [auto.warmup_for(n) for n in (3, 12, 400, 1000, 50_000)] == [1, 1, 20, 50, 50]
    assert TrainSettings(warmup_steps=7).warmup_for(3) == 7  # as set (and refused by check_warmup if longer)
