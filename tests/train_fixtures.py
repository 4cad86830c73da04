"""Small real training inputs: a tiny random-init target, its hidden states in the shard store,
its target.json and a draft-vocabulary mapping, built the way the workflow's stages build them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from draftsmith.hidden_states import PartStore, merge_parts
from draftsmith.targets.inspect import write_target_json
from draftsmith.vocab import mapping_tensors
from tests.tiny import build_llama


def random_samples(n: int, seed: int, vocab: int = 384, min_len: int = 6, max_len: int = 40):
    """Token rows with a prompt (loss 0) then a reply (loss 1); the reply repeats a short motif so
    a draft can learn something within a few steps."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(1, max(2, length // 3)))
        motif = rng.integers(0, vocab, size=int(rng.integers(2, 5)))
        ids = np.concatenate([rng.integers(0, vocab, size=prompt), np.resize(motif, length - prompt)])
        rows.append((f"s{i}", ids.tolist(), [0] * prompt + [1] * (length - prompt)))
    return rows


def build_training_inputs(root: str | Path, *, num_samples: int = 24, samples_per_shard: int = 8,
                          draft_vocab_size: int = 200, seed: int = 0, dtype: str = "float32",
                          num_layers: int = 4) -> dict[str, Path]:
    """target/, target.json, hidden_states/index.json and vocab/mapping.safetensors under ``root``."""
    from transformers import LlamaForCausalLM

    root = Path(root)
    model_path = build_llama(root / "target", num_layers=num_layers, seed=seed)
    target = write_target_json(root / "target.json", model_path)
    model = LlamaForCausalLM.from_pretrained(model_path).eval()
    layer_ids = [*target["aux_layer_ids"], target["final_layer_id"]]
    store_root = root / "hidden_states"
    store = PartStore(store_root, 0, fingerprint="test", dtype=dtype, hidden_size=target["hidden_size"],
                      layer_ids=layer_ids)
    samples = random_samples(num_samples, seed)
    infos = []
    with torch.no_grad():
        for shard, start in enumerate(range(0, num_samples, samples_per_shard)):
            chunk = samples[start:start + samples_per_shard]
            states = {i: [] for i in layer_ids}
            for _, ids, _ in chunk:
                out = model(torch.tensor([ids]), output_hidden_states=True)
                for i in layer_ids:
                    states[i].append(out.hidden_states[i][0])
            infos.append(store.write_shard(shard, [c[0] for c in chunk], [c[1] for c in chunk],
                                           [c[2] for c in chunk], {i: torch.cat(s) for i, s in states.items()}))
    store.finish(infos, store_root / "part-0.json")
    merge_parts([store_root / "part-0.json"], store_root / "index.json")
    counts = np.zeros(target["vocab_size"], dtype=np.int64)
    for _, ids, mask in samples:
        np.add.at(counts, np.asarray(ids)[np.asarray(mask, dtype=bool)], 1)
    order = np.lexsort((np.arange(len(counts)), -counts))
    draft_ids = np.sort(order[:draft_vocab_size])
    (root / "vocab").mkdir(exist_ok=True)
    save_file(mapping_tensors(draft_ids, target["vocab_size"]), str(root / "vocab" / "mapping.safetensors"))
    return {"root": root, "target": root / "target.json", "model": model_path,
            "index": store_root / "index.json", "mapping": root / "vocab" / "mapping.safetensors"}
