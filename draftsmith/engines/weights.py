"""Read single tensors of the target (embeddings, lm_head) from its safetensors files, without
loading the model: the trainer needs only these two matrices of a possibly 1T-parameter target."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith.errors import TargetError
from draftsmith.targets.identity import SAFETENSORS_INDEX, checkpoint_files
from draftsmith.targets.inspect import read_target_json


def checkpoint_keys(model_path: Path) -> dict[str, Path]:
    """Every tensor name in the folder's safetensors files, mapped to the file holding it."""
    index = model_path / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_path / file for name, file in weight_map.items()}
    files = checkpoint_files(model_path)
    if not files:
        raise TargetError("the target folder holds no .safetensors weights", where=str(model_path),
                          fix="convert the weights to safetensors (Draftsmith never unpickles .bin files)")
    keys = {}
    for file in files:
        with safe_open(file, "pt") as f:
            keys.update({name: file for name in f.keys()})
    return keys


def resolve_key(keys: dict[str, Path], module_path: str, model_path: Path, *, shaped_like: str | None = None) -> str:
    """The checkpoint name of ``<module_path>.weight``.

    Checkpoints of wrapped models often name tensors differently from the modules
    (``language_model.model.embed_tokens`` vs ``model.language_model.embed_tokens``), so fall back
    to the one key that ends with the module's own name. Some keep a tensor under a name that
    transformers renames on load (GPT-NeoX's lm_head is ``embed_out.weight``): with
    ``shaped_like`` (the embedding's key), the lm_head is then the one other tensor of its shape.
    """
    wanted = f"{module_path}.weight"
    if wanted in keys:
        return wanted
    leaf = ".".join(wanted.split(".")[-2:])
    matches = [k for k in keys if k == leaf or k.endswith("." + leaf)]
    if len(matches) == 1:
        return matches[0]
    if not matches and shaped_like is not None:
        matches = _same_shape(keys, shaped_like)
        if len(matches) == 1:
            return matches[0]
        leaf = f"{leaf}, nor another tensor shaped like {shaped_like}"
    raise TargetError(f"cannot find the weights of {module_path} in the checkpoint (keys ending in {leaf}: {matches})",
                      where=str(model_path), fix="check that the weights belong to this config")


def _same_shape(keys: dict[str, Path], like: str) -> list[str]:
    """The other tensors of ``like``'s shape, read from the files' headers (no tensor is loaded)."""
    shapes = {}
    for file in sorted(set(keys.values())):
        with safe_open(file, "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return [name for name in keys if name != like and shapes.get(name) == shapes[like]]


def load_tensor(keys: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(keys[name], "pt") as f:
        return f.get_tensor(name)


def load_embedding_and_head(target_json: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token embeddings [V, H] and lm_head weight [V, H] (one tensor when tied)."""
    info = read_target_json(target_json)
    model_path = Path(info["model_path"])
    keys = checkpoint_keys(model_path)
    embed_key = resolve_key(keys, info["embed_path"], model_path)
    embed = load_tensor(keys, embed_key)
    if info["tie_word_embeddings"]:
        return embed, embed
    head = load_tensor(keys, resolve_key(keys, info["lm_head_path"], model_path, shaped_like=embed_key))
    return embed, head
