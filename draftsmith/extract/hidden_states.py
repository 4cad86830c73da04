"""The hidden-state shard store: per-layer safetensors shards, made visible only when complete.

Layout under the store root (``results/<run>/hidden_states``)::

    part-<p>/store.json                  what this part's shards were made from (fingerprint, dtype, layers)
    part-<p>/shard-<s>/layer-<id>.safetensors   {"hidden_states": [T, H]} (+ {"scales": [T]} for fp8)
    part-<p>/shard-<s>/tokens.safetensors       {"input_ids": [T], "loss_mask": [T], "offsets": [n+1]}
    part-<p>/shard-<s>/manifest.json            sample ids, counts, checksum of every file above (and sha256 of itself)
    part-<p>.json                        the part's manifest (the extraction rule's output)
    index.json                           every part and shard (the merge rule's output)

A shard is written (``draftsmith.extract.shard_writer``) into a hidden temporary folder and renamed into
place once all its files are written, synced and checksummed, so a crash leaves either a whole
shard or none. The rule outputs are the small manifests: Snakemake deletes a failed job's outputs,
never the shards. This module holds the format (fp8's too: ``quantize_fp8``, which the captures run
on the target's device) and everything that reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

from draftsmith.errors import ExtractionError
from draftsmith.io import atomic_write_json, bytes_match, file_matches, read_json

log = logging.getLogger(__name__)

INDEX_FORMAT = "draftsmith.extract.hidden_states/1"
FP8_MAX = 448.0  # largest finite float8_e4m3fn value

STORAGE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}
BYTES_PER_ELEMENT = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


@dataclass(frozen=True)
class ShardInfo:
    part: int
    shard: int
    path: str  # relative to the store root
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    checksums: dict[str, str] = field(default_factory=dict)  # file name -> checksum (draftsmith.io)


@dataclass
class ShardData:
    sample_ids: list[str]
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    offsets: torch.Tensor  # int64 [n+1]: sample i is rows offsets[i]:offsets[i+1]
    states: dict[int, torch.Tensor]  # layer id -> [T, H]; fp8 comes back dequantised to bf16


@dataclass
class HiddenStateIndex:
    root: Path
    dtype: str
    hidden_size: int
    aux_layer_ids: list[int]
    final_layer_id: int
    shards: list[ShardInfo]
    num_samples: int
    num_tokens: int
    num_loss_tokens: int

    @property
    def layer_ids(self) -> list[int]:
        return [*self.aux_layer_ids, self.final_layer_id]

    @classmethod
    def load(cls, path: str | Path) -> HiddenStateIndex:
        path = Path(path)
        raw = read_json(path)
        if raw.get("format") != INDEX_FORMAT:
            raise ExtractionError(
                f"not a Draftsmith hidden-state index (format {raw.get('format')!r}, expected {INDEX_FORMAT!r})",
                where=str(path), fix="rerun the merge_hidden_states rule to rebuild it",
            )
        return cls(
            root=path.parent, dtype=raw["dtype"], hidden_size=raw["hidden_size"],
            aux_layer_ids=raw["aux_layer_ids"], final_layer_id=raw["final_layer_id"],
            shards=[ShardInfo(**s) for s in raw["shards"]], num_samples=raw["num_samples"],
            num_tokens=raw["num_tokens"], num_loss_tokens=raw["num_loss_tokens"],
        )


def bytes_per_token(hidden_size: int, num_layers: int, dtype: str) -> int:
    """Bytes one token costs on disk: its states for every captured layer, plus ids and mask."""
    states = num_layers * hidden_size * BYTES_PER_ELEMENT[dtype]
    scales = num_layers * 4 if dtype == "fp8" else 0
    return states + scales + 8 + 1


@dataclass(frozen=True, eq=False)  # tensors: compared by identity, not by value
class Fp8Rows:
    """States already in the store's fp8 form (``quantize_fp8``): e4m3 values [..., hidden] and one
    float32 scale per row [...]. A capture that quantises on its own device hands these over, so
    the writer stores them as they are."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def __getitem__(self, index) -> Fp8Rows:
        """The same rows of values and scales; ``index`` addresses the row dimensions, never hidden."""
        return Fp8Rows(self.values[index], self.scales[index])


CapturedRows = torch.Tensor | Fp8Rows  # one layer's rows as a capture hands them over: the states, or already fp8


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The store's fp8: e4m3 values [..., hidden] with one float32 scale per token (row) [...], so
    outlier tokens do not crush the rest. The arithmetic is the same on every device (IEEE float32
    division and products, the same rounding to e4m3), so a capture that quantises on the GPU
    stores the bytes this function makes on the CPU. An all-zero row gets the floor scale
    1e-12 / FP8_MAX, a row holding NaN or Inf a non-finite one."""
    amax = states.abs().amax(dim=-1).float().clamp(min=1e-12)
    # Divided by a tensor on the same device, not by a Python number: CUDA turns division by a
    # number into a product with its reciprocal, which rounds some scales differently from the CPU.
    scales = amax / torch.full((), FP8_MAX, device=amax.device)
    # Few full-size temporaries (one float32 copy, scaled in place): on a CPU the passes over the
    # batch and their fresh allocations, not the math, cost.
    values = states.to(torch.float32, copy=True).mul_(scales.reciprocal().unsqueeze(-1)).to(torch.float8_e4m3fn)
    return values, scales


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows of e4m3 values [T, H] times their per-token scales [T], as ``dtype``."""
    return (values.float() * scales[:, None]).to(dtype)


