"""The trainer: learning, TTT and packing math, DDP equivalence, kill-and-resume, stale checkpoints, NaN stops."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.draft.config import Eagle3DraftConfig
from draftsmith.draft.model import Eagle3Draft, draft_rows
from draftsmith.engines.weights import load_embedding_and_head
from draftsmith.errors import TrainingError
from draftsmith.extract.hidden_states import HiddenStateIndex, ShardRows, merge_parts, read_shard
from draftsmith.extract.shard_writer import PartStore
from draftsmith.io import read_json
from draftsmith.targets.inspect import write_target_json
from draftsmith.train import (
    DraftLoss,
    LossKernels,
    Pack,
    TrainSettings,
    TTTObjective,
    build_batch,
    dequantize_batch,
    launch_command,
    plan_steps,
    run_training,
    scored_positions,
    shard_meta,
    train_draft,
)
from draftsmith.train.batches import noise_seed, plan_epoch, tokens_meta
from draftsmith.train.objective import noised_states
from draftsmith.vocab import mapping_tensors
from tests.tiny import build_llama
from tests.tiny_vllm import ENGINE_ARGS, per_request_records

REPO = Path(__file__).resolve().parents[1]
SETTINGS = TrainSettings(batch_tokens=96, lr=3e-3, warmup_steps=2, epochs=2, log_every=2, checkpoint_every=4,
                         progress=False)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ----------------------------------------------------------------------------------------------
# fixtures: a tiny random-init target, its real hidden states in the shard store, a vocab mapping


def random_samples(n: int, seed: int, vocab: int = 384, min_len: int = 6, max_len: int = 40):
    """Rows of a prompt (loss 0) then a reply (loss 1) that repeats a short motif, so a draft can
    learn something within a few steps."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(1, max(2, length // 3)))
        motif = rng.integers(0, vocab, size=int(rng.integers(2, 5)))
        ids = np.concatenate([rng.integers(0, vocab, size=prompt), np.resize(motif, length - prompt)])
        rows.append((f"s{i}", ids.tolist(), [0] * prompt + [1] * (length - prompt)))
    return rows


def build_training_inputs(root: Path, *, num_samples: int = 24, samples_per_shard: int = 8,
                          draft_vocab_size: int = 200, seed: int = 0, poison_shard: int | None = None,
                          storage_dtype: str = "float32", greedy_replies: bool = False) -> dict:
    """target/, target.json, hidden_states/index.json and vocab/mapping.safetensors, as the stages make them.

    The hidden states are the tiny target's own output_hidden_states; ``poison_shard`` puts an
    inf into that shard's aux states (a float16 overflow, say); ``greedy_replies`` makes each reply
    the target's own greedy continuation of its prompt (regenerated data: a draft learns to be accepted)."""
    from transformers import LlamaForCausalLM

    model_path = build_llama(root / "target", num_layers=4, seed=seed)
    target = write_target_json(root / "target.json", model_path)
    model = LlamaForCausalLM.from_pretrained(model_path).eval()
    layer_ids = [*target["aux_layer_ids"], target["final_layer_id"]]
    store_root = root / "hidden_states"
    store = PartStore(store_root, 0, fingerprint="test", dtype=storage_dtype, hidden_size=target["hidden_size"],
                      layer_ids=layer_ids)
    samples = random_samples(num_samples, seed)
    if greedy_replies:
        samples = [_greedy_reply(model, name, ids, mask) for name, ids, mask in samples]
    infos = []
    with torch.no_grad():
        for shard, start in enumerate(range(0, num_samples, samples_per_shard)):
            chunk = samples[start:start + samples_per_shard]
            states = {i: [] for i in layer_ids}
            for _, ids, _ in chunk:
                out = model(torch.tensor([ids]), output_hidden_states=True)
                for i in layer_ids:
                    states[i].append(out.hidden_states[i][0])
            states = {i: torch.cat(s) for i, s in states.items()}
            if shard == poison_shard:
                states[layer_ids[0]][3, 5] = float("inf")
            infos.append(store.write_shard(shard, [c[0] for c in chunk], [c[1] for c in chunk],
                                           [c[2] for c in chunk], states))
    store.finish(infos, store_root / "part-0.json")
    merge_parts([store_root / "part-0.json"], store_root / "index.json")
    counts = np.zeros(target["vocab_size"], dtype=np.int64)
    for _, ids, mask in samples:
        np.add.at(counts, np.asarray(ids)[np.asarray(mask, dtype=bool)], 1)
    draft_ids = np.sort(np.lexsort((np.arange(len(counts)), -counts))[:draft_vocab_size])
    (root / "vocab").mkdir(exist_ok=True)
    save_file(mapping_tensors(draft_ids, target["vocab_size"]), str(root / "vocab" / "mapping.safetensors"))
    return {"target": root / "target.json", "index": store_root / "index.json",
            "mapping": root / "vocab" / "mapping.safetensors"}


def _greedy_reply(model, name: str, ids: list[int], mask: list[int]) -> tuple[str, list[int], list[int]]:
    prompt = ids[:mask.index(1)]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(ids) - len(prompt), do_sample=False,
                             min_new_tokens=len(ids) - len(prompt))
    return name, out[0].tolist(), [0] * len(prompt) + [1] * (len(ids) - len(prompt))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    return build_training_inputs(tmp_path_factory.mktemp("inputs"))


def train(inputs: dict, tmp: Path, settings: TrainSettings, name: str = "run") -> dict:
    return train_draft(inputs["index"], inputs["mapping"], inputs["target"], tmp / name / "draft", tmp / name / "work",
                       settings)


