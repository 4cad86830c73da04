"""The payoff estimate (draftsmith.payoff): the cost model's shapes against real models' parameter
counts, the expert count, and the two observations it must predict: n-gram-level acceptance slows
a Kimi-K2.5-shaped MoE target at TP=8 and batch 16; a good draft speeds up a dense 8B at batch 1."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, Qwen3MoeConfig

from draftsmith.errors import ConfigError, EvaluationError
from draftsmith.payoff import (
    DraftShape,
    PayoffSettings,
    estimate_payoff,
    expected_experts,
    extend_rates,
    speedups,
    target_shape,
)
from draftsmith.plots import plot_payoff
from tiny import KIMI_K25_TEXT_CONFIG

# n-gram-level acceptance (the demo's prompt-lookup baseline: τ 1.26 at k = 3), proposing on about
# half of the steps, as prompt lookup does on chat.
NGRAM_ACCEPTANCE = [0.12, 0.08, 0.06]
NGRAM_PROPOSALS = [0.5, 0.45, 0.4]
GOOD_DRAFT = [0.8, 0.6, 0.45]  # τ 2.85 at k = 3: a well-trained EAGLE-3 draft on chat
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, vocab_size=128256, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=14336)
# An EAGLE-3 draft of an 8B Llama: one decoder layer over 2·hidden inputs, the fc fusion of three
# layers, a 32k-token head.
LLAMA_8B_DRAFT = DraftShape(params=2 * 4096 * 4096 * 2 + 2 * 4096 * 1024 * 2 + 3 * 4096 * 14336
                            + 3 * 4096 * 4096 + 32000 * 4096, layers=1, kv_values_per_token=2 * 8 * 128,
                            kv_shards=8)


def _counted_params(config) -> int:
    """Parameters of the real model the cost model counts: all but the embedding and the norms."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for name, p in model.named_parameters() if p.dim() > 1 and "embed_tokens" not in name)


@pytest.mark.parametrize("config", [
    LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2),
    Qwen3MoeConfig(vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4,
                   num_experts_per_tok=2, mlp_only_layers=[0]),
    DeepseekV3Config(vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512,
                     q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
                     n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1),
], ids=["llama", "qwen3-moe", "deepseek-v3"])
def test_the_shape_counts_the_real_models_parameters(config):
    shape = target_shape(config.to_dict())
    assert shape.total_params == _counted_params(config)
    assert shape.is_moe == (config.model_type != "llama")


def test_expected_experts():
    assert expected_experts(384, 8, 1) == pytest.approx(8)
    assert expected_experts(384, 8, 16) == pytest.approx(384 * (1 - (1 - 8 / 384) ** 16))
    assert 100 < expected_experts(384, 8, 16) < 128  # 16 tokens share some experts
    assert expected_experts(384, 8, 10_000) == pytest.approx(384)
    assert expected_experts(0, 0, 16) == 0


def test_rates_beyond_the_measured_positions_keep_the_last_ratio():
    assert extend_rates([0.8, 0.4], 4) == pytest.approx([0.8, 0.4, 0.2, 0.1])
    assert extend_rates([0.5], 3) == pytest.approx([0.5, 0.25, 0.125])
    assert extend_rates([0.9, 0.6, 0.3], 2) == [0.9, 0.6]


@pytest.mark.parametrize("expert_bytes", [0.5, 2], ids=["int4 experts", "bf16 experts"])
def test_ngram_speculation_slows_a_kimi_k25_shaped_target_at_tp8_batch_16(expert_bytes):
    """The deployment's observation (9-26% slower): verifying k + 1 tokens of 16 sequences routes
    to about twice the experts, and τ ≈ 1.2 does not pay for reading them."""
    server = PayoffSettings(gpu="h200", expert_weight_bytes=expert_bytes, batch_sizes=(16,)).resolved(8)
    result = speedups(target_shape(KIMI_K25_TEXT_CONFIG), None, NGRAM_ACCEPTANCE, NGRAM_PROPOSALS, server)
    assert all(row[0] < 0.95 for row in result["speedup"]), result["speedup"]


def test_the_experts_are_what_makes_speculation_slower_there():
    """The same acceptance on a dense model of Kimi's active size speeds decoding up: the slowdown
    comes from the experts the extra tokens activate."""
    kimi = target_shape(KIMI_K25_TEXT_CONFIG)
    as_dense = target_shape({**KIMI_K25_TEXT_CONFIG, "n_routed_experts": 0,
                             "intermediate_size": KIMI_K25_TEXT_CONFIG["moe_intermediate_size"] * 9})
    assert as_dense.active_params == pytest.approx(kimi.active_params, rel=0.05)
    server = PayoffSettings(batch_sizes=(16,)).resolved(8)
    dense = speedups(as_dense, None, NGRAM_ACCEPTANCE, NGRAM_PROPOSALS, server)
    assert all(row[0] > 1 for row in dense["speedup"]), dense["speedup"]


