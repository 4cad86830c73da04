"""The trained draft served by vLLM as the target's EAGLE-3 speculator: lossless, and counted as
the HF evaluation loop counts.

Two tiny targets, each served in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

- a random-init Llama with a random-init draft saved by ``save_speculators`` (draft vocabulary
  of 128 even ids, through d2t): real numerics, next to no acceptance;
- a "cycle" Llama whose layers pass the token embedding through and whose lm_head maps each token
  of two cycles to its successor, with a hand-built draft that is exact on cycle A (every draft
  token right, τ = k + 1) and right only at its first position on cycle B (τ = 2). Both figures
  are known before anything runs, so vLLM's counters and the HF loop's are checked against them
  and against each other step by step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from draftsmith.errors import EvaluationError
from tiny_vllm import ENGINE_ARGS, per_request_records, vllm_test

K = 3




def hf_backend(path, target, max_new_tokens, stop_ids=()):
    from draftsmith.engines.hf_model import load_target_model
    from draftsmith.evaluate import HFDecoder

    model = load_target_model(path, dtype="float32", device="cpu")
    return HFDecoder(model, list(stop_ids), max_new_tokens, layers_path=target["layers_path"],
                     aux_layer_ids=target["aux_layer_ids"])


# ---------------------------------------------------------------------------------------------
# A random-init target and draft


LLAMA_PROMPTS = {"p0": [12, 40, 7, 99, 3, 250, 17], "p1": [5, 6, 7, 8, 9, 10],
                 "p2": [300, 301, 2, 2, 2, 44, 45, 46, 47, 48, 49], "p3": [77]}
NEW_TOKENS = 24


def random_draft(target: dict, out_dir, draft_vocab_size: int = 128):
    """A random-init draft; under the full vocabulary, over the even target ids (d2t maps draft
    id i to target id 2i)."""
    from draftsmith.draft.config import Eagle3DraftConfig
    from draftsmith.draft.model import Eagle3Draft
    from draftsmith.draft.speculators_format import save_speculators

    config = Eagle3DraftConfig.from_target(target, draft_vocab_size=draft_vocab_size)
    torch.manual_seed(1)
    draft = Eagle3Draft(config)
    ids = torch.arange(draft_vocab_size)
    step = 2 if 2 * draft_vocab_size <= target["vocab_size"] else 1
    t2d = torch.zeros(target["vocab_size"], dtype=torch.bool)
    t2d[ids * step] = True
    with torch.no_grad():
        draft.d2t.copy_(ids * (step - 1))
        draft.t2d.copy_(t2d)
        for p in draft.parameters():
            if p.dim() >= 2 and p.requires_grad:
                p.normal_(0.0, 0.2)
    return save_speculators(draft, out_dir, dtype="float32")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from draftsmith.targets.inspect import inspect_target

    root = tmp_path_factory.mktemp("served-llama")
    path = tiny.build_llama(root / "target", num_layers=4)
    target = inspect_target(path)
    return SimpleNamespace(path=path, target=target, draft=random_draft(target, root / "draft"),
                           hf=hf_backend(path, target, NEW_TOKENS))


@pytest.fixture(scope="module")
def llama_eval(llama, tmp_path_factory, in_process_engine):
    """evaluate_draft with eval.backend vllm on the random target, run once for the tests below."""
    from draftsmith.evaluate import EvalSettings, evaluate_draft
    from draftsmith.targets.inspect import write_target_json

    root = tmp_path_factory.mktemp("served-llama-eval")
    write_target_json(root / "target.json", llama.path)
    heldout = tiny.write_jsonl(root / "heldout.jsonl", [
        {"id": pid, "messages": [], "prompt_ids": ids, "source": {"file": "x.jsonl", "line": i}}
        for i, (pid, ids) in enumerate(LLAMA_PROMPTS.items())])
    settings = EvalSettings(backend="vllm", hf_check=True, k=K, k_sweep=(1, K), max_prompts=len(LLAMA_PROMPTS),
                            max_new_tokens=NEW_TOKENS, sweep_max_prompts=2, model_dtype="float32", device="cpu")
    out = root / "eval" / "acceptance.json"
    result = evaluate_draft(llama.draft, root / "target.json", heldout, out, settings, engine_kwargs=ENGINE_ARGS)
    return SimpleNamespace(result=result, out=out)


@vllm_test
def test_evaluate_draft_serves_the_draft_in_vllm(llama, llama_eval, tmp_path):
    """vLLM's run with the draft reproduced the HF loop's greedy decoding (evaluate_draft raises
    otherwise), in one engine, the draft's; vLLM's figures sit beside the HF loop's and agree."""
    from draftsmith.evaluate.vllm import batch_size_for
    from draftsmith.plots import plot_evaluation

    written = json.loads(llama_eval.out.read_text())
    assert written == json.loads(json.dumps(llama_eval.result))
    v = written["vllm"]
    assert v["speculative_config"] == {"method": "eagle3", "model": str(llama.draft), "num_speculative_tokens": K}
    from draftsmith.targets.vllm_compat import support_range_problem

    assert support_range_problem(v["version"]) is None
    assert v["num_prompts"] == len(LLAMA_PROMPTS) and v["num_tokens"] == NEW_TOKENS * len(LLAMA_PROMPTS)
    # vLLM may propose fewer than k tokens in a step that nears max_model_len (0.24 and 0.32 on CUDA
    # did), where the HF loop proposes k: such a step is the loop's in what it accepts, not in what it proposed
    cut_short = K * v["num_drafts"] - v["num_draft_tokens"]
    assert v["num_drafts"] > 0 and 0 <= cut_short <= len(LLAMA_PROMPTS)
    assert v["tau"] == pytest.approx(1 + v["num_accepted_tokens"] / v["num_drafts"]) == pytest.approx(v["hf_loop"]["tau"])
    assert v["num_drafts"] == v["hf_loop"]["num_steps"]
    if per_request_records():
        assert v["per_request"]["tau"] == pytest.approx(v["tau"])
        assert v["per_request"]["num_steps"] == v["num_drafts"]
        assert v["prompts_with_the_hf_loops_steps"] >= len(LLAMA_PROMPTS) - cut_short
        assert v["engine"]["per_request_spec_decode_metrics"] == "detailed"
    else:
        assert v["per_request"]["tau"] is None and v["prompts_with_the_hf_loops_steps"] is None
    # one engine decodes: vLLM's greedy decoding is not timed beside it (eval.separate_engines)
    assert v["seconds"] > 0 and v["greedy_seconds"] is None and v["speedup"] is None
    assert v["engine"]["dtype"] == "float32"
    # sized to the batch it decodes (its CUDA graphs' sizes), to the next power of two
    assert v["engine"]["max_num_seqs"] == batch_size_for(len(LLAMA_PROMPTS)) >= len(LLAMA_PROMPTS)
    # Checked: the HF loop's draft and baseline at k = 3 on every prompt, and vLLM's run on every
    # prompt; the sweep's k = 1 is replayed on the first 2, whose replay at k = 3 is the loop's run.
    assert written["lossless"]["checked_generations"] == 2 * len(LLAMA_PROMPTS) + len(LLAMA_PROMPTS)
    assert written["tau_by_k"]["replay_check"]["equal_to_the_loop"] == {"draft": 2, "baseline": 2}
    assert written["lossless"]["numerical_ties"] == []
    plot_evaluation(llama_eval.out, tmp_path / "by_position.png", tmp_path / "tau.png", tmp_path / "sets.png")
    assert (tmp_path / "tau.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# The cycle target: acceptance known in advance


CYCLE_A = (20, 21, 22, 23, 24)  # the draft is exact here
CYCLE_B = (30, 31, 32, 33)      # the draft is right at its first position only


def _successor(vocab: int) -> list[int]:
    successor = list(range(vocab))
    for cycle in (CYCLE_A, CYCLE_B):
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            successor[a] = b
    return successor


def build_cycle_target(path) -> None:
    """A Llama whose attention and MLP outputs are zero (the residual stream stays the one-hot
    token embedding, so every aux state is the token) and whose lm_head picks the successor."""
    from transformers import LlamaForCausalLM

    tiny.build_tokenizer(path)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny.llama_config(num_layers=4)).eval()
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    successor = _successor(vocab)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        head = torch.zeros_like(model.lm_head.weight)
        for token in range(hidden):
            head[successor[token], token] = 1.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)


