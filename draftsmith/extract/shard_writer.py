"""Writing the hidden-state shard store: one part's shards, each appended batch by batch and made
visible only when complete (the layout and the readers are in ``draftsmith.extract.hidden_states``).

A shard is written into a hidden temporary folder and renamed into place once all its files are
written, synced and checksummed, so a crash leaves either a whole shard or none.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from draftsmith.errors import ExtractionError
from draftsmith.extract.hidden_states import (
    INDEX_FORMAT,
    SHARD_MANIFEST,
    STORAGE_DTYPES,
    TOKENS_FILE,
    CapturedRows,
    DamagedShard,
    Fp8Rows,
    ShardInfo,
    check_files,
    layer_file,
    load_shard_manifest,
    part_dir_name,
    quantize_fp8,
    shard_dir_name,
    shard_info_from_manifest,
    shard_manifest_bytes,
)
from draftsmith.extract.safetensors_stream import SafetensorsStream, write_safetensors
from draftsmith.io import atomic_write_bytes, atomic_write_json, fsync_dir, lock_beside, read_json, sole_writer

log = logging.getLogger(__name__)


@contextmanager
def part_lock(root: str | Path, part: int) -> Iterator[Path]:
    """Hold part ``part`` of the store at ``root`` for this process alone while the block runs
    (``io.sole_writer``): an orphaned job and the rerun's would otherwise write the same part's
    shards side by side. The lock, ``<root>/part-<p>.lock``, lies beside the part's folder, not in
    it, because a part made from other inputs is cleared whole (``PartStore``)."""
    root = Path(root)
    with sole_writer(lock_beside(root / part_dir_name(part)), f"writing extraction part {part}",
                     str(root / part_dir_name(part)), ExtractionError) as path:
        yield path


class PartStore:
    """Writes one extraction part's shards; knows which shards are already complete.

    ``fingerprint`` identifies what the shards are made from (model, samples, layers, dtype):
    a store holding shards of another fingerprint is cleared rather than resumed, since mixing
    them would hand training states that belong to other tokens. ``read_soon``: each shard is read
    back soon after it is written (the online window), so its files are left in the page cache
    (``SafetensorsStream``).
    """

    def __init__(self, root: str | Path, part: int, *, fingerprint: str, dtype: str,
                 hidden_size: int, layer_ids: Sequence[int], model_dtype: str | None = None,
                 read_soon: bool = False) -> None:
        if dtype not in STORAGE_DTYPES:
            raise ExtractionError(f"unknown storage dtype {dtype!r}", where="extraction.dtype",
                                  fix=f"use one of {sorted(STORAGE_DTYPES)}")
        self.root = Path(root)
        self.part = part
        self.read_soon = read_soon
        self.dir = self.root / part_dir_name(part)
        self.meta = {
            "fingerprint": fingerprint, "dtype": dtype, "hidden_size": hidden_size,
            "layer_ids": sorted(layer_ids), "model_dtype": model_dtype,
        }
        self._open()

    @property
    def layer_ids(self) -> list[int]:
        return self.meta["layer_ids"]

    def _open(self) -> None:
        meta_path = self.dir / "store.json"
        if meta_path.exists():
            try:
                stored = read_json(meta_path)
            except (OSError, ValueError) as e:
                # Each shard's manifest names its fingerprint too, so the shards are checked one by one.
                log.warning("part %d: %s is unreadable (%s); rewriting it", self.part, meta_path, e)
                meta_path.unlink()
            else:
                if stored != self.meta:
                    log.warning("part %d: shards in %s were made from other inputs or settings; clearing them",
                                self.part, self.dir)
                    shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".shard-*.tmp-*"):  # left by a crash mid-shard
            shutil.rmtree(stale, ignore_errors=True)
        if not meta_path.exists():
            atomic_write_json(meta_path, self.meta)

    def shard_info(self, shard: int) -> ShardInfo | None:
        """The shard's info if it is complete on disk, else None (a corrupt shard is removed)."""
        path = self.dir / shard_dir_name(shard)
        if not path.is_dir():
            return None
        try:
            manifest = load_shard_manifest(path)
        except DamagedShard as e:
            problem = str(e)
        else:
            info = shard_info_from_manifest(manifest)
            problem = check_files(path, info.checksums)
            if problem is None and manifest.get("fingerprint") != self.meta["fingerprint"]:
                problem = "it was made from other inputs or settings"
        if problem:
            log.warning("part %d shard %d is damaged (%s); it will be extracted again", self.part, shard, problem)
            shutil.rmtree(path)
            return None
        return info

    def open_shard(self, shard: int, num_tokens: int) -> ShardWriter:
        """Start writing shard ``shard`` of ``num_tokens`` tokens; its rows are appended batch by batch."""
        return ShardWriter(self, shard, num_tokens)

    def write_shard(self, shard: int, sample_ids: Sequence[str], input_ids: Sequence[Sequence[int]],
                    loss_masks: Sequence[Sequence[int]], states: dict[int, torch.Tensor]) -> ShardInfo:
        """Write one whole shard's tokens and per-layer states; visible only once complete."""
        writer = self.open_shard(shard, sum(len(ids) for ids in input_ids))
        try:
            writer.append(states)
            return writer.commit(sample_ids, input_ids, loss_masks)
        except BaseException:
            writer.abort()
            raise

    def finish(self, shards: Sequence[ShardInfo], manifest_path: str | Path) -> dict:
        """Write the part's manifest (the extraction rule's output) listing its shards in order."""
        manifest = {
            "format": INDEX_FORMAT, "part": self.part, **self.meta,
            "store": str(self.dir.relative_to(self.root)),
            "shards": [asdict(s) for s in sorted(shards, key=lambda s: s.shard)],
        }
        atomic_write_json(manifest_path, manifest)
        return manifest


