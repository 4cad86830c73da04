"""Targets whose logits are not lm_head(final state): Granite divides them by logits_scaling, Gemma 2
caps them with a tanh, Cohere multiplies them by logit_scale. Training's teacher must give the
target's own logits, and a target that transforms them in a way target.json does not know must be
stopped before extraction, not trained against another distribution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    VaultGemmaConfig,
    VaultGemmaForCausalLM,
)

import tiny
from draftsmith.draft.config import Eagle3DraftConfig
from draftsmith.draft.model import Eagle3Draft
from draftsmith.errors import ExtractionError
from draftsmith.extract.hf_backend import HfBackend
from draftsmith.targets.inspect import write_target_json
from draftsmith.targets.logits import RULES
from draftsmith.train.objective import TTTObjective

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SIZES = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
FAMILIES = {
    "granite": (lambda: GraniteForCausalLM(GraniteConfig(**SIZES, logits_scaling=8.0)), {"scale": 0.125, "softcap": None}),
    # a cap well inside the spread weights' logits, so that it changes them
    "gemma2": (lambda: Gemma2ForCausalLM(Gemma2Config(**SIZES, final_logit_softcapping=2.0, sliding_window=16)),
               {"scale": 1.0, "softcap": 2.0}),
    "cohere": (lambda: CohereForCausalLM(CohereConfig(**SIZES, logit_scale=0.25)), {"scale": 0.25, "softcap": None}),
    "vaultgemma": (lambda: VaultGemmaForCausalLM(VaultGemmaConfig(**SIZES, final_logit_softcapping=2.0)),
                   {"scale": 1.0, "softcap": 2.0}),
    "llama": (lambda: LlamaForCausalLM(LlamaConfig(**SIZES)), {"scale": 1.0, "softcap": None}),
}


def _build(family: str, path: Path) -> Path:
    tiny.build_tokenizer(path)
    torch.manual_seed(0)
    model = FAMILIES[family][0]().eval()
    tiny._spread_weights(model)
    model.save_pretrained(path)
    return path


def _final_states_and_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the lm_head consumes, and the logits the model returns."""
    seen = {}
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    handle.remove()
    return seen["x"][0], logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_teacher_gives_the_targets_own_logits(family, tmp_path):
    folder = _build(family, tmp_path / family)
    info = write_target_json(tmp_path / "target.json", folder)
    assert info["logit_transform"] == FAMILIES[family][1]

    model = FAMILIES[family][0]()
    model.load_state_dict(type(model).from_pretrained(folder).state_dict())
    model.eval()
    final, logits = _final_states_and_logits(model, torch.tensor([[5, 17, 250, 3, 99, 41, 8, 300]]))
    head = model.get_output_embeddings().weight.detach()
    rows = torch.arange(0, 384, 3)  # a draft vocabulary: every third token
    config = Eagle3DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
                               head_dim=32, target_vocab_size=384, draft_vocab_size=len(rows), aux_layer_ids=[1, 2])
    objective = TTTObjective(Eagle3Draft(config), head, rows, ttt_steps=1, ttt_decay=1.0, attention="sdpa",
                             logit_transform=json.loads((tmp_path / "target.json").read_text())["logit_transform"])
    teacher, _, _, argmax, in_vocab = objective._teacher(final, torch.arange(final.shape[0]), exact=True)
    torch.testing.assert_close(teacher, logits[:, rows], rtol=1e-5, atol=1e-5)
    if family != "llama":  # the transform matters here: without it the teacher is another distribution
        assert not torch.allclose(final @ head[rows].T, logits[:, rows], atol=1e-3)
    # "is the target's argmax in the draft vocabulary" compares transformed logits on both sides
    assert in_vocab.tolist() == [bool((logits[i].argmax() % 3 == 0).item()) for i in range(len(logits))]


def test_a_transform_target_json_does_not_know_stops_extraction(tmp_path):
    folder = _build("granite", tmp_path / "granite")
    info = write_target_json(tmp_path / "target.json", folder)
    load = dict(layers_path=info["layers_path"], final_layer_id=info["final_layer_id"],
                capture_layer_ids=info["captured_layer_ids"], lm_head_path=info["lm_head_path"], device="cpu")
    sample = [[5, 17, 250, 3, 99, 41, 8, 300]]
    with HfBackend.load(folder, logit_transform=info["logit_transform"], **load) as backend:
        backend.capture(sample)  # target.json's rule: the teacher is the target's logits
    with HfBackend.load(folder, logit_transform={"scale": 1.0, "softcap": None}, **load) as backend:
        with pytest.raises(ExtractionError) as raised:
            backend.capture(sample)  # the first batch checks
    assert "logit_transform" in raised.value.where and "GraniteForCausalLM" in raised.value.what


# Families whose modeling code transforms the logits after its head but which are no decoder-only
# target: a diffusion LM and encoder-decoders.
NOT_TARGETS = {"diffusion_gemma", "t5gemma", "t5gemma2"}


def test_every_family_whose_head_transforms_its_logits_in_transformers_has_a_rule():
    """The table is read from transformers' modeling code; a family added there since (VaultGemma and
    Cohere Compass were) would train against logits its target never decodes from, and be refused
    only after its load. Each models/<family>/modeling_*.py that scales, divides or caps the logits
    right after its lm_head names the text model type that needs a rule."""
    import re

    import transformers

    transform = re.compile(r"logits\s*=\s*[^\n]*(softcap|logit_scale|logits_scaling|multiplier|\*\s*self\.|/\s*self\.|tanh)")
    missing = {}
    for folder in sorted((Path(transformers.__file__).parent / "models").iterdir()):
        if folder.name in NOT_TARGETS:
            continue
        code = "".join(f.read_text() for f in folder.glob("modeling_*.py"))
        if not any(transform.search(code[m.start():m.start() + 600]) for m in re.finditer(r"self\.lm_head\(", code)):
            continue
        types = {t for f in folder.glob("configuration_*.py")
                 for t in re.findall(r'^\s+model_type\s*=\s*"([\w-]+)"', f.read_text(), flags=re.M)}
        text_types = {t for t in types if t.endswith("_text")} or types
        if not text_types & set(RULES):
            missing[folder.name] = sorted(text_types)
    assert not missing, f"families that transform their logits with no rule in targets/logits.py: {missing}"