def layer_file(layer_id: int) -> str:
    return f"layer-{layer_id}.safetensors"


TOKENS_FILE = "tokens.safetensors"
SHARD_MANIFEST = "manifest.json"


def part_dir_name(part: int) -> str:
    return f"part-{part}"


def shard_dir_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def merge_parts(part_manifests: Sequence[str | Path], index_path: str | Path) -> HiddenStateIndex:
    """Combine the parts' manifests into ``index.json``, the one file training depends on."""
    index_path = Path(index_path)
    parts = sorted((read_json(p) for p in part_manifests), key=lambda m: m["part"])
    if not parts:
        raise ExtractionError("no extraction parts to merge", where=str(index_path))
    first = parts[0]
    for manifest in parts[1:]:
        for key in ("dtype", "hidden_size", "layer_ids"):
            if manifest[key] != first[key]:
                raise ExtractionError(
                    f"parts disagree on {key}: part {first['part']} has {first[key]}, "
                    f"part {manifest['part']} has {manifest[key]}",
                    fix="rerun extraction for all parts with the same settings")
        dtypes = first.get("model_dtype"), manifest.get("model_dtype")  # None: a part written before it was recorded
        if None not in dtypes and dtypes[0] != dtypes[1]:
            # target.dtype auto on nodes of differing CPUs: each part's fingerprint covers its own samples
            raise ExtractionError(
                f"part {first['part']}'s states were computed in {dtypes[0]}, part {manifest['part']}'s in "
                f"{dtypes[1]}: one store would train on both",
                where=str(index_path.parent),
                fix="set target.dtype to bfloat16 or float32 and rerun the workflow: the changed setting reruns "
                    "every part, and those of the other dtype are extracted again (or set DRAFTSMITH_CPU_BFLOAT16 "
                    "alike on every node and rerun with --forcerun extract_hidden_states; docs/cluster.md)")
    shards = [s for manifest in parts for s in manifest["shards"]]
    layer_ids = first["layer_ids"]
    index = {
        "format": INDEX_FORMAT,
        "dtype": first["dtype"],
        "model_dtype": first.get("model_dtype"),
        "hidden_size": first["hidden_size"],
        "aux_layer_ids": layer_ids[:-1],
        "final_layer_id": layer_ids[-1],
        "layer_ids": layer_ids,
        "parts": [m["part"] for m in parts],
        "num_shards": len(shards),
        "num_samples": sum(s["num_samples"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_loss_tokens": sum(s["num_loss_tokens"] for s in shards),
        "bytes": sum((index_path.parent / s["path"] / name).stat().st_size
                     for s in shards for name in s["checksums"]),
        "shards": shards,
    }
    atomic_write_json(index_path, index)
    return HiddenStateIndex.load(index_path)


def read_shard(index: HiddenStateIndex, shard: ShardInfo, layer_ids: Sequence[int] | None = None,
               verify: bool = True) -> ShardData:
    """Load one shard's tokens and the asked layers; with ``verify``, check each file's checksum first."""
    path = index.root / shard.path
    wanted = index.layer_ids if layer_ids is None else list(layer_ids)
    unknown = set(wanted) - set(index.layer_ids)
    if unknown:
        raise ExtractionError(f"layers {sorted(unknown)} were not extracted (the index has {index.layer_ids})",
                              where=str(index.root / "index.json"))
    tokens = load_safetensors(_read_checked(path, TOKENS_FILE, shard, verify))
    states = {}
    for layer_id in wanted:
        tensors = load_safetensors(_read_checked(path, layer_file(layer_id), shard, verify))
        values = tensors["hidden_states"]
        states[layer_id] = dequantize_fp8(values, tensors["scales"]) if "scales" in tensors else values
    manifest = load_shard_manifest(path) if verify else read_json(path / SHARD_MANIFEST)
    return ShardData(
        sample_ids=manifest["sample_ids"], input_ids=tokens["input_ids"].long(),
        loss_mask=tokens["loss_mask"].bool(), offsets=tokens["offsets"], states=states,
    )


class ShardRows:
    """Rows of one shard's layer files, memory-mapped: only the rows a reader asks for are read."""

    def __init__(self, index: HiddenStateIndex, shard: ShardInfo, layer_ids: Sequence[int]) -> None:
        tokens = read_shard(index, shard, layer_ids=[], verify=False)
        self.input_ids = tokens.input_ids
        self.loss_mask = tokens.loss_mask
        root = index.root / shard.path
        self.files = {i: safe_open(str(root / layer_file(i)), "pt") for i in layer_ids}
        self.fp8 = index.dtype == "fp8"

    def rows(self, layer_id: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stored rows and, for fp8, their per-token scales (dequantised by the reader, on its device)."""
        f = self.files[layer_id]
        values = f.get_slice("hidden_states")[start:stop]
        return values, (f.get_slice("scales")[start:stop] if self.fp8 else None)


def _read_checked(shard_dir: Path, name: str, shard: ShardInfo, verify: bool) -> bytes:
    file = shard_dir / name
    try:
        data = file.read_bytes()
    except OSError as e:
        raise ExtractionError(f"cannot read hidden-state file: {e}", where=str(file),
                              fix="rerun the workflow: extraction redoes missing shards") from e
    if verify:
        if not bytes_match(data, shard.checksums.get(name, "")):
            raise ExtractionError(
                f"checksum mismatch: part {shard.part} shard {shard.shard} file {name} is corrupt",
                where=str(file),
                fix="rerun the workflow: extraction checks every shard and regenerates only damaged ones")
    return data


class DamagedShard(Exception):
    """Internal: a shard's manifest is missing, unreadable or fails its own checksum."""


def shard_manifest_bytes(manifest: dict) -> bytes:
    """The manifest's JSON with a ``sha256`` of its other keys, so a flipped byte anywhere is caught."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()
    return (json.dumps({**body, "sha256": digest}, indent=2) + "\n").encode("utf-8")


def load_shard_manifest(shard_dir: Path) -> dict:
    """A shard's manifest, checked byte for byte against its own checksum; raises DamagedShard."""
    try:
        raw = (shard_dir / SHARD_MANIFEST).read_bytes()
    except FileNotFoundError:
        raise DamagedShard(f"{SHARD_MANIFEST} is missing") from None
    try:
        manifest = json.loads(raw)
    except ValueError:  # not UTF-8, not JSON
        raise DamagedShard(f"{SHARD_MANIFEST} is not valid JSON") from None
    if not isinstance(manifest, dict) or shard_manifest_bytes(manifest) != raw:
        raise DamagedShard(f"{SHARD_MANIFEST} fails its checksum")
    return manifest


def shard_info_from_manifest(manifest: dict) -> ShardInfo:
    known = {f.name for f in fields(ShardInfo)}
    return ShardInfo(**{k: v for k, v in manifest.items() if k in known})


def shard_problem(shard_dir: Path, shard: ShardInfo) -> str | None:
    """What is wrong with a shard on disk compared with its entry in the index, or None when intact."""
    if not shard_dir.is_dir():
        return "the shard folder is missing"
    try:
        manifest = load_shard_manifest(shard_dir)
    except DamagedShard as e:
        return str(e)
    if manifest.get("checksums") != shard.checksums or manifest.get("sample_ids") is None:
        return f"{SHARD_MANIFEST} disagrees with the index"
    return check_files(shard_dir, shard.checksums)


def verify_store(index_path: str | Path, *, workers: int = 8) -> HiddenStateIndex:
    """Check every shard of ``index.json`` against its checksums before anything reads the states.

    A damaged shard (a flipped byte, a truncated or missing file) is named in the error, and the
    manifest of its part and the index are removed: the next run of the workflow then reruns that
    part's extraction (which keeps the intact shards and regenerates the damaged ones alone) and
    the merge. (Snakemake recreates a missing file only when something downstream is missing.)
    """
    index_path = Path(index_path)
    index = HiddenStateIndex.load(index_path)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(index.shards)))) as pool:
        problems = list(pool.map(lambda s: shard_problem(index.root / s.path, s), index.shards))
    damaged = [(s, p) for s, p in zip(index.shards, problems) if p]
    if damaged:
        parts = sorted({s.part for s, _ in damaged})
        for part in parts:
            (index.root / f"part-{part}.json").unlink(missing_ok=True)
        index_path.unlink(missing_ok=True)
        listed = "; ".join(f"part {s.part} shard {s.shard}: {p}" for s, p in damaged[:5])
        more = f" (and {len(damaged) - 5} more)" if len(damaged) > 5 else ""
        first = damaged[0][0]
        raise ExtractionError(
            f"{len(damaged)} of {len(index.shards)} hidden-state shards are damaged: {listed}{more}",
            where=str(index.root / first.path),
            fix=f"rerun the workflow: the index and the manifest of part {', '.join(map(str, parts))} were removed, "
                "so that part's extraction reruns, keeps every intact shard and regenerates the damaged ones alone")
    log.info("hidden states: %d shards intact (checked in %.1f s)", len(index.shards), time.perf_counter() - started)
    return index


def check_files(shard_dir: Path, checksums: dict[str, str]) -> str | None:
    for name, digest in checksums.items():
        file = shard_dir / name
        if not file.exists():
            return f"{name} is missing"
        if not file_matches(file, digest):
            return f"{name} fails its checksum"
    return None
