"""Training checkpoints under the work dir: keyed by the code, settings and inputs they were made
from, written into a hidden folder and renamed into place, resumed only by the same run."""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from draftsmith.draft.model import Eagle3Draft
from draftsmith.errors import TrainingError
from draftsmith.io import atomic_write_bytes, atomic_write_json, check_safetensors, fsync_dir, read_json, sha256_file
from draftsmith.train.settings import TrainSettings

CHECKPOINT_FORMAT = "draftsmith.train-checkpoint/2"
FINISHED = "finished.json"  # in the work dir once the rule's outputs are written: its checkpoints are not resumed


def checkpoint_key(settings: TrainSettings, index_path: Path | None, mapping_path: Path, target: dict,
                    group: int, states: str | None = None) -> dict[str, str]:
    """What a checkpoint was made from, part by part, so a refusal can say which part changed:
    the training code (this module and every draftsmith module it imports), the settings that
    change the math, the hidden states (the hash of index.json, or online the fingerprint of what
    the states are made from, ``states``), the vocab mapping and the target."""
    from draftsmith.fingerprint import code_fingerprint

    keys = ("model_path", "hidden_size", "vocab_size", "num_hidden_layers", "aux_layer_ids", "final_layer_id",
            "text_config")

    def digest(value) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]

    return {
        "format": CHECKPOINT_FORMAT,
        "code": code_fingerprint("draftsmith.train"),
        "settings": digest({"math": settings.math_dict(), "micro_batches_per_step": group}),
        "index": states if states is not None else sha256_file(index_path),
        "mapping": sha256_file(mapping_path),
        "target": digest({k: target.get(k) for k in keys}),
    }


# What each part of the checkpoint key is, for the log.
_KEY_PARTS = {"format": "the checkpoint format", "code": "the training code (draftsmith.train and its imports)",
              "settings": "the training settings", "index": "the hidden states (index.json)",
              "mapping": "the vocab mapping", "target": "the target"}


def _trainable_state(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().contiguous() for n, p in draft.named_parameters() if p.requires_grad}


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The optimizer's state as named tensors (for safetensors) and its param groups (for JSON):
    checkpoints hold no pickles."""
    state = optimizer.state_dict()
    tensors = {f"{index}.{key}": torch.as_tensor(value).detach().cpu().contiguous()
               for index, entry in state["state"].items() for key, value in entry.items()}
    return tensors, state["param_groups"]


def _optimizer_state(tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    return {"state": state, "param_groups": groups}


def save_checkpoint(ckpt_root: Path, step: int, draft: Eagle3Draft, optimizer: torch.optim.Optimizer,
                     state: dict, keep: int) -> Path:
    """Write into a hidden folder, then rename: a kill leaves the previous checkpoint intact."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step-{step:08d}"
    tmp = ckpt_root / f".step-{step:08d}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files = {
            "model.safetensors": save_safetensors(_trainable_state(draft)),
            "rng.safetensors": save_safetensors(_rng_state()),
        }
        for name, data in files.items():
            atomic_write_bytes(tmp / name, data)
        tensors, groups = _optimizer_tensors(optimizer)
        atomic_write_bytes(tmp / "optimizer.safetensors", save_safetensors(tensors))
        atomic_write_json(tmp / "optimizer.json", groups)
        atomic_write_json(tmp / "state.json", state)
        if final.exists():
            _remove_hidden(final)
        tmp.rename(final)
        fsync_dir(ckpt_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_json(ckpt_root / "latest.json", {"step": step, "path": final.name})
    old = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir() and p != final)
    for p in old[:max(len(old) - (keep - 1), 0)]:
        _remove_hidden(p)
    return final


