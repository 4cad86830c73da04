"""Quantized targets sized as stored: the quantization read from wherever the config keeps it,
reported in target.json, and used by weight_bytes and the memory checks (GPU and host)."""

import json

import pytest
import torch

import tiny
from draftsmith.errors import ConfigError, TargetError
from draftsmith.targets.inspect import hf_stages, inspect_target, weight_bytes, write_target_json
from draftsmith.targets.quantization import read_schemes

# Kimi-K2.5's INT4 scheme (compressed-tensors, pack-quantized; in text_config, as Kimi ships it):
# the routed experts in 4 bits with a bf16 scale per 32 values, attention, shared experts, the
# dense layers' MLP and the head left in bf16.
KIMI_INT4 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
        "num_bits": 4, "type": "int", "group_size": 32, "strategy": "group", "symmetric": True}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}
DEEPSEEK_V3 = dict(tiny.KIMI_K25_TEXT_CONFIG, vocab_size=129280, num_attention_heads=128, num_key_value_heads=128,
                   n_routed_experts=256, n_group=8, topk_group=4, first_k_dense_replace=3)
TOLERANCE = 0.005  # the hand computations below leave out only blocks cut at a matrix's edge


def _kimi(path, quantization):
    folder = tiny.build_kimi_k25_config(path)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _deepseek_v3(path, quantization=None):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**DEEPSEEK_V3)
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(path)
    tiny.build_tokenizer(path)
    if quantization is not None:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "quantization_config": quantization}))
    return path


