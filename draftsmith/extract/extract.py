"""The extraction driver: plan a part's shards, capture them with a backend, store them resumably.

A part's samples are sorted by length (so batches carry little padding) and cut into shards of
about ``shard_tokens`` tokens; a shard is cut into batches of at most ``batch_tokens`` padded
tokens. The plan depends only on train.jsonl and the settings, so a restarted part recomputes
the same shards in the same batches and writes the same bytes. Complete shards are checked
against their checksums and skipped; the target loads only when some shard is missing.

The capture itself (backends, batches, the writer thread) is in ``draftsmith.extract.capture``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from draftsmith.engines.hf_model import stage_model_dtype
from draftsmith.engines.shared import SharedEngine
from draftsmith.errors import ExtractionError
from draftsmith.extract.capture import extract_shards, make_backend
from draftsmith.extract.hidden_states import (
    DamagedShard,
    HiddenStateIndex,
    ShardInfo,
    bytes_per_token,
    load_shard_manifest,
    merge_parts,
    shard_dir_name,
)
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.extract.shard_writer import PartStore, part_lock
from draftsmith.io import lock_beside, publishing, read_json, read_jsonl
from draftsmith.settings import PROGRESS_INTERVAL_S
from draftsmith.targets.identity import weights_identity
from draftsmith.targets.vllm_install import engine_release

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Planning


@dataclass(frozen=True)
class _Entry:
    line: int
    id: str
    length: int


def _iter_rows(train_jsonl: Path) -> Iterator[tuple[int, dict]]:
    return read_jsonl(train_jsonl, error=ExtractionError, fix="rerun the prepare_dataset rule")


def _check_row(row: dict, where: str) -> None:
    ids, mask = row.get("input_ids"), row.get("loss_mask")
    if "id" not in row or not isinstance(ids, list) or not isinstance(mask, list):
        raise ExtractionError("a row lacks id, input_ids or loss_mask", where=where,
                              fix="rerun the prepare_dataset rule")
    if not ids or len(ids) != len(mask):
        raise ExtractionError(f"sample {row['id']!r} has {len(ids)} tokens and {len(mask)} loss-mask values",
                              where=where, fix="rerun the prepare_dataset rule")


def _scan(train_jsonl: Path, max_samples: int | None) -> list[_Entry]:
    """Every sample's line, id and length (the tokens stay on disk)."""
    entries, seen = [], {}
    for line_no, row in _iter_rows(train_jsonl):
        if max_samples is not None and len(entries) >= max_samples:
            break
        where = f"{train_jsonl}:{line_no}"
        _check_row(row, where)
        sample_id = str(row["id"])
        if sample_id in seen:
            raise ExtractionError(f"sample id {sample_id!r} appears twice (lines {seen[sample_id]} and {line_no})",
                                  where=str(train_jsonl), fix="give every sample its own id")
        seen[sample_id] = line_no
        entries.append(_Entry(line_no, sample_id, len(row["input_ids"])))
    return entries


def plan_part(train_jsonl: str | Path, part: int, parts: int, settings: ExtractionSettings) -> list[list[dict]]:
    """The part's shards, each a list of sample rows ({id, input_ids, loss_mask}), longest first.

    All samples are sorted by length (ties by line) and dealt to the parts in turn, which gives
    every part nearly the same number of tokens; the part's run is then cut into shards of
    about ``shard_tokens`` tokens. Deterministic: the same file and settings give the same plan.
    """
    if not 0 <= part < parts:
        raise ExtractionError(f"part {part} does not exist: parts run 0..{parts - 1}", where="extraction.parts")
    train_jsonl = Path(train_jsonl)
    entries = sorted(_scan(train_jsonl, settings.max_samples), key=lambda e: (-e.length, e.line))
    mine = entries[part::parts]
    wanted = {e.line: e for e in mine}
    rows = {}
    for line_no, row in _iter_rows(train_jsonl):
        if line_no in wanted:
            rows[line_no] = {"id": wanted[line_no].id, "input_ids": row["input_ids"], "loss_mask": row["loss_mask"]}
    shards, current, tokens = [], [], 0
    for entry in mine:
        if current and tokens + entry.length > settings.shard_tokens:
            shards.append(current)
            current, tokens = [], 0
        current.append(rows[entry.line])
        tokens += entry.length
    if current:
        shards.append(current)
    return shards