def build_cycle_draft(target: dict, out_dir):
    """fc passes the first aux state (the one-hot token t at the last verified position p), the
    draft layer's attention adds nothing, its MLP moves a cycle-A token to its successor (so each
    draft step advances one token: exact) and leaves a cycle-B token where it is; the lm_head maps a
    cycle-A state to its successor and a cycle-B state two ahead. Cycle B's first draft token
    (t_{p+2} = successor²(t_p)) is therefore right and the later ones repeat it: wrong."""
    from draftsmith.draft.config import Eagle3DraftConfig
    from draftsmith.draft.model import Eagle3Draft
    from draftsmith.draft.speculators_format import save_speculators

    hidden = target["hidden_size"]
    config = Eagle3DraftConfig.from_target(target, draft_vocab_size=hidden)  # draft id i = target id i
    draft = Eagle3Draft(config)
    successor = _successor(target["vocab_size"])
    # A one-hot state has RMS 1/sqrt(H): every norm turns it into sqrt(H) at the token.
    scale = hidden ** 0.5
    unit = torch.nn.functional.silu(torch.tensor(scale)).item()  # gate = scale, up = 1
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(torch.eye(target["vocab_size"], hidden))
        draft.fc.weight.zero_()
        draft.fc.weight[:, :hidden] = torch.eye(hidden)
        layer = draft.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        for w in (layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight,
                  draft.lm_head.weight):
            w.zero_()
        for t in CYCLE_A:
            layer.mlp.gate_proj.weight[t, t] = 1.0
            layer.mlp.up_proj.weight[t, t] = 1.0 / scale
            layer.mlp.down_proj.weight[successor[t], t] += scale / unit
            layer.mlp.down_proj.weight[t, t] -= scale / unit
        for t in range(hidden):
            ahead = successor[successor[t]] if t in CYCLE_B else successor[t]
            draft.lm_head.weight[ahead, t] = 1.0
        draft.d2t.zero_()
        draft.t2d.zero_()
        draft.t2d[:hidden] = True
    return save_speculators(draft, out_dir, dtype="float32")