def _deepseek_linear_parameters(c: dict) -> tuple[int, int]:
    """By hand, from the config: (parameters of the routed experts, of every Linear layer and expert)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    attention = (h * c["q_lora_rank"] + c["q_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
                 + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
                 + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * h)
    moe_layers = c["num_hidden_layers"] - c["first_k_dense_replace"]
    expert = 3 * h * c["moe_intermediate_size"]
    routed = moe_layers * c["n_routed_experts"] * expert
    linear = (c["num_hidden_layers"] * attention + c["first_k_dense_replace"] * 3 * h * c["intermediate_size"]
              + moe_layers * c["n_shared_experts"] * expert + routed)
    return routed, linear


def test_kimi_int4_in_text_config_is_sized_as_stored(tmp_path):
    info = inspect_target(_kimi(tmp_path / "kimi", KIMI_INT4), trust_remote_code=True)
    q = info["quantization"]
    assert (q["method"], q["bits"], q["config_key"]) == ("compressed-tensors", 4, "text_config.quantization_config")
    assert {"embeddings", "lm_head", "re:.*self_attn.*"} <= set(q["unquantized"])
    assert "everything outside model.language_model" in q["unquantized"]  # the vision tower stays bf16
    routed, _ = _deepseek_linear_parameters(tiny.KIMI_K25_TEXT_CONFIG)
    assert q["quantized_parameters"] == routed  # the routed experts alone
    by_hand = routed * (4 / 8 + 2 / 32) + (info["num_parameters"] - routed) * 2  # int4 + a bf16 scale per 32
    assert weight_bytes(info) == pytest.approx(by_hand, rel=TOLERANCE)
    assert 590e9 < weight_bytes(info) < 600e9  # bf16 would be 2,054 GB
    assert weight_bytes(info) < info["num_parameters"] * 2 / 3


def test_deepseek_v3_fp8_at_the_top_level_is_sized_as_stored(tmp_path):
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    info = inspect_target(_deepseek_v3(tmp_path / "v3", fp8))
    q = info["quantization"]
    assert (q["method"], q["bits"], q["config_key"]) == ("fp8", 8, "quantization_config")
    _, linear = _deepseek_linear_parameters(DEEPSEEK_V3)
    assert q["quantized_parameters"] == linear  # every Linear and expert; embeddings, head, norms, router not
    by_hand = linear * (1 + 4 / (128 * 128)) + (info["num_parameters"] - linear) * 2  # fp8 + a float32 scale per block
    assert weight_bytes(info) == pytest.approx(by_hand, rel=TOLERANCE)
    assert 670e9 < weight_bytes(info) < 690e9  # 671B parameters


def test_an_unquantized_target_is_sized_as_before(tmp_path):
    info = inspect_target(_deepseek_v3(tmp_path / "v3"))
    assert info["quantization"] is None
    assert weight_bytes(info) == info["num_parameters"] * 2 and weight_bytes(info, "float32") == info["num_parameters"] * 4


def test_an_unknown_method_is_reported_never_guessed(tmp_path, caplog):
    info = inspect_target(_deepseek_v3(tmp_path / "v3", {"quant_method": "secret-sauce"}))
    assert info["quantization"]["method"] == "secret-sauce" and info["quantization"]["bits"] is None
    assert weight_bytes(info) == info["num_parameters"] * 2  # counted unquantized: an upper bound
    assert "'secret-sauce'" in caplog.text and "no memory check refuses it" in caplog.text


@pytest.mark.parametrize("method, config, bits, per_value", [
    ("awq", {"bits": 4, "group_size": 128, "zero_point": True}, 4, 0.5 + (2 + 0.5) / 128),
    ("gptq", {"bits": 8, "group_size": -1, "sym": True}, 8, 1.0),  # per channel: a scale per row of 4096
    ("bitsandbytes", {"load_in_4bit": True}, 4, 0.5 + 4 / 64),
    ("mxfp4", {"modules_to_not_convert": ["model.layers.*.self_attn"]}, 4, 0.5 + 1 / 32),
    ("modelopt", {"quant_algo": "NVFP4"}, 4, 0.5 + 1 / 16),
])
def test_each_method_is_read_by_its_bits(method, config, bits, per_value):
    (scheme,) = read_schemes(method, config)
    assert scheme.bits == bits
    assert scheme.stored_bytes((4096, 4096)) / 4096**2 == pytest.approx(per_value, rel=0.01)


def test_the_cpu_path_refuses_a_target_larger_than_the_machine(tmp_path, monkeypatch):
    folder = _kimi(tmp_path / "kimi", KIMI_INT4)
    config = {"device": "cpu", "regenerate": {"enabled": False, "backend": "hf"},
              "extraction": {"backend": "hf", "tensor_parallel_size": 1, "device_map": None}, "eval": {"backend": "vllm"}}
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr("draftsmith.placement.host_memory_bytes", lambda: 24 * 2**30)
    with pytest.raises(TargetError) as e:
        write_target_json(tmp_path / "target.json", folder, trust_remote_code=True,
                          hf_stages=hf_stages(config, gpu=False))
    assert "with device: cpu, extract_hidden_states loads it with transformers into this machine's memory, 26 GB" \
        in e.value.what and "compressed-tensors" in e.value.what
    assert "extraction.backend" in e.value.where and "device: cuda" in e.value.fix
    assert not (tmp_path / "target.json").exists()
    monkeypatch.setattr("draftsmith.placement.host_memory_bytes", lambda: 10**12)  # float32 on the CPU: ~620 GB
    write_target_json(tmp_path / "target.json", folder, trust_remote_code=True, hf_stages=hf_stages(config, gpu=False))


def test_device_cuda_without_a_gpu_is_refused_before_any_job(monkeypatch):
    config = {"device": "cuda", "regenerate": {"enabled": False, "backend": "hf"},
              "extraction": {"backend": "vllm", "tensor_parallel_size": 8, "device_map": None}, "eval": {"backend": "vllm"}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigError) as e:
        hf_stages(config, gpu=True)
    assert e.value.where == "config key device" and "set device: cpu" in e.value.fix
    assert "DRAFTSMITH_DEVICES" in e.value.fix
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # the GPU jobs run on other nodes than this preflight job
    assert hf_stages(config, gpu=True) == {}
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert hf_stages(config, gpu=True) == {}