def part_fingerprint(target_info: dict, shards: Sequence[Sequence[dict]], settings: ExtractionSettings) -> str:
    """Hash of everything the part's shards are made from: the capture code (this module and every
    draftsmith module it imports: backends, the shard writer), the model (``weights_identity``),
    the samples of each shard (ids, tokens, loss masks), the layers, the storage and model dtypes,
    and, where vLLM runs the target, that, its release and its tensor parallel size (other kernels,
    other reductions)."""
    from draftsmith.fingerprint import code_fingerprint

    digest = hashlib.sha256()
    head = {
        "code": code_fingerprint("draftsmith.extract.extract"),
        "model": weights_identity(target_info["model_path"]),
        "layers_path": target_info["layers_path"],
        "layer_ids": target_info["captured_layer_ids"],
        "hidden_size": target_info["hidden_size"],
        "dtype": settings.dtype,
        "model_dtype": stage_model_dtype(settings),
    }
    if settings.backend == "vllm":
        head.update(backend="vllm", tensor_parallel_size=settings.tensor_parallel_size, **engine_release("vllm"))
    digest.update(json.dumps(head, sort_keys=True).encode())
    for number, shard in enumerate(shards):
        digest.update(f"\nshard {number} {len(shard)}\n".encode())
        for sample in shard:
            digest.update(json.dumps(sample["id"]).encode())
            digest.update(array("q", sample["input_ids"]).tobytes())
            digest.update(array("b", sample["loss_mask"]).tobytes())
    return digest.hexdigest()



# ---------------------------------------------------------------------------------------------
# The part and the merge


def _gib(n: float) -> str:
    """Bytes for people: 1.23 GiB, 456.0 MiB, 7.8 KiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _check_disk(folder: Path, needed: int, alternative: tuple[str, int], settings: ExtractionSettings) -> None:
    free = shutil.disk_usage(folder).free
    if needed and free < needed + settings.min_free_bytes:
        other, other_bytes = alternative
        raise ExtractionError(
            f"not enough disk space: the remaining shards need {_gib(needed)} as {settings.dtype} "
            f"(+ {_gib(settings.min_free_bytes)} kept free), the disk has {_gib(free)} free",
            where=str(folder),
            fix=f"free space or move the results folder to a larger disk; extraction.dtype: {other} would "
                f"need {_gib(other_bytes)}; fewer samples (data.max_samples) or a lower data.max_seq_len need less")


def _verify_shards(store: PartStore, count: int) -> dict[int, ShardInfo]:
    """The complete, intact shards among 0..count-1 (checksums read in parallel; damaged ones removed)."""
    present = [n for n in range(count) if (store.dir / shard_dir_name(n)).is_dir()]
    if not present:
        return {}
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(8, len(present))) as pool:
        infos = dict(zip(present, pool.map(store.shard_info, present)))
    done = {n: info for n, info in infos.items() if info is not None}
    log.info("part %d: %d of %d shards already complete (checked in %.1f s)", store.part, len(done), count,
             time.perf_counter() - started)
    return done


class _Progress:
    """A progress bar (tokens/s, ETA, samples) on the terminal, and a line in the log every few minutes."""

    LOG_EVERY = 300.0  # seconds

    def __init__(self, part: int, shards: Sequence[list[dict]], done: dict, todo_tokens: int) -> None:
        from tqdm import tqdm

        self.part = part
        self.samples_total = sum(map(len, shards))
        self.samples = sum(len(shards[n]) for n in done)
        self.tokens_total = sum(len(s["input_ids"]) for shard in shards for s in shard)
        self.todo_tokens, self.tokens = todo_tokens, 0
        # On a terminal the bar redraws each second; into a cluster job's log file, twice a minute.
        self.bar = tqdm(total=self.tokens_total, initial=self.tokens_total - todo_tokens, unit="tok",
                        unit_scale=True, desc=f"part {part}", dynamic_ncols=True,
                        mininterval=1 if sys.stderr.isatty() else PROGRESS_INTERVAL_S)
        self.started = self.logged = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def update(self, num_samples: int, num_tokens: int) -> None:
        self.samples += num_samples
        self.tokens += num_tokens
        self.bar.set_postfix_str(f"{self.samples}/{self.samples_total} samples", refresh=False)
        self.bar.update(num_tokens)
        now = time.perf_counter()
        if now - self.logged >= self.LOG_EVERY:
            self.logged = now
            rate = self.tokens / max(now - self.started, 1e-9)
            log.info("part %d: %d/%d samples, %.0f tokens/s, about %.0f min left", self.part, self.samples,
                     self.samples_total, rate, (self.todo_tokens - self.tokens) / max(rate, 1e-9) / 60)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def extract_part(train_jsonl: str | Path, target_json: str | Path, part: int, settings: ExtractionSettings,
                 store_root: str | Path, manifest_path: str | Path, shared_engine: SharedEngine | None = None) -> dict:
    """Extract one part's shards (resuming any already complete) and write its manifest, as the
    part's only writer: a second writer of the same part stops at once (``part_lock``).
    ``shared_engine``: the vLLM engine is also evaluation's (draftsmith.engines.shared)."""
    with part_lock(store_root, part):
        return _extract_part(train_jsonl, target_json, part, settings, store_root, manifest_path, shared_engine)