def weights(draft_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(draft_dir / "model.safetensors")


def objective_and_batches(inputs: dict, ttt_steps: int, cap: int = 64, hard_label_weight: float = 0.0,
                          loss_on: str = "answers", feature_noise: float = 0.0):
    """A real draft (target embeddings, draft-vocab lm_head) and packed micro-batches of real states."""
    index = HiddenStateIndex.load(inputs["index"])
    target = read_json(inputs["target"])
    mapping = load_file(inputs["mapping"])
    config = Eagle3DraftConfig.from_target(target, draft_vocab_size=mapping["d2t"].shape[0],
                                           aux_layer_ids=index.aux_layer_ids, speculative_tokens=ttt_steps)
    torch.manual_seed(0)
    draft = Eagle3Draft(config)
    embed, head = load_embedding_and_head(inputs["target"])
    draft.load_target_weights(embed, head, mapping["d2t"], mapping["t2d"])
    rows = draft_rows(mapping["d2t"], mapping["t2d"], config.target_vocab_size)
    objective = TTTObjective(draft, head, rows, ttt_steps=ttt_steps, ttt_decay=0.8, attention="sdpa",
                             hard_label_weight=hard_label_weight, feature_noise=feature_noise)
    meta = shard_meta(index, index.shards[0], dataclasses.replace(SETTINGS, batch_tokens=cap, ttt_steps=ttt_steps,
                                                                  loss_on=loss_on))
    shard_rows = ShardRows(index, index.shards[0], [*index.aux_layer_ids, index.final_layer_id])

    def batch(samples):
        idx = np.asarray(samples)
        pack = Pack(tuple((0, int(i)) for i in samples), int(meta.lengths[idx].sum()), tuple(meta.counts[idx].sum(0)))
        packed = build_batch(pack, [meta], {0: shard_rows}, index.aux_layer_ids, index.final_layer_id,
                             index.hidden_size, ttt_steps, pack.tokens, torch.float32, False)
        return {**packed, "noise_seed": noise_seed(0, 0, pack)}

    return objective, meta, batch


def run_objective(objective, batch, weights, exact=True):
    objective.zero_grad(set_to_none=True)
    loss, stats = objective(batch, weights, exact=exact)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None}
    return loss.detach(), stats, grads


# ----------------------------------------------------------------------------------------------
# math


