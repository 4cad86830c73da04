"""Preflight on meta-device models: plain and wrapped targets, and every stop it must make."""

import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

import tiny
from draftsmith.engines.weights import load_embedding_and_head
from draftsmith.errors import TargetError
from draftsmith.targets.inspect import inspect_target


def _no_weights_read(monkeypatch):
    """Fail the test if anything opens a safetensors file."""
    import safetensors

    def refuse(*args, **kwargs):
        raise AssertionError("preflight read weights")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr("safetensors.torch.load_file", refuse)


def test_plain_llama(llama_dir, monkeypatch):
    _no_weights_read(monkeypatch)
    info = inspect_target(llama_dir)
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["layers_path"] == "model.layers"
    assert info["wrapped"] is False
    assert (info["num_hidden_layers"], info["hidden_size"], info["vocab_size"]) == (8, 64, 384)
    assert info["aux_layer_ids"] == [2, 4, 5]  # [2, L//2, L-3]
    assert info["final_layer_id"] == 8
    assert info["captured_layer_ids"] == [2, 4, 5, 8]
    assert info["has_chat_template"] is True
    assert info["backends"]["hf"]["supported"] is True
    json.dumps(info)  # target.json must serialise


def test_a_second_preflight_takes_the_description_until_a_file_or_setting_changes(tmp_path, monkeypatch):
    """The meta build runs once per target folder, settings and code; an edited config, a new setting
    or a patched inspection is described anew, never answered from the memo."""
    import shutil

    from draftsmith.targets import inspect, inspection_memo

    folder = shutil.copytree(tiny.build_llama(tmp_path / "made"), tmp_path / "llama")
    builds = []
    real_build = inspect.build_meta_model
    monkeypatch.setattr(inspect, "build_meta_model", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    first = inspect_target(folder)
    again = inspect_target(folder)
    def as_written(info: dict) -> str:  # as target.json holds it, the timing aside
        return json.dumps({**info, "inspect_seconds": 0}, sort_keys=True)

    assert len(builds) == 1 and as_written(again) == as_written(first)
    assert inspect_target(folder, aux_layer_ids=[1, 3])["aux_layer_ids"] == [1, 3] and len(builds) == 2
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6}))
    assert inspect_target(folder)["num_hidden_layers"] == 6 and len(builds) == 3
    # a patch of the inspection's code: its fingerprint is part of the key
    monkeypatch.setattr("draftsmith.fingerprint.code_fingerprint", lambda *modules: "patched")
    inspect_target(folder)
    assert len(builds) == 4
    # a description kept but damaged is made again
    for kept in (inspection_memo.cache_dir() / "targets").iterdir():
        kept.write_text("{")
    inspect_target(folder)
    assert len(builds) == 5
    # a cache that cannot be written keeps nothing and stops nothing
    monkeypatch.setenv(inspection_memo.CACHE_ENV, str(folder / "config.json"))
    inspect_target(folder)
    inspect_target(folder)
    assert len(builds) == 7


def test_nothing_is_kept_where_the_key_cannot_see_the_code(tmp_path, monkeypatch):
    """Remote code from another repository, or transformers installed editable (its code changes
    under one release): every preflight inspects."""
    from draftsmith.targets import inspection_memo

    folder = tiny.build_llama(tmp_path / "llama")
    assert inspection_memo.inspection_key(folder, {}) is not None
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "org/repo--cfg.Config"}}))
    assert inspection_memo.inspection_key(folder, {}) is None
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(inspection_memo, "_editable", lambda name: name == "transformers")
    assert inspection_memo.inspection_key(folder, {}) is None


def test_wrapped_multimodal_model_resolves_to_its_language_model(llava_dir, monkeypatch):
    _no_weights_read(monkeypatch)
    info = inspect_target(llava_dir)
    assert info["architecture"] == "LlavaForConditionalGeneration"
    assert info["wrapped"] is True
    assert info["text_model_type"] == "llama"
    # The resolved path must name the text decoder's layers, not the vision tower's.
    model = LlavaForConditionalGeneration.from_pretrained(llava_dir)
    layers = model.get_submodule(info["layers_path"])
    assert layers is model.model.language_model.layers
    assert info["num_hidden_layers"] == len(layers) == 8


def test_embedding_and_head_come_from_the_checkpoint_through_the_wrapper(llava_dir, tmp_path):
    info = inspect_target(llava_dir)
    (tmp_path / "target.json").write_text(json.dumps(info))
    embed, head = load_embedding_and_head(tmp_path / "target.json")
    model = LlavaForConditionalGeneration.from_pretrained(llava_dir)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)