class ShardWriter:
    """One shard being written: rows are appended to every layer file as batches arrive, so the
    bytes reach the disk while the target computes, and only the last batch's write and the syncs
    remain when the shard ends. Files live in a hidden temporary folder renamed into place by
    ``commit``; a crash or ``abort`` leaves no visible shard.
    """

    def __init__(self, store: PartStore, shard: int, num_tokens: int) -> None:
        self.store, self.shard, self.num_tokens = store, shard, num_tokens
        self.rows = 0
        self.tmp = store.dir / f".{shard_dir_name(shard)}.tmp-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        self.fp8 = store.meta["dtype"] == "fp8"
        hidden = store.meta["hidden_size"]
        # fp8: each layer's per-token scales, copied in as batches arrive. A copy, not the blocks
        # themselves: a capture's rows are views of a whole mapped pass file, which would otherwise
        # stay held (in /dev/shm) until the shard ends.
        self.scales = {i: torch.empty(num_tokens if self.fp8 else 0, dtype=torch.float32) for i in store.layer_ids}
        try:
            # fp8: the values stream first and the small per-token scales follow at the end.
            layout = [("hidden_states", STORAGE_DTYPES[store.meta["dtype"]], (num_tokens, hidden))]
            if self.fp8:
                layout.append(("scales", torch.float32, (num_tokens,)))
            self.files = {i: SafetensorsStream(self.tmp / layer_file(i), layout, read_soon=store.read_soon)
                          for i in store.layer_ids}
        except BaseException:
            self.abort()
            raise
        # One thread per file: writing, hashing and fsync release the GIL, so the layer files
        # reach the disk side by side rather than one after the other.
        self.pool = ThreadPoolExecutor(max_workers=min(8, len(self.files)), thread_name_prefix="shard-file")

    def append(self, states: dict[int, CapturedRows | Sequence[CapturedRows]]) -> None:
        """The next rows of every layer: a [n, hidden] block, or consecutive row blocks of one. A
        tensor (any float dtype) is converted to the storage dtype; an fp8 store takes ``Fp8Rows``
        (quantised where they were captured) as they are."""
        if sorted(states) != self.store.layer_ids:
            raise ExtractionError(f"shard {self.shard} got layers {sorted(states)}, the store expects "
                                  f"{self.store.layer_ids}", where=f"part {self.store.part}")
        blocks = {i: [t] if isinstance(t, (torch.Tensor, Fp8Rows)) else list(t) for i, t in states.items()}
        if not self.fp8 and any(isinstance(b, Fp8Rows) for layer in blocks.values() for b in layer):
            self.abort()
            raise ExtractionError(f"shard {self.shard}: fp8 rows for a {self.store.meta['dtype']} store; the "
                                  "shard is dropped", where=f"part {self.store.part} shard {self.shard}",
                                  fix="quantise in the capture only when extraction.dtype is fp8")
        hidden = self.store.meta["hidden_size"]
        counts = {i: sum(b.shape[0] for b in layer) for i, layer in blocks.items()}
        rows = next(iter(counts.values()))
        shapes = {tuple(b.shape[1:]) for layer in blocks.values() for b in layer}
        if set(counts.values()) != {rows} or shapes != {(hidden,)} or self.rows + rows > self.num_tokens:
            self.abort()
            raise ExtractionError(
                f"shard {self.shard}: rows per layer {counts} of widths {sorted(shapes)} do not fit the shard "
                f"({self.rows} of {self.num_tokens} rows written, hidden {hidden}); the shard is dropped",
                where=f"part {self.store.part} shard {self.shard}")
        storage = STORAGE_DTYPES[self.store.meta["dtype"]]
        first = self.rows

        def write(layer_id: int) -> None:
            stream = self.files[layer_id]
            if self.fp8:
                row = first
                for block in blocks[layer_id]:
                    fp8 = block if isinstance(block, Fp8Rows) else Fp8Rows(*quantize_fp8(block))
                    self.scales[layer_id][row:row + fp8.shape[0]].copy_(fp8.scales)
                    row += fp8.shape[0]
                    stream.write(fp8.values)
            else:
                for block in blocks[layer_id]:
                    stream.write(block.to(storage))
            stream.start_writeback()

        try:
            list(self.pool.map(write, self.store.layer_ids))
        except BaseException:
            self.abort()
            raise
        self.rows += rows

    def commit(self, sample_ids: Sequence[str], input_ids: Sequence[Sequence[int]],
               loss_masks: Sequence[Sequence[int]]) -> ShardInfo:
        """Finish the files, write the tokens and the manifest, sync, and rename the shard into place;
        on any failure the shard is dropped."""
        lengths = [len(ids) for ids in input_ids]

        def close(layer_id: int) -> str:
            if self.fp8:
                self.files[layer_id].write(self.scales[layer_id])
            return self.files[layer_id].close()

        try:
            if sum(lengths) != self.num_tokens or self.rows != self.num_tokens:
                raise ExtractionError(f"shard {self.shard}: {self.rows} rows of states for {sum(lengths)} tokens "
                                      f"(the shard was opened for {self.num_tokens})",
                                      where=f"part {self.store.part} shard {self.shard}")
            checksums = {TOKENS_FILE: write_safetensors(self.tmp / TOKENS_FILE,
                                                        _tokens_tensors(input_ids, loss_masks, lengths),
                                                        read_soon=self.store.read_soon)}
            checksums.update(zip(map(layer_file, self.store.layer_ids), self.pool.map(close, self.store.layer_ids)))
            store = self.store
            info = ShardInfo(
                part=store.part, shard=self.shard, path=f"{store.dir.name}/{shard_dir_name(self.shard)}",
                num_samples=len(sample_ids), num_tokens=self.num_tokens,
                num_loss_tokens=int(sum(sum(m) for m in loss_masks)), checksums=checksums,
            )
            atomic_write_bytes(self.tmp / SHARD_MANIFEST, shard_manifest_bytes(
                {**asdict(info), "fingerprint": store.meta["fingerprint"], "sample_ids": list(sample_ids)}))
            final = store.dir / shard_dir_name(self.shard)
            if final.exists():
                shutil.rmtree(final)
            self.tmp.rename(final)
            fsync_dir(store.dir)
        except BaseException:
            self.abort()
            raise
        self.pool.shutdown()
        return info

    def abort(self) -> None:
        """Drop the shard: close and remove its temporary folder."""
        try:
            pool = getattr(self, "pool", None)
            if pool is not None:
                pool.shutdown(wait=True)
            for stream in getattr(self, "files", {}).values():
                stream.discard()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _tokens_tensors(input_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]],
                    lengths: list[int]) -> dict[str, torch.Tensor]:
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    flat_ids = [t for ids in input_ids for t in ids]
    flat_mask = [m for mask in loss_masks for m in mask]
    return {
        "input_ids": torch.tensor(flat_ids, dtype=torch.int64),
        "loss_mask": torch.tensor(flat_mask, dtype=torch.uint8),
        "offsets": offsets,
    }