@pytest.mark.parametrize("hard, loss_on", [(0.0, "answers"), (1.0, "answers"), (0.0, "all")])
def test_ttt_with_one_step_is_plain_next_token_training(inputs, hard, loss_on):
    """ttt_steps=1 is next-token training: per sample, causal attention, token x[t+1] with the state
    at t, KL to the teacher at t+1 over loss positions (soft labels), or with hard_label_weight 1
    the cross-entropy on the teacher's top token. The loss positions are the answers' tokens (the
    store's loss mask), or with loss_on "all" every position, the prompts' too."""
    objective, meta, batch = objective_and_batches(inputs, ttt_steps=1, hard_label_weight=hard, loss_on=loss_on)
    samples = [0, 1, 2, 3]
    packed = batch(samples)
    n = float(meta.counts[samples, 0].sum())
    index = HiddenStateIndex.load(inputs["index"])
    rows = ShardRows(index, index.shards[0], [])
    answers = [rows.loss_mask[int(meta.starts[i]) + 1:int(meta.starts[i]) + 1 + int(meta.lengths[i])] for i in samples]
    scored = [torch.ones_like(a) for a in answers] if loss_on == "all" else answers
    assert n == sum(int(s.sum()) for s in scored) and (loss_on == "answers" or n > sum(int(a.sum()) for a in answers))
    loss, stats, grads = run_objective(objective, packed, torch.tensor([1 / n]))

    draft = objective.draft
    draft.zero_grad(set_to_none=True)
    teacher = objective.teacher
    plain = 0.0
    for i in samples:
        one = batch([i])
        hidden = draft.fuse(one["aux"])
        cos, sin = draft.rope(one["pos"])

        def causal(layer, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                enable_gqa=True).transpose(0, 1)

        _, logits = draft.step(hidden, one["ids"], cos, sin, causal)
        p = torch.softmax(one["final"] @ teacher.T, -1)
        logq = torch.log_softmax(logits, -1)
        if hard:
            per_position = -logq.gather(1, p.argmax(-1, keepdim=True)).squeeze(1)
        else:
            per_position = (p * (torch.log(p) - logq)).sum(-1)
        plain = plain + per_position[scored[samples.index(i)]].sum() / n
    plain.backward()
    torch.testing.assert_close(loss, plain.detach(), rtol=1e-5, atol=1e-6)
    assert stats[0, 1] == n
    for name, g in grads.items():
        torch.testing.assert_close(g, dict(objective.named_parameters())[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packing_gives_the_loss_and_gradients_of_unpacked_samples(inputs):
    objective, meta, batch = objective_and_batches(inputs, ttt_steps=3)
    samples = [0, 2, 3, 5]
    counts = meta.counts[samples].sum(0)
    w = torch.tensor([0.8 ** j / counts[j] for j in range(3)], dtype=torch.float32)
    loss, stats, grads = run_objective(objective, batch(samples), w)
    parts = [run_objective(objective, batch([i]), w) for i in samples]
    torch.testing.assert_close(loss, sum(p[0] for p in parts), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats, sum(p[1] for p in parts), rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, sum(p[2][name] for p in parts), rtol=1e-4, atol=1e-6, msg=name)


def plain_loss(z, tz, teach, hard):
    """(1 - hard) * KL(teacher || draft) + hard * cross-entropy on the teacher's argmax, per row,
    through log_softmax and autograd, in float64."""
    logp = torch.log_softmax(tz.double(), -1)[teach]
    logq = torch.log_softmax(z.double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return (1 - hard) * kl - hard * logq.gather(1, logp.argmax(-1, keepdim=True)).squeeze(1)


@pytest.mark.parametrize("hard", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("kernels", ["chunked", "compiled"])
def test_fused_loss_and_its_gradient_equal_plain_autograd(kernels, hard):
    """DraftLoss (teacher probabilities recomputed from its logits, softmax recomputed in the
    backward) against log_softmax with autograd, float32 and bfloat16 logits, for the KL alone, the
    cross-entropy on the teacher's argmax alone and a mix; compiled with Inductor as on GPU (C++
    here, Triton there), with teacher and draft row counts changing as they do from step to step
    and batch to batch (dynamic shapes)."""
    chosen = LossKernels(chunk=7) if kernels == "chunked" else LossKernels.compiled("inductor")
    g = torch.Generator().manual_seed(0)
    for dtype, num_teacher, rows in ((torch.float32, 40, 40), (torch.float32, 40, 29), (torch.float32, 50, 50),
                                     (torch.float32, 50, 33), (torch.bfloat16, 45, 45), (torch.bfloat16, 45, 31)):
        tz = (torch.randn(num_teacher, 96, generator=g) * 3).to(dtype)
        teach = (torch.arange(rows) if rows == num_teacher  # step 0 scores every teacher row, in order
                 else torch.randint(0, num_teacher, (rows,), generator=g))
        z = (torch.randn(rows, 96, generator=g) * 3).to(dtype).requires_grad_()
        w = torch.rand(rows, generator=g)
        tlse, negent, targ, top = chosen.rows(chosen.teacher, tz.shape[0], tz)
        torch.testing.assert_close(tlse, torch.logsumexp(tz.float(), -1))
        assert torch.equal(targ, tz.float().argmax(-1)) and torch.equal(top, tz.float().max(-1).values)
        loss, arg = DraftLoss.apply(z, tz, tlse, negent, teach, targ, hard, chosen)
        (w * loss).sum().backward()
        fused_grad, z.grad = z.grad, None
        ref = plain_loss(z, tz, teach, hard)
        (w.double() * ref).sum().backward()
        assert loss.dtype == torch.float32 and fused_grad.dtype == dtype
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused_grad.float(), z.grad.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-6 if dtype == torch.float32 else 1e-3)
        assert torch.equal(arg, z.detach().float().argmax(-1))


def test_feature_noise_is_bounded_by_each_states_scale_and_drawn_from_its_seed():
    """Each captured state of each token moves by at most amplitude x its RMS there, whatever the
    layers' scales; the noise fills that range (uniform, mean about 0); one seed draws the same noise,
    another seed other noise; padding rows stay zeros."""
    torch.manual_seed(0)
    scales = torch.tensor([0.1, 3.0, 200.0])  # layers of very different scales, as deep targets have
    aux = (torch.randn(64, 3, 32) * scales[None, :, None]).view(64, 96)
    aux[60:] = 0
    noised = noised_states(aux, 3, 0.2, seed=7)
    delta = (noised - aux).view(64, 3, 32)
    rms = aux.view(64, 3, 32).pow(2).mean(-1, keepdim=True).sqrt()
    assert (delta.abs() <= 0.2 * rms * (1 + 1e-5)).all()
    relative = delta[:60] / rms[:60]  # uniform in [-0.2, 0.2] for every layer: std 0.2 / sqrt(3)
    assert abs(float(relative.mean())) < 0.01 and float(relative.std()) == pytest.approx(0.2 / 3 ** 0.5, rel=0.05)
    assert float(relative.abs().max()) > 0.19
    assert not noised[60:].any()
    assert torch.equal(noised_states(aux, 3, 0.2, seed=7), noised)
    assert not torch.equal(noised_states(aux, 3, 0.2, seed=8), noised)


def test_feature_noise_changes_training_steps_only(inputs):
    """In training mode the draft reads noised states (another loss than without noise); in eval
    mode (evaluation, the logged figures of a model put in eval) it reads the states as stored."""
    w = torch.tensor([1.0, 0.8, 0.64])
    plain, _, batch = objective_and_batches(inputs, ttt_steps=3)
    noisy, _, _ = objective_and_batches(inputs, ttt_steps=3, feature_noise=0.1)
    packed = batch([0, 2, 3])
    loss, _, _ = run_objective(plain, packed, w)
    noisy_loss, _, _ = run_objective(noisy, packed, w)
    assert abs(float(noisy_loss - loss)) > 1e-4 * abs(float(loss))
    assert torch.equal(run_objective(noisy, packed, w)[0], noisy_loss)  # the batch's seed, not a global RNG
    noisy.eval()
    torch.testing.assert_close(run_objective(noisy, packed, w)[0], loss, rtol=0, atol=0)


def test_train_lm_head_trains_the_heads_rows_and_frozen_keeps_the_targets(inputs, tmp_path):
    """train.train_lm_head: the delivered lm_head leaves the target's rows of the draft vocabulary
    when trained and keeps them bit for bit when frozen; the rest of the draft trains either way."""
    mapping = load_file(inputs["mapping"])
    _, head = load_embedding_and_head(inputs["target"])
    rows = draft_rows(mapping["d2t"].long(), mapping["t2d"].bool(), head.shape[0])
    delivered = {}
    for trained in (False, True):
        name = f"lm_head-{trained}"
        train(inputs, tmp_path, dataclasses.replace(SETTINGS, max_steps=6, train_lm_head=trained), name)
        delivered[trained] = weights(tmp_path / name / "draft")
    torch.testing.assert_close(delivered[False]["lm_head.weight"], head[rows].float(), rtol=0, atol=0)
    moved = (delivered[True]["lm_head.weight"] - head[rows].float()).abs().max()
    assert moved > 1e-4, "a trained lm_head left the target's rows unchanged"
    assert not torch.equal(delivered[True]["fc.weight"], delivered[False]["fc.weight"])  # the head's gradient reaches the layer


@pytest.mark.gpu
@pytest.mark.parametrize("hard, noise", [(0.0, 0.0), (0.5, 0.0), (0.0, 0.1)])
def test_compiled_objective_equals_eager(inputs, hard, noise):
    """compile_steps (the GPU configuration: the TTT steps compiled as one graph, compiled loss
    kernels) gives the eager loss, stats and gradients, on batches of different lengths and
    loss-position counts, for the KL, for a mix with the cross-entropy on the teacher's top token,
    and with feature noise."""
    import torch._dynamo

    torch._dynamo.reset()
    objective, _, batch = objective_and_batches(inputs, ttt_steps=3, hard_label_weight=hard, feature_noise=noise)
    compiled, _, _ = objective_and_batches(inputs, ttt_steps=3, hard_label_weight=hard, feature_noise=noise)
    compiled.compile_steps("aot_eager")
    w = torch.tensor([1.0, 0.8, 0.64])
    for samples in ([0, 2, 3], [1, 4], [5, 6, 7]):
        packed = batch(samples)
        loss, stats, grads = run_objective(objective, packed, w)
        loss_c, stats_c, grads_c = run_objective(compiled, packed, w)
        torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats_c, stats, rtol=1e-5, atol=1e-5)
        assert grads.keys() == grads_c.keys()
        for name, g in grads.items():
            torch.testing.assert_close(grads_c[name], g, rtol=1e-4, atol=1e-6, msg=name)
    torch._dynamo.reset()


def test_batch_without_loss_positions_gives_zero_gradients_to_every_parameter(inputs):
    """A filler micro-batch (the last global batch's padding for DDP) still hands every trainable
    parameter a (zero) gradient, so DDP reduces the same set on every rank."""
    objective, _, batch = objective_and_batches(inputs, ttt_steps=3)
    packed = batch([0, 1])
    packed["valid"] = torch.zeros_like(packed["valid"])
    packed.update(scored_positions(packed["valid"]))
    loss, stats, grads = run_objective(objective, packed, torch.ones(3))
    assert loss == 0 and not stats.any()
    trainable = {n for n, p in objective.named_parameters() if p.requires_grad}
    assert grads.keys() == trainable and not any(g.any() for g in grads.values())


def test_scored_positions_index_each_steps_loss_positions_and_their_teacher_rows():
    valid = torch.tensor([[0, 1, 1, 0, 1, 1, 1], [1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    # two samples: rows 0-3 (loss 0 1 1 0) and rows 4-6 (loss 1 1 1)
    out = scored_positions(valid)
    assert out["splits"] == (5, 4, 2)
    assert out["teach_rows"].tolist() == [1, 2, 4, 5, 6]
    rows, teach = out["rows"].split(out["splits"]), out["teach"].split(out["splits"])
    for j in range(3):
        assert rows[j].tolist() == valid[j].nonzero().squeeze(1).tolist()
        assert out["teach_rows"][teach[j]].tolist() == (rows[j] + j).tolist()
    with pytest.raises(TrainingError, match="step 1"):
        scored_positions(torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool))


def test_plan_covers_every_sample_once_per_epoch_within_the_token_budget(inputs):
    index = HiddenStateIndex.load(inputs["index"])
    metas = [shard_meta(index, s, dataclasses.replace(SETTINGS, batch_tokens=50, ttt_steps=3)) for s in index.shards]
    steps = plan_steps(metas, dataclasses.replace(SETTINGS, batch_tokens=50, epochs=2.5), processes=2)
    per_epoch = {}
    for step in steps:
        assert len(step.packs) == 2
        for pack in step.packs:
            assert pack.tokens <= 50
            if not pack.dummy:
                per_epoch.setdefault(step.epoch, []).extend(pack.members)
    everything = sorted((s, i) for s, m in enumerate(metas) for i in range(len(m.lengths)))
    assert sorted(per_epoch[0]) == everything and sorted(per_epoch[1]) == everything
    assert per_epoch[0] != per_epoch[1]  # reshuffled
    assert 0 < len(per_epoch[2]) < len(everything)  # half an epoch
    assert plan_steps(metas, dataclasses.replace(SETTINGS, batch_tokens=50, epochs=2.5), processes=2)[5].packs == \
        steps[5].packs  # a pure function of data and seed


def test_plan_shuffles_the_batches_of_mix_shards_shards_together():
    """Shards of one length band each, as extraction cuts them, packed best-fit: with mix_shards=1
    the epoch reads them block after block; with 2, each pair's batches are interleaved, pair after pair."""
    metas = [tokens_meta(np.arange(0, 40 * n + 1, n), np.ones(40 * n, dtype=np.int64), 100, 3, "answers") for n in (10, 20, 40, 80)]

    def runs(packs):  # the shard of each batch, consecutive repeats collapsed
        shards = [p.shards[0] for p in packs]
        return [s for i, s in enumerate(shards) if i == 0 or shards[i - 1] != s]

    assert sorted(runs(plan_epoch(metas, 100, seed=0, epoch=0, mix_shards=1, packing="best_fit"))) == [0, 1, 2, 3]
    mixed = plan_epoch(metas, 100, seed=0, epoch=0, mix_shards=2, packing="best_fit")
    groups = [p.group for p in mixed]
    assert groups == sorted(groups) and set(groups) == {0, 1}
    for g in (0, 1):
        group = [p for p in mixed if p.group == g]
        assert all(len(p.shards) == 1 for p in group)
        assert len({p.shards[0] for p in group}) == 2 and len(runs(group)) > 4  # interleaved, not two blocks
    everything = sorted((s, i) for s, m in enumerate(metas) for i in range(len(m.lengths)))
    assert sorted(m for p in mixed for m in p.members) == everything
    assert all(p.tokens <= 100 for p in mixed)


def test_shuffled_packing_mixes_the_lengths_of_a_group_in_each_batch():
    """packing: shuffled cuts a seeded shuffle of the whole group's samples into consecutive batches:
    every sample once, batches that hold several shards' (length bands') samples, full but for one."""
    metas = [tokens_meta(np.arange(0, 40 * n + 1, n), np.ones(40 * n, dtype=np.int64), 100, 3, "answers") for n in (10, 20, 40, 80)]
    packs = plan_epoch(metas, 100, seed=0, epoch=0, mix_shards=2, packing="shuffled")
    everything = sorted((s, i) for s, m in enumerate(metas) for i in range(len(m.lengths)))
    assert sorted(m for p in packs for m in p.members) == everything
    for g in {p.group for p in packs}:
        group = [p for p in packs if p.group == g]
        assert len({s for p in group for s in p.shards}) == 2  # a group is a pair of shards
        assert sum(len(p.shards) == 2 for p in group) > len(group) / 2  # most batches mix both bands
        lengths = [p.tokens for p in group]
        # consecutive packing: a batch ends only when the next sample does not fit
        assert all(t <= 100 for t in lengths) and sum(t < 100 - 80 for t in lengths) <= 1
    assert plan_epoch(metas, 100, seed=0, epoch=0, mix_shards=2, packing="shuffled") == packs
    assert plan_epoch(metas, 100, seed=0, epoch=1, mix_shards=2, packing="shuffled") != packs


# ----------------------------------------------------------------------------------------------
# the training run


@pytest.mark.gpu
@pytest.mark.parametrize("packing", ["best_fit", "shuffled"])
def test_loss_decreases_and_outputs_are_written(inputs, tmp_path, packing):
    settings = dataclasses.replace(SETTINGS, epochs=4, packing=packing)
    summary = run_training(inputs["index"], inputs["mapping"], inputs["target"], tmp_path / "draft",
                           tmp_path / "work", settings, metrics_out=tmp_path / "metrics.jsonl",
                           summary_out=tmp_path / "summary.json")
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in lines] == sorted({entry["step"] for entry in lines})
    first, last = lines[0], lines[-1]
    assert last["step"] == summary["steps"] and len(last["loss"]) == 3 and len(last["acc"]) == 3
    assert last["loss"][0] < 0.75 * first["loss"][0]
    assert summary == read_json(tmp_path / "summary.json")
    assert summary["final"]["tau"] >= 1.0 and summary["tokens"] > 0
    config = read_json(tmp_path / "draft" / "config.json")
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == read_json(inputs["target"])["aux_layer_ids"]
    names = set(weights(tmp_path / "draft"))
    assert {"fc.weight", "embed_tokens.weight", "lm_head.weight", "d2t", "t2d", "layers.0.hidden_norm.weight"} <= names
    assert list((tmp_path / "work" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.gpu
def test_training_from_fp8_states_learns_as_from_full_precision(inputs, tmp_path):
    fp8 = build_training_inputs(tmp_path / "fp8", storage_dtype="fp8")
    settings = dataclasses.replace(SETTINGS, epochs=4)
    full = train(inputs, tmp_path, settings, "full")["final"]
    quantized = train(fp8, tmp_path, settings, "fp8")["final"]
    for step in range(settings.ttt_steps):
        assert quantized["loss"][step] == pytest.approx(full["loss"][step], rel=0.05)


@pytest.mark.gpu
def test_an_fp8_batch_dequantised_on_the_device_holds_the_stored_states(tmp_path):
    fp8 = build_training_inputs(tmp_path / "fp8", storage_dtype="fp8", num_samples=8)
    _, meta, batch = objective_and_batches(fp8, ttt_steps=2)
    index = HiddenStateIndex.load(fp8["index"])
    stored = read_shard(index, index.shards[0])  # dequantised by the store's own reader
    packed = batch([0, 1])
    assert packed["aux"].dtype == torch.float8_e4m3fn  # fp8 until it reaches the device
    packed = dequantize_batch(packed, torch.bfloat16)
    assert "scales" not in packed and packed["aux"].dtype == torch.bfloat16
    m0 = int(meta.lengths[0])
    h = index.hidden_size
    for a, layer in enumerate(index.aux_layer_ids):
        assert torch.equal(packed["aux"][:m0, a * h:(a + 1) * h], stored.states[layer][:m0])
    assert torch.equal(packed["final"][:m0], stored.states[index.final_layer_id][1:m0 + 1])


def test_two_ddp_processes_match_one_process_on_the_same_global_batches(inputs, tmp_path):
    """torchrun with 2 gloo processes x 1 micro-batch against 1 process x 2 accumulated micro-batches,
    with feature noise: each micro-batch draws its noise from its own seed, on any rank."""
    settings = dataclasses.replace(SETTINGS, max_steps=6, checkpoint_every=3, feature_noise=0.1)
    one = run_training(inputs["index"], inputs["mapping"], inputs["target"], tmp_path / "one" / "draft",
                       tmp_path / "one" / "work", dataclasses.replace(settings, grad_accum_steps=2))
    two = run_training(inputs["index"], inputs["mapping"], inputs["target"], tmp_path / "two" / "draft",
                       tmp_path / "two" / "work", settings, devices=2, log_path=tmp_path / "torchrun.log")
    assert two["world_size"] == 2 and one["steps"] == two["steps"] == 6 and one["tokens"] == two["tokens"]
    a, b = weights(tmp_path / "one" / "draft"), weights(tmp_path / "two" / "draft")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6, msg=name)
    assert one["final"]["acc"] == pytest.approx(two["final"]["acc"])
    assert one["final"]["loss"] == pytest.approx(two["final"]["loss"], rel=1e-4)


def test_multi_node_training_is_srun_starting_torchrun_at_a_rendezvous(inputs, tmp_path):
    """The launch command per case, and its torchrun part run for real (one node, 2 gloo processes
    meeting at the c10d rendezvous instead of --standalone)."""
    launch = tmp_path / "launch.json"
    assert launch_command(launch, 4)[0][-4:] == ["--standalone", "-m", "draftsmith.train", str(launch)]
    with pytest.raises(TrainingError, match="not a SLURM allocation") as error:
        launch_command(launch, 8, 2, env={})
    assert error.value.where == "train.nodes" and "profiles/slurm" in error.value.fix
    with pytest.raises(TrainingError, match="has 1 node") as error:
        launch_command(launch, 8, 2, env={"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"})
    assert "overrides it" in error.value.fix
    cmd, env = launch_command(launch, 2, 2, rdzv_port=29731, env={
        "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_GPU": "1", "SLURM_NTASKS": "16"})
    start = cmd.index(sys.executable)
    assert cmd[:start] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--gpus-per-node=2",
                           "--kill-on-bad-exit=1"]
    # the batch step's task layout (one task per GPU) would contradict srun's one task per node
    assert env == {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}
    torchrun = cmd[start:]
    assert {"--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_id=draftsmith-7"} <= set(torchrun)
    assert any(a.startswith("--rdzv_endpoint=") and a.endswith(":29731") for a in torchrun)

    settings = dataclasses.replace(SETTINGS, max_steps=2, checkpoint_every=2)
    launch.write_text(json.dumps({
        "index_path": str(inputs["index"]), "mapping_path": str(inputs["mapping"]), "target_json": str(inputs["target"]),
        "out_dir": str(tmp_path / "draft"), "work_dir": str(tmp_path / "work"), "settings": dataclasses.asdict(settings)}))
    one_node = [a.replace("--nnodes=2", "--nnodes=1") for a in torchrun]
    done = subprocess.run(one_node, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = read_json(tmp_path / "work" / "summary.json")
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert (tmp_path / "draft" / "model.safetensors").exists()


def test_a_damaged_checkpoint_is_passed_over_for_the_one_before_it(inputs, tmp_path):
    """A checkpoint's files damaged on disk (a write is atomic, so only the disk does it): the rerun
    resumes from the checkpoint before it, saying which it passed over and why; with none readable,
    from step 0, where every rerun failed on safetensors' own error before."""
    settings = dataclasses.replace(SETTINGS, max_steps=6, checkpoint_every=3)
    train(inputs, tmp_path, settings)  # train_draft alone: no run_training to mark the run delivered
    work = tmp_path / "run" / "work"
    latest = work / "checkpoints" / "step-00000006" / "model.safetensors"
    latest.write_bytes(latest.read_bytes()[:-64])
    resumed = train(inputs, tmp_path, settings)
    assert resumed["resumed_from_step"] == 3 and resumed["steps"] == 6
    assert "step-00000006: model.safetensors cannot be read as safetensors" in resumed["resume"]

    for step in ("step-00000003", "step-00000006"):
        (work / "checkpoints" / step / "state.json").write_text("{")
    again = train(inputs, tmp_path, settings)
    assert again["resumed_from_step"] == 0 and "no readable checkpoint" in again["resume"]


def test_a_full_disk_while_logging_metrics_is_a_storage_error_naming_the_file(tmp_path, monkeypatch):
    """Training's own log on a disk that fills: a StorageError with the file and the fix (free space,
    rerun: it resumes), not a bare OSError from TensorBoard's writer thread."""
    import errno

    from draftsmith.errors import StorageError
    from draftsmith.train.metrics import RunLog

    run_log = RunLog(tmp_path, 0, [10], main=True, progress=False)

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_log.metrics_file, "write", full)
    entry = {"step": 1, "lr": 1e-3, "tokens_per_s": 1.0, "grad_norm": 1.0, "tau": 1.0, "loss": [1.0], "acc": [0.5],
             "cond_acc": [0.5], "joint_acc": [0.5], "draft_vocab_acc": [1.0]}
    with pytest.raises(StorageError) as error:
        run_log.write(entry)
    assert error.value.where.endswith("metrics.jsonl") and "free disk space" in error.value.fix
    monkeypatch.undo()
    run_log.close()


def test_the_worker_module_run_by_hand_says_what_it_takes(tmp_path):
    """``python -m draftsmith.train`` without its launch file prints a usage line (it was a bare
    IndexError), and names a missing launch file and where train_draft writes one."""
    bare = subprocess.run([sys.executable, "-m", "draftsmith.train"], capture_output=True, text=True, cwd=REPO)
    assert bare.returncode == 2 and "usage: python -m draftsmith.train [-h] launch_json" in bare.stderr
    assert "Traceback" not in bare.stderr
    from draftsmith.train.launch import worker_args

    with pytest.raises(TrainingError, match="no such launch file.*train/state"):
        worker_args([str(tmp_path / "launch.json")])


def test_killed_run_resumes_and_ends_with_the_uninterrupted_weights(inputs, tmp_path):
    """With feature noise: the resumed steps draw the noise the uninterrupted run drew."""
    settings = dataclasses.replace(SETTINGS, max_steps=12, checkpoint_every=3, feature_noise=0.1)
    reference = train(inputs, tmp_path, settings, "reference")
    assert reference["resumed_from_step"] == 0

    work = tmp_path / "killed" / "work"
    script = tmp_path / "slow_train.py"
    script.write_text(textwrap.dedent(f"""
        import time
        import draftsmith.train.loop as loop
        from draftsmith.train import TrainSettings, train_draft
        slow = loop.train_step
        loop.train_step = lambda *a, **k: (time.sleep(0.4), slow(*a, **k))[1]  # long enough to be killed mid-run
        train_draft({str(inputs["index"])!r}, {str(inputs["mapping"])!r}, {str(inputs["target"])!r},
                    {str(tmp_path / "killed" / "draft")!r}, {str(work)!r},
                    TrainSettings(**{dataclasses.asdict(settings)!r}))
    """))
    child = subprocess.Popen([sys.executable, str(script)], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL)
    pointer = work / "checkpoints" / "latest.json"
    deadline = time.time() + 120
    while time.time() < deadline and not (pointer.exists() and read_json(pointer)["step"] >= 6):
        assert child.poll() is None, "training ended before it could be killed"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert not (tmp_path / "killed" / "draft" / "model.safetensors").exists()
    killed_at = read_json(pointer)["step"]
    assert 6 <= killed_at < 12

    resumed = train(inputs, tmp_path, settings, "killed")
    assert resumed["resumed_from_step"] == killed_at and resumed["steps"] == 12
    a, b = weights(tmp_path / "reference" / "draft"), weights(tmp_path / "killed" / "draft")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)
    steps = [json.loads(line)["step"] for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 12


def test_a_rerun_refused_while_the_draft_is_being_written_still_gets_it_removed(tmp_path):
    """The refused job's mark may land between the holder's check and its last write: the check
    after writing removes what was written, so nothing is left for Snakemake to take for the
    refused job's outputs."""
    from draftsmith.io import check_not_superseded, lock_beside, sole_writer

    work, draft = tmp_path / "work", tmp_path / "draft"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from draftsmith.train.launch import trainer_lock\n"
                               f"with trainer_lock(Path({str(work)!r})):\n print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline() == b"held\n"
        check_not_superseded(lock_beside(work), "training", TrainingError)  # before the write: nobody refused yet
        draft.mkdir()
        written = [draft / "config.json", draft / "model.safetensors"]
        for path in written:
            path.write_text("{}")
        with pytest.raises(TrainingError, match="another process"):
            with sole_writer(lock_beside(work), "training in work", str(work), TrainingError):
                pass  # the rerun's job, refused meanwhile
        with pytest.raises(TrainingError, match="leaves the rule's outputs to that job's rerun"):
            check_not_superseded(lock_beside(work), "training", TrainingError, written=written)
        assert not any(path.exists() for path in written)
    finally:
        holder.kill()
        holder.wait()


def test_a_retrain_that_stops_leaves_no_summary_of_the_draft_snakemake_removed(tmp_path):
    """Snakemake removes the draft's declared files (config.json, model.safetensors) before the job
    and after a failure; the summary beside them goes at the job's start, so an interrupted retrain
    leaves no summary of a draft that is gone."""
    from draftsmith.train import run_training

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "training_summary.json").write_text('{"settings": {"lr": 0.0003}}')
    with pytest.raises(FileNotFoundError):  # a retrain that stops at once: here, on a store that is not there
        run_training(tmp_path / "hs" / "index.json", tmp_path / "mapping.safetensors", tmp_path / "target.json",
                     draft, tmp_path / "work", SETTINGS)
    assert not (draft / "training_summary.json").exists()


def test_an_orphaned_trainer_leaves_the_draft_to_the_rerun_it_outlived(inputs, tmp_path):
    """Snakemake killed, its trainer runs on; the rerun's job (other settings) is refused the lock
    and fails. The orphan must not then deliver its draft where the failed job's outputs were
    recorded (Snakemake would take it for the new settings' draft): it stops before writing it,
    and the next rerun trains with the new settings."""
    from draftsmith.train import run_training

    settings = dataclasses.replace(SETTINGS, max_steps=8, checkpoint_every=2)
    draft, work = tmp_path / "run" / "draft", tmp_path / "run" / "work"
    script = tmp_path / "orphan.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        import draftsmith.train.loop as loop
        from draftsmith.errors import TrainingError
        from draftsmith.train import TrainSettings, run_training
        slow = loop.train_step
        loop.train_step = lambda *a, **k: (time.sleep(0.3), slow(*a, **k))[1]  # still running when the rerun comes
        try:
            run_training({str(inputs["index"])!r}, {str(inputs["mapping"])!r}, {str(inputs["target"])!r},
                         {str(draft)!r}, {str(work)!r}, TrainSettings(**{dataclasses.asdict(settings)!r}))
        except TrainingError as e:
            print("REFUSED", e.what, flush=True)
    """))
    orphan = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                              stderr=subprocess.DEVNULL)
    pointer = work / "checkpoints" / "latest.json"
    deadline = time.time() + 120
    while time.time() < deadline and not pointer.exists():
        assert orphan.poll() is None, "the orphan finished before the rerun came"
        time.sleep(0.05)
    rerun = dataclasses.replace(settings, lr=1e-3)
    with pytest.raises(TrainingError, match="another process .* is training in"):
        run_training(inputs["index"], inputs["mapping"], inputs["target"], draft, work, rerun)
    out, _ = orphan.communicate(timeout=300)
    assert "REFUSED a later job" in out and "leaves the rule's outputs to that job's rerun" in out
    assert not draft.exists()  # nothing for Snakemake to take for the rerun's draft
    summary = run_training(inputs["index"], inputs["mapping"], inputs["target"], draft, work, rerun)
    assert summary["resumed_from_step"] == 0 and summary["settings"]["lr"] == 1e-3
    assert read_json(draft / "training_summary.json")["settings"]["lr"] == 1e-3


@pytest.mark.gpu
def test_checkpoint_from_other_settings_is_not_resumed(inputs, tmp_path):
    settings = dataclasses.replace(SETTINGS, max_steps=4, checkpoint_every=2)
    assert train(inputs, tmp_path, settings)["resumed_from_step"] == 0
    assert train(inputs, tmp_path, settings)["resumed_from_step"] == 4  # finished: only rewrites the draft
    changed = train(inputs, tmp_path, dataclasses.replace(settings, lr=1e-3))
    assert changed["resumed_from_step"] == 0
    # settings that do not change the math keep the checkpoint valid
    assert train(inputs, tmp_path, dataclasses.replace(settings, lr=1e-3, log_every=1))["resumed_from_step"] == 4


def test_a_delivered_draft_is_trained_again_and_a_code_change_starts_at_step_0(inputs, tmp_path, monkeypatch):
    """What the rule sees (run_training): a rerun after the draft was delivered (--forcerun) trains
    from step 0, a run killed before delivering resumes, and other training code never resumes."""
    settings = dataclasses.replace(SETTINGS, max_steps=4, checkpoint_every=2)

    def run() -> dict:
        return run_training(inputs["index"], inputs["mapping"], inputs["target"], tmp_path / "draft",
                            tmp_path / "work", settings)

    first = run()
    assert first["resumed_from_step"] == 0 and "no checkpoint" in first["resume"]
    forced = run()
    assert forced["resumed_from_step"] == 0 and "finished run" in forced["resume"]
    (tmp_path / "work" / "finished.json").unlink()  # as if killed before the outputs were written
    killed = run()
    assert killed["resumed_from_step"] == 4 and "same code, settings and inputs" in killed["resume"]
    (tmp_path / "work" / "finished.json").unlink()
    monkeypatch.setattr("draftsmith.fingerprint.code_fingerprint", lambda *modules: "patched")
    patched = run()
    assert patched["resumed_from_step"] == 0
    assert "the training code (draftsmith.train and its imports) changed" in patched["resume"]


def test_non_finite_loss_stops_naming_the_step_and_last_good_checkpoint(tmp_path):
    inputs = build_training_inputs(tmp_path / "inputs", num_samples=16, samples_per_shard=2, poison_shard=5)
    settings = dataclasses.replace(SETTINGS, checkpoint_every=1, log_every=1, epochs=1)
    with pytest.raises(TrainingError) as err:
        train(inputs, tmp_path, settings)
    message = str(err.value)
    step = int(message.split("at step ")[1].split()[0])
    if step > 1:
        assert f"step-{step - 1:08d}" in err.value.where
    assert not (tmp_path / "run" / "work" / "checkpoints" / f"step-{step:08d}").exists()
    assert not (tmp_path / "run" / "draft").exists()


def test_corrupt_shard_is_caught_before_a_draft_is_written(inputs, tmp_path):
    import shutil

    copy = tmp_path / "inputs"
    shutil.copytree(Path(inputs["index"]).parents[1], copy)
    index = HiddenStateIndex.load(copy / "hidden_states" / "index.json")
    layer_file = index.root / index.shards[1].path / f"layer-{index.final_layer_id}.safetensors"
    data = bytearray(layer_file.read_bytes())
    data[-5] ^= 0x40
    layer_file.write_bytes(bytes(data))
    moved = {k: copy / Path(v).relative_to(Path(inputs["index"]).parents[1]) for k, v in inputs.items()}
    write_target_json(moved["target"], copy / "target")
    with pytest.raises(TrainingError, match="checksum mismatch"):
        train(moved, tmp_path, dataclasses.replace(SETTINGS, max_steps=3))
    assert not (tmp_path / "run" / "draft").exists()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.gpu
def test_trained_draft_is_served_by_vllm_eagle3(inputs, tmp_path):
    """vLLM's eagle3 loader takes the draft as written (weight names, fc width for 2 aux layers,
    d2t) and its proposer drafts with it."""
    pytest.importorskip("vllm")
    train(inputs, tmp_path, dataclasses.replace(SETTINGS, max_steps=4))
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(f"""
        import json, os
        def main():
            from vllm import LLM, SamplingParams
            llm = LLM(model={str(Path(inputs["target"]).parent / "target")!r}, max_model_len=128, enforce_eager=True,
                      dtype="float32", max_num_seqs=2, disable_log_stats=False, **{ENGINE_ARGS!r},
                      speculative_config={{"model": {str(tmp_path / "run" / "draft")!r}, "method": "eagle3",
                                          "num_speculative_tokens": 3}})
            llm.generate(["Hello there, how are you"], SamplingParams(max_tokens=16, temperature=0))
            metrics = {{m.name: getattr(m, "value", None) for m in llm.get_metrics()}}
            print("METRICS", json.dumps({{k: v for k, v in metrics.items() if "spec_decode" in k}}))
        if __name__ == "__main__":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            main()
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    metrics = json.loads(out.stdout.split("METRICS", 1)[1].splitlines()[0])
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"] == 3 * metrics["vllm:spec_decode_num_drafts"]


@pytest.mark.gpu
def test_trained_eagle31_draft_is_served_by_vllm_as_the_hf_loop_drafts(tmp_path):
    """An EAGLE 3.1 draft (fc_norm, norm_output) of two layers with a trained lm_head, trained here on
    the target's own greedy replies, is served by vLLM's eagle3 speculator: every output equal to the
    HF loop's greedy decoding and vLLM's acceptance the HF loop's (to a draft near-tie), so vLLM drafts
    from the trained head's rows, with tokens accepted at draft positions 2 and 3, which the post-norm
    state fed between draft steps decides."""
    pytest.importorskip("vllm")
    inputs = build_training_inputs(tmp_path / "inputs", num_samples=48, greedy_replies=True)
    settings = dataclasses.replace(SETTINGS, variant="eagle3.1", num_layers=2, epochs=40, log_every=50,
                                   checkpoint_every=10_000, train_lm_head=True)
    train(inputs, tmp_path, settings)
    draft = tmp_path / "run" / "draft"
    config = read_json(draft / "config.json")
    assert (config["fc_norm"], config["norm_output"], config["transformer_layer_config"]["num_hidden_layers"]) == (
        True, True, 2)
    prompts = [(name, ids[:mask.index(1)]) for name, ids, mask in random_samples(48, 0)[:6]]
    k, new_tokens = 3, 24
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"id": n, "messages": [], "prompt_ids": ids}) + "\n" for n, ids in prompts))
    script = tmp_path / "evaluate.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from draftsmith.evaluate import EvalSettings, evaluate_draft
        settings = EvalSettings(backend="vllm", hf_check=True, k={k}, k_sweep=({k},), max_prompts=6, max_new_tokens={new_tokens}, sweep_max_prompts=1,
                                model_dtype="float32", device="cpu")
        result = evaluate_draft({str(draft)!r}, {str(inputs["target"])!r}, {str(heldout)!r}, {str(tmp_path / "acc.json")!r},
                                settings, engine_kwargs={ENGINE_ARGS!r})
        print("RESULT", json.dumps(result))
    """))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                         env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.split("RESULT", 1)[1].splitlines()[0])
    served = result["vllm"]
    # evaluate_draft checked every served output against the HF loop's greedy decoding (it raises otherwise)
    assert served["num_prompts"] == len(prompts) and result["lossless"]["checked_generations"] == 2 * len(prompts) + len(prompts)
    # vLLM's draft kernels and the HF loop's agree up to float32 rounding: a near-tie in the draft's
    # argmax may change one step of one prompt, never the outputs; on CUDA, vLLM also proposes fewer
    # than k tokens in a step that nears max_model_len (each such token can make one more prompt's
    # steps differ from the loop's, which always proposes k)
    cut_short = k * served["num_drafts"] - served["num_draft_tokens"]
    if per_request_records():
        # vLLM's per-request records are its counters' steps, and the prompts whose steps are the
        # loop's are all but the near-tie's and those cut short; the steps after a changed one shift
        # with it, so a differing prompt's count may move by up to the span of its steps (from
        # ceil(T / (k + 1)) to T): vLLM took 70 steps against the loop's 73 once on CUDA
        assert served["per_request"]["num_steps"] == served["num_drafts"]
        assert served["per_request"]["tau"] == pytest.approx(served["tau"])
        differing = len(prompts) - served["prompts_with_the_hf_loops_steps"]
        assert differing <= 1 + cut_short
        span = new_tokens - math.ceil(new_tokens / (k + 1))
        assert abs(served["num_drafts"] - served["hf_loop"]["num_steps"]) <= differing * span
        if differing == 0:
            assert served["tau"] == pytest.approx(served["hf_loop"]["tau"], rel=0.02)
    else:  # releases without per-request step records (0.24) report None here
        assert served["prompts_with_the_hf_loops_steps"] is None
        assert abs(served["num_drafts"] - served["hf_loop"]["num_steps"]) <= 1
        assert served["tau"] == pytest.approx(served["hf_loop"]["tau"], rel=0.02)
    assert served["hf_loop"]["tau"] == pytest.approx(result["tau"])
    assert min(result["acceptance_rate_by_position"][1:]) > 0.05, result["acceptance_rate_by_position"]


def test_workflow_script_plumbs_the_rule_into_run_training(inputs, tmp_path):
    """workflow_scripts/train_draft.py with the rule's input/output/params/log names."""
    import runpy
    from types import SimpleNamespace

    results = tmp_path / "results"
    (results / "train").mkdir(parents=True)
    log = tmp_path / "train_draft.log"
    log.touch()
    rule = SimpleNamespace(
        input=SimpleNamespace(index=str(inputs["index"]), mapping=str(inputs["mapping"]), target=str(inputs["target"])),
        output=SimpleNamespace(config=str(results / "draft" / "config.json"),
                               weights=str(results / "draft" / "model.safetensors"),
                               metrics=str(results / "train" / "metrics.jsonl"),
                               summary=str(results / "train" / "summary.json")),
        params=SimpleNamespace(work_dir=str(results / "train" / "state"), code="x", config={
            "train": {"ttt_steps": 2, "epochs": 1, "max_steps": 3, "batch_tokens": 96, "lr": 1e-3, "warmup_steps": 1,
                      "weight_decay": 0.0, "max_grad_norm": 1.0, "ttt_decay": 0.8, "log_every": 1, "devices": 1,
                      "nodes": 1},
            "seed": 0, "device": "cpu"}),
        # the workflow's config: the keys the rule leaves untracked (TrainSettings.UNTRACKED) come from it
        config={"train": {"checkpoint_every": 2, "rdzv_port": 29400}},
        resources=SimpleNamespace(gpu=0),
        log=[str(log)])
    runpy.run_path(str(REPO / "workflow_scripts" / "train_draft.py"), init_globals={"snakemake": rule})
    for path in vars(rule.output).values():
        assert Path(path).exists(), path
    assert read_json(results / "train" / "summary.json")["steps"] == 3
    assert (results / "train" / "state" / "checkpoints" / "step-00000002").is_dir()  # checkpoint_every: 2
    assert (results / "train" / "state" / "checkpoints" / "latest.json").exists()


def test_a_step_out_of_memory_names_the_batch_and_the_setting_to_lower(inputs, tmp_path, monkeypatch):
    """The CPU allocator's RuntimeError in a step becomes a TrainingError: the step, the batch
    tokens and train.batch_tokens in its fix, the allocator's words kept."""
    import draftsmith.train.loop as loop

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 17384949904 bytes")

    monkeypatch.setattr(loop, "train_step", out_of_memory)
    with pytest.raises(TrainingError) as info:
        train(inputs, tmp_path, dataclasses.replace(SETTINGS, device="cpu"))
    e = info.value
    assert "training step 1 of" in e.what and "17384949904 bytes" in e.what
    assert "train.batch_tokens=96" in e.where and "sdpa attention" in e.where
    assert "lower train.batch_tokens" in e.fix
