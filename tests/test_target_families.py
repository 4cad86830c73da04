"""Targets outside the Llama family, through every stage that reads them before the draft exists:
preflight (inspect_target, check_setup), extraction on the hf backend, and training's weight
loading. GPT-2 names its sizes its own way (n_embd), GPT-NeoX stores its lm_head as embed_out,
OPT-350m projects its embeddings to another width."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, OPTConfig, OPTForCausalLM

import tiny
from draftsmith.engines.weights import load_embedding_and_head
from draftsmith.errors import TargetError
from draftsmith.extract.hf_backend import HfBackend
from draftsmith.preflight import PreflightSettings, check_setup
from draftsmith.targets.inspect import write_target_json

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

NO_SPECIAL_IDS = dict(bos_token_id=None, eos_token_id=None)
CONFIGS = {
    # hidden_size, num_hidden_layers, ... live in n_embd, n_layer, n_head, n_positions; tied head
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=384, n_embd=64, n_layer=6, n_head=2, n_positions=512,
                                               **NO_SPECIAL_IDS)),
    # untied: its checkpoint calls the lm_head embed_out.weight
    "gpt_neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False, **NO_SPECIAL_IDS)),
    # OPT-350m's shape: 32-wide embeddings projected to 64-wide hidden states and back
    "opt_350m": lambda: OPTForCausalLM(OPTConfig(
        vocab_size=384, hidden_size=64, word_embed_proj_dim=32, ffn_dim=128, num_hidden_layers=6,
        num_attention_heads=2, max_position_embeddings=512, pad_token_id=1, **NO_SPECIAL_IDS)),
}


def _build(family: str, path: Path) -> Path:
    tiny.build_tokenizer(path)
    torch.manual_seed(0)
    model = CONFIGS[family]().eval()
    tiny._spread_weights(model)
    model.save_pretrained(path)
    return path


def _check_setup(folder: Path, tmp_path: Path) -> dict:
    """check_setup as the workflow runs it: the fit checks on, which read the target's sizes."""
    chats = [{"messages": [{"role": "user", "content": f"Hello {i}"}, {"role": "assistant", "content": f"Fine {i}."}]}
             for i in range(4)]
    config = {"device": "cpu", "data": {"max_seq_len": 64}, "vocab": {"draft_vocab_size": 100},
              "draft": {"num_layers": 1}, "train": {"batch_tokens": 1024, "ttt_steps": 3},
              "eval": {"max_new_tokens": 48}, "regenerate": {"enabled": False, "max_new_tokens": 48}}
    with mock.patch.dict(os.environ):
        os.environ.pop("SLURM_JOB_ID", None)
        return check_setup(folder, [tiny.write_jsonl(tmp_path / "chats.jsonl", chats)], tmp_path / "preflight.json",
                           PreflightSettings.from_config(config))


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_preflight_extraction_and_weight_loading(family, tmp_path):
    folder = _build(family, tmp_path / family)
    info = write_target_json(tmp_path / "target.json", folder)
    assert info["hidden_size"] == 64 and info["text_config"]["num_attention_heads"] == 2
    report = _check_setup(folder, tmp_path)
    assert report["context"]["context"] == 512  # GPT-2's n_positions, under its standard name

    # extraction: the hooked states are transformers' own hidden states (the final one after the norm)
    sequences = [[5, 17, 250, 3, 99, 41, 8], [300, 2, 2, 61]]
    with HfBackend.load(folder, layers_path=info["layers_path"], final_layer_id=info["final_layer_id"],
                        capture_layer_ids=info["captured_layer_ids"], lm_head_path=info["lm_head_path"],
                        device="cpu") as backend:
        captured = backend.capture(sequences)
        model = backend.model
        for seq, states in zip(sequences, captured):
            with torch.inference_mode():
                reference = model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
            assert sorted(states) == info["captured_layer_ids"]
            for layer_id, tensor in states.items():
                torch.testing.assert_close(tensor, reference[layer_id][0], rtol=1e-5, atol=1e-4)

        # training's weight loading: the very matrices the model computes with
        embed, head = load_embedding_and_head(tmp_path / "target.json")
        assert torch.equal(embed, model.get_input_embeddings().weight.detach())
        assert torch.equal(head, model.get_output_embeddings().weight.detach())
        assert info["tie_word_embeddings"] == (family == "gpt2")


def test_a_target_that_projects_its_embeddings_is_refused_at_preflight(tmp_path):
    folder = _build("opt_350m", tmp_path / "opt")
    with pytest.raises(TargetError) as error:
        write_target_json(tmp_path / "target.json", folder)
    e = error.value
    assert "token embedding and lm_head are 32 wide, its hidden states 64" in e.what
    assert e.where == f"{folder.resolve()}/config.json" and "word_embed_proj_dim" in e.fix
    assert not (tmp_path / "target.json").exists()