def _remove_hidden(folder: Path) -> None:
    """Rename to a hidden name, then delete: a kill mid-delete never leaves a partial step-* on show."""
    doomed = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
    folder.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def find_checkpoint(work_dir: Path, key: dict[str, str]) -> tuple[Path | None, dict | None, str]:
    """The latest checkpoint if it was made by the same code from the same inputs and settings by
    a run that has not finished, else (None, None); and, for the log, why it is or is not resumed."""
    ckpt_root = work_dir / "checkpoints"
    for stale in ckpt_root.glob(".step-*"):  # a checkpoint half-written or half-deleted by a kill
        shutil.rmtree(stale, ignore_errors=True)
    pointer = ckpt_root / "latest.json"
    if not pointer.exists():
        return None, None, f"no checkpoint in {ckpt_root}: training from step 0"
    path, state, passed_over = _newest_readable(ckpt_root, pointer)
    damaged = f" (passed over, unreadable: {'; '.join(passed_over)})" if passed_over else ""
    if path is None:
        return None, None, f"no readable checkpoint in {ckpt_root}{damaged}: training from step 0"
    old = state.get("key") or {}
    changed = [_KEY_PARTS[part] for part in key if old.get(part) != key[part]]
    if changed:
        return None, None, (f"not resuming from {path.name} (step {state.get('step')}): "
                            f"{', '.join(changed)} changed since it was written; training from step 0")
    if (work_dir / FINISHED).exists():
        # The run that wrote it delivered its draft: the rule runs again because it was told to
        # (--forcerun) or its outputs were removed, and a rerun must train, not copy the old draft.
        return None, None, (f"not resuming from {path.name}: it ends a finished run whose draft was delivered; "
                            "training again from step 0")
    return path, state, f"resuming from {path} (step {state['step']}): same code, settings and inputs{damaged}"


def _newest_readable(ckpt_root: Path, pointer: Path) -> tuple[Path | None, dict | None, list[str]]:
    """The checkpoint latest.json names or, where it cannot be read (its files damaged on disk), the
    newest one before it that can, with its state.json; and those passed over, with why. Writes are atomic, so only the
    disk damages a checkpoint, and the one before it (train.keep_checkpoints) is still a resume."""
    try:
        named: Path | None = ckpt_root / read_json(pointer, error=TrainingError)["path"]
    except (TrainingError, KeyError, TypeError):
        named = None
    older = sorted((p for p in ckpt_root.glob("step-*") if p.is_dir()), reverse=True)
    candidates = ([named] if named is not None else []) + [p for p in older if named is None or p.name < named.name]
    passed_over = []
    for path in candidates:
        try:
            state = read_json(path / "state.json", error=TrainingError)
            read_json(path / "optimizer.json", error=TrainingError)
            for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors"):
                check_safetensors(path / name, error=TrainingError, fix="")
        except (TrainingError, OSError) as e:
            passed_over.append(f"{path.name}: {e.what if isinstance(e, TrainingError) else e}")
            continue
        return path, state, passed_over
    return None, None, passed_over


def load_checkpoint(path: Path, draft: Eagle3Draft, optimizer: torch.optim.Optimizer) -> None:
    """Put a checkpoint's trainable weights, optimizer state and RNG state back in place."""
    tensors = load_file(str(path / "model.safetensors"))
    draft.load_state_dict(tensors, strict=False)
    expected = {n for n, p in draft.named_parameters() if p.requires_grad}
    if set(tensors) != expected:
        raise TrainingError(f"checkpoint weights do not match the draft ({sorted(set(tensors) ^ expected)})",
                            where=str(path), fix=f"delete {path.parent} to start over")
    # load_state_dict moves each state tensor where its parameter (and fused/capturable) wants it
    optimizer.load_state_dict(_optimizer_state(load_file(str(path / "optimizer.safetensors")),
                                               read_json(path / "optimizer.json")))
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def clear_stale_state(work_dir: Path) -> None:
    """Remove what an earlier, not resumed run left in the work dir (its checkpoints and logs)."""
    for stale in ("checkpoints", "tensorboard", "metrics.jsonl", FINISHED):
        p = work_dir / stale
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