def test_a_good_draft_speeds_up_a_dense_8b_target_at_batch_1():
    server = PayoffSettings(gpu="h100", batch_sizes=(1, 64)).resolved(1)
    result = speedups(target_shape(LLAMA_8B), LLAMA_8B_DRAFT, GOOD_DRAFT, None, server)
    at_k3 = result["speedup"][result_k(server, 3)]
    assert at_k3[0] > 1.8
    assert result["tau"][result_k(server, 3)] == pytest.approx(1 + sum(GOOD_DRAFT))
    # the draft's own forwards cost: a draft that proposes nothing acceptable is slower than none
    useless = speedups(target_shape(LLAMA_8B), LLAMA_8B_DRAFT, [0.0, 0.0, 0.0], None, server)
    assert all(s < 1 for row in useless["speedup"] for s in row)


def result_k(server: PayoffSettings, k: int) -> int:
    return server.k.index(k)


def test_tensor_parallel_all_reduces_cost_time():
    shape = target_shape(LLAMA_8B)
    fast = speedups(shape, None, [0.0], None, PayoffSettings(allreduce_latency_us=0, batch_sizes=(1,)).resolved(8))
    slow = speedups(shape, None, [0.0], None, PayoffSettings(allreduce_latency_us=50, batch_sizes=(1,)).resolved(8))
    assert slow["verify_step_ms"][0][0] > fast["verify_step_ms"][0][0] + 2 * 32 * 0.05 * 0.99


def test_a_bad_payoff_setting_names_its_key():
    with pytest.raises(ConfigError, match="config key eval.payoff.efficiency"):
        PayoffSettings(efficiency=1.5)