CYCLE_PROMPTS = {"a": [20, 21, 22, 23, 24, 20, 21], "a2": [22, 23], "b": [30, 31, 32, 33, 30], "b2": [32]}
CYCLE_TOKENS = 20
# 20 tokens: one from the prefill, then steps of k + 1 (cycle A: 5 steps, the last one cut) or of
# 2 (cycle B: 10 steps, the last one cut).
CYCLE_STEPS = {"a": [K] * 5, "a2": [K] * 5, "b": [1] * 10, "b2": [1] * 10}


@pytest.fixture(scope="module")
def cycle(tmp_path_factory, in_process_engine):
    from draftsmith.engines.vllm_serving import VllmServer
    from draftsmith.targets.inspect import inspect_target

    root = tmp_path_factory.mktemp("served-cycle")
    build_cycle_target(root / "target")
    target = inspect_target(root / "target")
    draft = build_cycle_draft(target, root / "draft")
    server = VllmServer(str(root / "target"), dtype="float32", max_model_len=64, **ENGINE_ARGS,
                        speculative_config={"method": "eagle3", "model": str(draft), "num_speculative_tokens": K})
    yield SimpleNamespace(target=target, draft=draft, server=server,
                          hf=hf_backend(root / "target", target, CYCLE_TOKENS))
    server.close()


def _serve(cycle, names, **kwargs):
    kwargs.setdefault("max_new_tokens", CYCLE_TOKENS)
    return cycle.server.generate([CYCLE_PROMPTS[n] for n in names], **kwargs)


@vllm_test
def test_perfect_draft_is_fully_accepted(cycle):
    from draftsmith.evaluate import Prompt

    served, counters, _ = _serve(cycle, ["a", "a2"])
    for name, out in zip(["a", "a2"], served):
        assert out.tokens == cycle.hf.greedy(Prompt(name, CYCLE_PROMPTS[name])).tokens
        assert out.accepted == (CYCLE_STEPS[name] if per_request_records() else None)
    assert counters.drafts == 10 and counters.accepted_per_position == [10] * K
    assert counters.summary()["tau"] == K + 1
    assert counters.summary()["acceptance_rate_by_position"] == [1.0] * K