def test_tied_embeddings(tmp_path):
    folder = tiny.build_llama(tmp_path / "tied", tie_word_embeddings=True)
    info = inspect_target(folder)
    assert info["tie_word_embeddings"] is True
    (tmp_path / "target.json").write_text(json.dumps(info))
    embed, head = load_embedding_and_head(tmp_path / "target.json")
    assert torch.equal(embed, AutoModelForCausalLM.from_pretrained(folder).lm_head.weight)
    assert head is embed


def test_meta_build_of_a_large_model_takes_seconds(tmp_path):
    # A 70B-class shape (80 layers, hidden 8192): building real weights would need 280 GB.
    folder = tmp_path / "big"
    tiny.build_tokenizer(folder)
    config = tiny.llama_config(num_layers=80, hidden_size=8192, intermediate_size=28672,
                               num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256)
    config.save_pretrained(folder)
    started = time.perf_counter()
    info = inspect_target(folder)
    assert time.perf_counter() - started < 10
    assert info["num_parameters"] > 60e9
    assert info["aux_layer_ids"] == [2, 40, 77]


@pytest.mark.parametrize(
    "aux, message",
    [([2, 8], r"aux layer ids \[8\] are out of range"), ([2, 2, 3], "repeat a layer")],
)
def test_bad_layer_ids(llama_dir, aux, message):
    with pytest.raises(TargetError, match=message):
        inspect_target(llama_dir, aux_layer_ids=aux)


def test_missing_config(tmp_path):
    with pytest.raises(TargetError, match="no config.json") as info:
        inspect_target(tmp_path)
    assert "fix:" in str(info.value)


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(TargetError, match="config.json is not valid JSON"):
        inspect_target(tmp_path)


