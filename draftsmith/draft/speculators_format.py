"""The draft on disk in the speculators format: ``config.json`` and ``model.safetensors`` that
speculators 0.9 and vLLM load as they are (the weight names are ``draftsmith.draft.model``'s)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from draftsmith.draft.config import Eagle3DraftConfig
from draftsmith.draft.model import Eagle3Draft
from draftsmith.engines.hf_model import MODEL_DTYPES
from draftsmith.errors import DraftsmithError, TrainingError
from draftsmith.io import atomic_write_bytes, atomic_write_json, check_safetensors, read_json
from draftsmith.targets.vllm_compat import vocab_maps_allowed


def speculators_state_dict(model: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights under speculators 0.9's names (ours are the same), floats cast to ``dtype``."""
    out = {}
    maps = vocab_maps_allowed(model.config.draft_vocab_size, model.config.target_vocab_size)
    for name, tensor in model.state_dict().items():
        if name.startswith("rotary.") or (not maps and name in ("d2t", "t2d")):
            continue
        tensor = tensor.detach().cpu()
        out[name] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    return out


def save_speculators(model: Eagle3Draft, out_dir: str | Path, *, dtype: str = "bfloat16",
                     extra_files: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` so speculators and vLLM load the draft as-is."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # config.json is written last: a kill in between must not pair new weights with an old config
    (out_dir / "config.json").unlink(missing_ok=True)
    tensors = speculators_state_dict(model, MODEL_DTYPES[dtype])
    atomic_write_bytes(out_dir / "model.safetensors",
                       save_safetensors(tensors, metadata={"format": "pt"}))
    for name, obj in (extra_files or {}).items():
        atomic_write_json(out_dir / name, obj)
    atomic_write_json(out_dir / "config.json", model.config.to_speculators(dtype=dtype))
    return out_dir


def check_draft_folder(path: str | Path, error: type[DraftsmithError]) -> None:
    """A delivered draft whose files cannot be read (damaged, cut by a full disk, or gone) as
    ``error`` naming the file, before a stage that reads it loads anything else."""
    path = Path(path)
    fix = ("train the draft again (snakemake --forcerun train_draft --cores all, with the run's --configfile), "
           "or put the file back from a copy")
    read_json(path / "config.json", error=error, fix=fix)
    check_safetensors(path / "model.safetensors", error=error, fix=fix)


def load_speculators(path: str | Path, *, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> Eagle3Draft:
    """Load a speculators-format EAGLE-3 draft (ours or speculators'); strict about weight names."""
    path = Path(path)
    config = Eagle3DraftConfig.from_speculators(read_json(path / "config.json"))
    tensors = load_file(path / "model.safetensors", device=str(device))
    if not config.aux_layer_ids:
        config = replace(config, aux_layer_ids=list(range(tensors["fc.weight"].shape[1] // config.hidden_size)))
    model = Eagle3Draft(config)
    if "d2t" not in tensors:  # a draft over the full target vocabulary
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(config.target_vocab_size, dtype=torch.bool)
    tensors.pop("verifier_lm_head.weight", None)
    tensors.pop("verifier_norm.weight", None)
    missing, unexpected = model.load_state_dict(
        {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise TrainingError(f"draft weights do not match the config: missing {missing}, unexpected {unexpected}",
                            where=str(path / "model.safetensors"))
    model.embed_tokens.weight.requires_grad_(False)
    return model.to(device)