def test_estimate_payoff_writes_json_and_plot(tmp_path):
    config = Qwen3MoeConfig(vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            num_experts=4, num_experts_per_tok=2)
    (tmp_path / "target.json").write_text(json.dumps({"text_config": config.to_dict()}))
    draft = tmp_path / "draft"
    draft.mkdir()
    save_file({"layers.0.self_attn.q_proj.weight": torch.zeros(64, 128), "fc.weight": torch.zeros(64, 192),
               "embed_tokens.weight": torch.zeros(384, 64), "d2t": torch.zeros(32, dtype=torch.long)},
              draft / "model.safetensors")
    (draft / "config.json").write_text(json.dumps({"transformer_layer_config": {
        "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}}))
    acceptance = {"acceptance_rate_by_position": [0.6, 0.4, 0.2], "proposal_rate_by_position": [1, 1, 1],
                  "baseline": {"acceptance_rate_by_position": [0.1, 0.05, 0.0]},
                  "sources": {"gsm8k": {"acceptance_rate_by_position": [0.7, 0.5, 0.3]}}}
    (tmp_path / "acceptance.json").write_text(json.dumps(acceptance))
    result = estimate_payoff(tmp_path / "acceptance.json", tmp_path / "target.json", draft,
                             tmp_path / "payoff.json",
                             PayoffSettings.from_config({"eval": {"payoff": {"batch_sizes": [1, 16]}},
                                                         "extraction": {"tensor_parallel_size": 2}}))
    plot_payoff(tmp_path / "payoff.json", tmp_path / "payoff.png")
    assert json.loads((tmp_path / "payoff.json").read_text()) == json.loads(json.dumps(result))
    assert result["draft_shape"]["params"] == 64 * 128 + 64 * 192  # the embedding and d2t are not read
    assert result["server"]["tensor_parallel_size"] == 2 and result["server"]["memory_bandwidth_gbs"] == 4800
    assert result["target"]["kind"] == "moe" and result["k"] == [1, 2, 3, 4, 5]
    assert [len(row) for row in result["draft"]["speedup"]] == [2] * 5
    assert result["sources"]["gsm8k"]["tau"][2] == pytest.approx(2.5)
    assert (tmp_path / "payoff.png").stat().st_size > 0


def _payoff_inputs(tmp_path, acceptance: dict) -> tuple:
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1)
    (tmp_path / "target.json").write_text(json.dumps({"text_config": config.to_dict()}))
    draft = tmp_path / "draft"
    draft.mkdir()
    save_file({"layers.0.self_attn.q_proj.weight": torch.zeros(64, 128), "fc.weight": torch.zeros(64, 192)},
              draft / "model.safetensors")
    (draft / "config.json").write_text(json.dumps({"transformer_layer_config": {"hidden_size": 64}}))
    (tmp_path / "acceptance.json").write_text(json.dumps(acceptance))
    return tmp_path / "acceptance.json", tmp_path / "target.json", draft


def test_a_best_k_beyond_the_measured_positions_is_called_extrapolated(tmp_path, caplog):
    # Prompt lookup that accepts nearly everything it proposes on a dense target at batch 1: k = 5 is
    # best, but evaluation measured positions 1..3 only (eval.k: 3). A poor draft's best is k = 1.
    acceptance = {"acceptance_rate_by_position": [0.05, 0.01, 0.0],
                  "baseline": {"acceptance_rate_by_position": [0.95, 0.9, 0.86]}}
    paths = _payoff_inputs(tmp_path, acceptance)
    with caplog.at_level("INFO", logger="draftsmith.payoff"):
        result = estimate_payoff(*paths, tmp_path / "payoff.json", PayoffSettings(batch_sizes=(1,)))
    written = json.loads((tmp_path / "payoff.json").read_text())
    for name in ("draft", "baseline"):
        assert written[name]["measured_positions"] == 3
        assert written[name]["acceptance_at_k"] == ["measured"] * 3 + ["extrapolated"] * 2  # k = 1..5
    best = result["baseline"]["best"]
    assert best == [{"batch": 1, "k": 5, "speedup": result["baseline"]["speedup"][4][0], "acceptance": "extrapolated"}]
    assert result["draft"]["best"][0]["k"] == 1 and result["draft"]["best"][0]["acceptance"] == "measured"
    lines = {r.getMessage().split(":")[0]: r.getMessage() for r in caplog.records}
    assert "B=1: k=5 (extrapolated beyond the measured k=1..3) " in lines["baseline"]
    assert "extrapolated" not in lines["draft"] and "B=1: k=1 " in lines["draft"]


def test_acceptance_that_measured_no_step_is_not_estimated(tmp_path, caplog):
    """eval.max_new_tokens: 1 (or a target that stops at once) leaves acceptance.json's rates null:
    not a measured zero, so payoff.json says it estimated nothing, and the plot says so too."""
    from draftsmith.plots import plot_payoff

    acceptance = {"acceptance_rate_by_position": [None, None, None], "proposal_rate_by_position": [None] * 3,
                  "baseline": {"acceptance_rate_by_position": [None, None, None]}}
    paths = _payoff_inputs(tmp_path, acceptance)
    with caplog.at_level("INFO", logger="draftsmith.payoff"):
        result = estimate_payoff(*paths, tmp_path / "payoff.json", PayoffSettings(batch_sizes=(1,)))
    for name in ("draft", "baseline"):
        assert result[name]["speedup"] is None and result[name]["best"] is None and result[name]["tau"] is None
        assert "no verification step" in result[name]["not_measured"]
    assert all("not estimated" in r.getMessage() for r in caplog.records if r.getMessage().startswith(("draft", "baseline")))
    assert plot_payoff(tmp_path / "payoff.json", tmp_path / "payoff.png").stat().st_size > 0

    # no rates at all is a damaged acceptance.json, not a run that measured nothing
    empty = {"acceptance_rate_by_position": [], "baseline": {"acceptance_rate_by_position": []}}
    (tmp_path / "empty").mkdir()
    with pytest.raises(EvaluationError, match="holds no acceptance by position"):
        estimate_payoff(*_payoff_inputs(tmp_path / "empty", empty), tmp_path / "empty.json", PayoffSettings(batch_sizes=(1,)))


@pytest.mark.slow
def test_the_workflow_evaluates_each_prompt_set_and_estimates_the_payoff(tmp_path):
    """Real snakemake on the tiny target: an eval.sources set goes through prepare_eval_prompts into
    acceptance.json, the plots and payoff.json; caching follows the source file and eval.payoff."""
    import tiny
    from workflow_helpers import planned_rules, snakemake, tiny_workflow, write_config

    workdir, config = tiny_workflow(tmp_path, max_heldout=2)
    source = tiny.write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": f"What is {i} + 1?"} for i in range(3)])
    config.update(vocab={"draft_vocab_size": 64},
                  train={"epochs": 1, "max_steps": 3, "batch_tokens": 512, "warmup_steps": 1},
                  eval={"max_prompts": 2, "max_new_tokens": 6, "k_sweep": [1, 2], "k": 2,
                        "sources": [{"name": "gsm8k", "path": str(source)}], "payoff": {"batch_sizes": [1, 16]}})
    configfile = write_config(workdir, config)
    snakemake(workdir, configfile=configfile)
    results = workdir / "results" / "t"
    acceptance = json.loads((results / "eval" / "acceptance.json").read_text())
    assert acceptance["sources"]["gsm8k"]["num_prompts"] == 2  # eval.max_prompts of the three
    payoff = json.loads((results / "eval" / "payoff.json").read_text())
    assert payoff["batch_sizes"] == [1, 16] and set(payoff["sources"]) == {"gsm8k"}
    assert payoff["draft"]["tau"][1] == pytest.approx(1 + sum(acceptance["acceptance_rate_by_position"]))
    for png in ("prompt_sets.png", "payoff.png"):
        assert (results / "eval" / png).stat().st_size > 0

    changed = snakemake(workdir, "-n", "--config", "eval={payoff: {gpu: h100}}", configfile=configfile)
    assert planned_rules(changed) == {"estimate_payoff"}
    evaluation = {"prepare_eval_prompts", "evaluate_draft", "plot_evaluation", "estimate_payoff"}
    # the prompt sets' code is no part of prepare_dataset's: the data and the draft stay
    code = workdir / "draftsmith" / "eval_prompts.py"
    original = code.read_text()
    code.write_text(original + "\n_EDIT = 1\n")
    assert planned_rules(snakemake(workdir, "-n", configfile=configfile)) == evaluation
    code.write_text(original)
    tiny.write_jsonl(source, [{"question": f"What is {i} + 2?"} for i in range(3)])
    edited = snakemake(workdir, "-n", configfile=configfile)
    assert planned_rules(edited) == evaluation