def _extract_part(train_jsonl: str | Path, target_json: str | Path, part: int, settings: ExtractionSettings,
                  store_root: str | Path, manifest_path: str | Path, shared_engine: SharedEngine | None) -> dict:
    from draftsmith.targets.inspect import read_target_json

    target_info = read_target_json(target_json)
    shards = plan_part(train_jsonl, part, settings.parts, settings)
    layer_ids = target_info["captured_layer_ids"]
    hidden = target_info["hidden_size"]

    def tokens(samples: Iterable[dict]) -> int:
        return sum(len(s["input_ids"]) for s in samples)

    part_tokens = sum(tokens(s) for s in shards)
    log.info("part %d of %d: %d samples, %d tokens in %d shards; layers %s, hidden %d",
             part, settings.parts, sum(map(len, shards)), part_tokens, len(shards), layer_ids, hidden)
    store = PartStore(store_root, part, fingerprint=part_fingerprint(target_info, shards, settings),
                      dtype=settings.dtype, hidden_size=hidden, layer_ids=layer_ids,
                      model_dtype=stage_model_dtype(settings))
    done = _verify_shards(store, len(shards))
    todo = [(n, shard) for n, shard in enumerate(shards) if n not in done]
    todo_tokens = sum(tokens(s) for _, s in todo)
    other = "fp8" if settings.dtype != "fp8" else "bfloat16"
    per_token = bytes_per_token(hidden, len(layer_ids), settings.dtype)
    per_token_other = bytes_per_token(hidden, len(layer_ids), other)
    log.info("part %d stores %s as %s (%s as %s); %d shards (%s) still to write",
             part, _gib(part_tokens * per_token), settings.dtype, _gib(part_tokens * per_token_other), other,
             len(todo), _gib(todo_tokens * per_token))
    _check_disk(store.dir, todo_tokens * per_token, (other, todo_tokens * per_token_other), settings)

    if todo:
        longest = max(len(s["input_ids"]) for _, shard in todo for s in shard)
        if longest > settings.batch_tokens:
            log.warning("part %d: samples of up to %d tokens exceed extraction.batch_tokens (%d); each such "
                        "sample runs as a batch of its own", part, longest, settings.batch_tokens)
        started = time.perf_counter()
        with make_backend(target_info, settings, longest, shared=shared_engine) as backend:
            log.info("part %d: %s backend ready in %.1f s", part, backend.name, time.perf_counter() - started)
            with _Progress(part, shards, done, todo_tokens) as progress:
                written = extract_shards(backend, store, todo, batch_tokens=settings.batch_tokens,
                                         progress=progress.update)
        log.info("part %d: %d shards, %d tokens in %.1f s (%.0f tokens/s; %.1f s with the model load)",
                 part, len(written), todo_tokens, progress.seconds, todo_tokens / max(progress.seconds, 1e-9),
                 time.perf_counter() - started)
        done.update({info.shard: info for info in written})
    with publishing(lock_beside(store.dir), f"writing extraction part {part}", ExtractionError, [Path(manifest_path)]):
        return store.finish([done[n] for n in range(len(shards))], manifest_path)


def merge(manifests: Sequence[str | Path], index_path: str | Path) -> HiddenStateIndex:
    """Combine the parts' manifests into ``index.json``, checking that no sample appears twice."""
    raws = [read_json(m) for m in manifests]
    numbers = sorted(r["part"] for r in raws)
    if numbers != list(range(len(raws))):
        raise ExtractionError(f"the part manifests hold parts {numbers}, expected 0..{len(raws) - 1} once each",
                              where=", ".join(map(str, manifests)), fix="rerun extraction for the missing parts")
    root = Path(index_path).parent
    seen: dict[str, int] = {}
    for raw in raws:
        for shard in raw["shards"]:
            try:
                sample_ids = load_shard_manifest(root / shard["path"])["sample_ids"]
            except DamagedShard as e:
                (root / f"part-{raw['part']}.json").unlink(missing_ok=True)
                raise ExtractionError(f"part {raw['part']} shard {shard['shard']} is damaged: {e}",
                                      where=str(root / shard["path"]),
                                      fix=f"rerun the workflow: the manifest of part {raw['part']} was removed, so "
                                          "its extraction reruns and regenerates the damaged shard alone") from None
            for sample_id in sample_ids:
                if sample_id in seen:
                    raise ExtractionError(f"sample {sample_id!r} was extracted by parts {seen[sample_id]} and "
                                          f"{raw['part']}", where=str(root),
                                          fix="rerun every part with the same extraction.parts")
                seen[sample_id] = raw["part"]
    index = merge_parts(manifests, index_path)
    log.info("hidden-state index: %d parts, %d shards, %d samples, %d tokens (%d in the loss), %s",
             len(raws), len(index.shards), index.num_samples, index.num_tokens, index.num_loss_tokens,
             Path(index_path))
    return index