@vllm_test
def test_vllm_counts_as_the_hf_loop_step_by_step(cycle):
    """All four prompts in one batch: vLLM's counters are the sums of its per-request records, which
    are the HF loop's steps for the same draft; the figures are the ones known in advance."""
    from draftsmith.evaluate import DrafterSpec, Prompt, acceptance_stats

    names = list(CYCLE_PROMPTS)
    served, c, _ = _serve(cycle, names)
    loops = []
    for name, out in zip(names, served):
        prompt = Prompt(name, CYCLE_PROMPTS[name])
        assert out.tokens == cycle.hf.greedy(prompt).tokens, name
        loop = cycle.hf.speculate(prompt, DrafterSpec("eagle3", path=str(cycle.draft)), K)
        assert loop.accepted == CYCLE_STEPS[name] and loop.proposed == [K] * len(loop.accepted), name
        if per_request_records():
            assert (out.accepted, out.proposed) == (loop.accepted, loop.proposed), name
        loops.append(loop)
    steps = [a for loop in loops for a in loop.accepted]
    assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (30, 90, 50) == (len(steps), K * len(steps), sum(steps))
    assert c.accepted_per_position == [30, 10, 10]
    assert all(a >= b for a, b in zip(c.accepted_per_position, c.accepted_per_position[1:]))
    summary = c.summary()
    assert summary["tau"] == pytest.approx(1 + 50 / 30) == pytest.approx(acceptance_stats(loops, K)["tau"])
    assert summary["acceptance_rate_by_position"] == pytest.approx(
        acceptance_stats(loops, K)["acceptance_rate_by_position"])
    # A later call counts only itself.
    _, again, _ = _serve(cycle, ["b2"], max_new_tokens=5)
    assert (again.drafts, again.accepted_per_position) == (2, [2, 0, 0])


@vllm_test
def test_stop_tokens_end_the_output_as_in_the_hf_loop(cycle):
    from draftsmith.evaluate import DrafterSpec, HFDecoder, Prompt

    prompt = Prompt("a", CYCLE_PROMPTS["a"])
    with_stop = HFDecoder(cycle.hf.target.model, [23], CYCLE_TOKENS, layers_path=cycle.target["layers_path"],
                          aux_layer_ids=cycle.target["aux_layer_ids"])
    try:
        expected = with_stop.speculate(prompt, DrafterSpec("eagle3", path=str(cycle.draft)), K)
    finally:
        with_stop.close()
    [out], counters, _ = _serve(cycle, ["a"], stop_ids=[23])
    assert out.tokens == expected.tokens == [22, 23]
    assert expected.accepted == [K] and (counters.drafts, counters.accepted_tokens) == (1, K)
    if per_request_records():
        assert out.accepted == expected.accepted


# ---------------------------------------------------------------------------------------------
# Without an engine


def _vllm_run(prompts, greedy, draft):
    from draftsmith.engines.vllm_serving import SpecCounters
    from draftsmith.evaluate import Generation, VllmRun

    def gens(tokens):
        return [Generation(p.id, t, 0.0, [0] * len(t), [K] * len(t)) for p, t in zip(prompts, tokens)]

    return VllmRun(gens(draft), SpecCounters(), 1.0, {}, {}, [], greedy=gens(greedy), greedy_seconds=1.0)


def test_a_served_output_off_greedy_is_named_by_prompt_and_position(llama, one_thread):
    """A token vLLM got wrong fails the evaluation with the prompt id and the generated position;
    a difference already present without speculation (vLLM's greedy run, eval.separate_engines) is
    blamed on the engine, not the draft."""
    from draftsmith.evaluate import DrafterSpec, EvalSettings, HFDecoder, Prompt, run_evaluation, vllm_outside_runs

    prompts = [Prompt(pid, ids) for pid, ids in list(LLAMA_PROMPTS.items())[:2]]
    settings = EvalSettings(k=K, k_sweep=(K,), max_new_tokens=10)
    backend = HFDecoder(llama.hf.target.model, [], settings.max_new_tokens)
    greedy = [backend.greedy(p).tokens for p in prompts]
    wrong = [list(t) for t in greedy]
    wrong[1][6] = (wrong[1][6] + 1) % 384

    def evaluate(run):
        run_evaluation(backend, prompts, DrafterSpec("ngram"), DrafterSpec("ngram"), settings,
                       vllm_outside_runs(run, K))

    evaluate(_vllm_run(prompts, greedy, greedy))
    with pytest.raises(EvaluationError) as error:
        evaluate(_vllm_run(prompts, greedy, wrong))
    message = str(error.value)
    assert "'p1'" in message and "generated position 6" in message
    assert "vLLM with the draft as its EAGLE-3 speculator (k=3) is not lossless" in message
    with pytest.raises(EvaluationError, match="vLLM's greedy decoding of the target differs") as error:
        evaluate(_vllm_run(prompts, wrong, wrong))
    assert "generated position 6" in str(error.value)