def test_tokenizer_without_chat_template(tmp_path):
    folder = tiny.build_llama(tmp_path / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(TargetError, match="no chat template"):
        inspect_target(folder)


def test_missing_tokenizer(tmp_path):
    folder = tiny.build_llama(tmp_path / "m", tokenizer_template=None)
    with pytest.raises(TargetError, match="tokenizer"):
        inspect_target(folder)


def test_tokenizer_of_another_model(tmp_path):
    folder = tiny.build_llama(tmp_path / "m", vocab_size=100)  # the tokenizer has 384 tokens
    with pytest.raises(TargetError, match="different models"):
        inspect_target(folder)


def test_remote_code_is_refused_unless_enabled(tmp_path):
    folder = tiny.build_llama(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="my_custom_lm", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetError, match="configuration_custom.py") as info:
        inspect_target(folder)
    assert "trust_remote_code: true" in str(info.value)


@pytest.mark.parametrize("layers, ids", [
    (2, [1]), (3, [1, 2]),  # fewer than three decoder-layer outputs exist: those, not the embeddings (id 0)
    (4, [1, 2, 3]), (5, [1, 2, 4]), (6, [1, 3, 5]),  # [2, L//2, L-3] collapses: three spread over 1..L-1
    (7, [2, 3, 4]), (8, [2, 4, 5]), (61, [2, 30, 58]), (80, [2, 40, 77]),  # EAGLE-3's [2, L//2, L-3]
])
def test_default_aux_layers_are_distinct_decoder_outputs(layers, ids):
    from draftsmith.draft.config import Eagle3DraftConfig
    from draftsmith.targets.inspect import default_aux_layer_ids

    assert default_aux_layer_ids(layers) == ids
    # the draft's config takes them (distinct, ascending) before the final state L
    target = {"hidden_size": 64, "vocab_size": 384, "aux_layer_ids": ids, "final_layer_id": layers,
              "text_config": {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}}
    assert Eagle3DraftConfig.from_target(target, draft_vocab_size=32).num_aux == len(ids)


def test_default_aux_layers_on_every_depth():
    from draftsmith.targets.inspect import default_aux_layer_ids

    assert default_aux_layer_ids(1) == [0]  # a one-layer target has nothing but the embeddings' output
    for layers in range(2, 200):
        ids = default_aux_layer_ids(layers)
        assert ids == sorted(set(ids)) and len(ids) == min(3, layers - 1) and 1 <= ids[0] and ids[-1] < layers


def test_a_float8_checkpoint_config_passes_preflight(tmp_path, monkeypatch):
    # FP8 checkpoints name a dtype torch cannot make the default: the meta model is built in bfloat16.
    folder = tiny.build_llama(tmp_path / "fp8", num_layers=5)
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float8_e4m3fn"
    (folder / "config.json").write_text(json.dumps(config))
    _no_weights_read(monkeypatch)
    info = inspect_target(folder)
    assert info["torch_dtype"] == "float8_e4m3fn" and info["aux_layer_ids"] == [1, 2, 4]


def test_hf_paths_refuse_a_target_that_fits_no_single_device(monkeypatch):
    from draftsmith.targets.inspect import check_fits_devices, weight_bytes

    kimi = {"num_parameters": 1_030_000_000_000}
    assert weight_bytes(kimi, "auto") == weight_bytes(kimi, "bfloat16") == 2_060_000_000_000
    with pytest.raises(TargetError) as e:
        check_fits_devices(kimi, {"regenerate_responses": 1, "evaluate_draft": 1}, dtype="bfloat16",
                           device_bytes=141 * 10**9)
    message = str(e.value)
    assert "2,060 GB in bfloat16" in message and "1,030.0B parameters" in message
    assert "set regenerate.backend: vllm" in message and "set eval.backend: vllm" in message
    # extraction with device_map auto spreads the weights over its GPUs
    check_fits_devices({"num_parameters": 100 * 10**9}, {"extract_hidden_states": 2}, device_bytes=141 * 10**9)
    with pytest.raises(TargetError, match="extraction.backend: vllm"):
        check_fits_devices({"num_parameters": 100 * 10**9}, {"extract_hidden_states": 1}, device_bytes=141 * 10**9)
    check_fits_devices(kimi, {})  # every stage in vLLM: nothing to refuse
    # no GPU in sight (a login node): only what fits no GPU made is refused
    monkeypatch.setattr("draftsmith.targets.inspect.device_memory_bytes", lambda: None)
    check_fits_devices({"num_parameters": 100 * 10**9}, {"evaluate_draft": 1})
    with pytest.raises(TargetError, match="the largest GPU made"):
        check_fits_devices(kimi, {"evaluate_draft": 1})


def test_the_hf_stages_follow_the_backends(monkeypatch):
    from draftsmith.targets.inspect import hf_stages

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = {"device": "cuda", "regenerate": {"enabled": True, "backend": "hf"},
              "extraction": {"backend": "hf", "tensor_parallel_size": 2, "device_map": "auto"},
              "eval": {"backend": "hf"}}
    assert hf_stages(config, gpu=True) == {"regenerate_responses": 1, "extract_hidden_states": 2, "evaluate_draft": 1}
    # on the CPU each holds the target in host memory
    assert hf_stages(config, gpu=False) == {"regenerate_responses": 0, "extract_hidden_states": 0, "evaluate_draft": 0}
    config["regenerate"]["backend"] = config["extraction"]["backend"] = config["eval"]["backend"] = "vllm"
    assert hf_stages(config, gpu=True) == {}


def test_a_refused_target_leaves_what_was_learned_beside_target_json(llama_dir, tmp_path, monkeypatch):
    """A target this machine cannot hold: target.json is not written (Snakemake would delete it anyway),
    target.refused.json says what preflight learned and the error says where it is; a later pass
    removes it."""
    from draftsmith.targets.inspect import write_target_json

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr("draftsmith.placement.host_memory_bytes", lambda: 10**6)  # a 1 MB machine
    out = tmp_path / "results" / "target.json"
    with pytest.raises(TargetError) as error:
        write_target_json(out, llama_dir, hf_stages={"extract_hidden_states": 0})
    refused = tmp_path / "results" / "target.refused.json"
    assert f"What the preflight learned of the target (layers, quantization, weight bytes) is in {refused}" \
        in error.value.what
    assert "into this machine's memory" in error.value.what and error.value.where and error.value.fix
    assert not out.exists()
    learned = json.loads(refused.read_text())
    assert learned["num_hidden_layers"] == 8 and learned["quantization"] is None and learned["weight_bytes"] > 0
    assert learned["refused"]["where"] == error.value.where and "into this machine's memory" in learned["refused"]["what"]

    monkeypatch.setattr("draftsmith.placement.host_memory_bytes", lambda: 10**12)
    write_target_json(out, llama_dir, hf_stages={"extract_hidden_states": 0})
    assert out.exists() and not refused.exists()