def test_drafts_vllm_cannot_serve_are_refused_before_loading(llama, tmp_path):
    from draftsmith.evaluate import check_servable

    check_servable(llama.target, llama.draft)
    with pytest.raises(EvaluationError, match="fuses the target's layers"):
        check_servable({**llama.target, "aux_layer_ids": [0, 1, 2]}, llama.draft)
    # the installed vLLM's answer, not target.json's (written before evaluation switched to vLLM, maybe)
    with pytest.raises(EvaluationError, match="does not implement SupportsEagle3"):
        check_servable({**llama.target, "architecture": "Gemma3ForCausalLM"}, llama.draft)
    # A draft over the whole vocabulary is saved without d2t/t2d, which vLLM 0.32 needs ...
    full = random_draft(llama.target, tmp_path / "full", draft_vocab_size=llama.target["vocab_size"])
    assert "d2t" not in load_file(full / "model.safetensors")
    check_servable(llama.target, full)
    # ... and one from elsewhere that carries them is refused before vLLM loads anything.
    tensors = load_file(full / "model.safetensors")
    vocab = llama.target["vocab_size"]
    tensors.update(d2t=torch.zeros(vocab, dtype=torch.int64), t2d=torch.ones(vocab, dtype=torch.bool))
    save_file(tensors, full / "model.safetensors")
    with pytest.raises(EvaluationError, match="whole vocabulary"):
        check_servable(llama.target, full)


def test_stop_ids_without_loading_weights(tmp_path):
    """vLLM starts before the HF loop loads the target, so its stop tokens come from the files:
    the same ones the loaded model and tokenizer give."""
    from transformers import AutoTokenizer, GenerationConfig

    from draftsmith.engines.hf_model import load_target_model, stop_ids_from_files, stop_token_ids

    path = tiny.build_llama(tmp_path / "target", num_layers=1)
    loaded = lambda: stop_token_ids(load_target_model(path, dtype="float32", device="cpu"),  # noqa: E731
                                    AutoTokenizer.from_pretrained(path))
    assert stop_ids_from_files(path) == loaded() == [2]
    GenerationConfig(eos_token_id=[7, 2]).save_pretrained(path)
    assert stop_ids_from_files(path) == loaded() == [7, 2]


def test_counters_from_metrics():
    from draftsmith.engines.vllm_serving import SpecCounters, read_spec_counters

    def metric(name, **kw):
        return SimpleNamespace(name=name, **kw)

    snapshot = [metric("vllm:spec_decode_num_drafts", value=4), metric("vllm:spec_decode_num_draft_tokens", value=12),
                metric("vllm:spec_decode_num_accepted_tokens", value=5),
                metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[3, 2, 0]),
                metric("vllm:num_requests_running", value=1)]
    c = read_spec_counters(snapshot)
    assert c == SpecCounters(4, 12, 5, [3, 2, 0])
    assert c - SpecCounters(1, 3, 1, [1, 0, 0]) == SpecCounters(3, 9, 4, [2, 2, 0])
    assert c.summary()["tau"] == 1 + 5 / 4
    assert read_spec_counters([]).summary()["tau"] is None


def test_module_imports_without_vllm():
    code = "import sys; import draftsmith.engines.vllm_serving; assert 'vllm' not in sys.modules, 'vllm was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@vllm_test
def test_engine_arguments_the_release_lacks_are_dropped_and_named(caplog):
    from draftsmith.targets import vllm_compat

    kwargs = {"model": "m", "per_request_spec_decode_metrics": "detailed", "language_model_only": True}
    with caplog.at_level("WARNING"):
        got = vllm_compat.engine_kwargs(kwargs)
    kept = per_request_records()
    assert ("per_request_spec_decode_metrics" in got) == kept and got["model"] == "m"
    assert ("per_request_spec_decode_metrics" in caplog.text) != kept
