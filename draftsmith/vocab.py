"""The draft vocabulary: the target tokens the assistant writes most, and the d2t/t2d mapping."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as save_safetensors

from draftsmith.errors import ConfigError, DataError
from draftsmith.io import atomic_write_bytes, atomic_write_json, parse_jsonl_lines, read_jsonl_chunks
from draftsmith.parallel import ordered_map

log = logging.getLogger(__name__)

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32000, 65536)
# Coverage of the training tokens below which the draft is refused (it could propose at most one
# token in two), and below which a warning suggests a larger vocabulary.
MIN_COVERAGE = 0.5
WARN_COVERAGE = 0.9


# Bytes of train.jsonl a worker counts at a time: enough lines that adding up a chunk's counts (one
# array of the vocabulary's size) costs little beside parsing them.
CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class _CountChunk:
    """The loss-masked token counts of a chunk of train.jsonl's lines, in a worker."""

    path: str
    vocab_size: int

    def __call__(self, chunk: tuple[int, list[bytes]]) -> np.ndarray:
        masked = [np.zeros(0, dtype=np.int64)]
        for _, row in parse_jsonl_lines(self.path, *chunk, error=DataError, fix="rerun the prepare_dataset rule"):
            masked.append(np.asarray(row["input_ids"], dtype=np.int64)[np.asarray(row["loss_mask"], dtype=bool)])
        # One count over the chunk: a count per row would cost the vocabulary's size for every row.
        return np.bincount(np.concatenate(masked), minlength=self.vocab_size)[: self.vocab_size]


def count_loss_tokens(train_jsonl: str | Path, vocab_size: int, workers: int = 1) -> np.ndarray:
    """How often each target token appears where the loss mask is on (tokens the draft must
    predict), counted by ``workers`` processes."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    with ordered_map(_CountChunk(str(train_jsonl), vocab_size), workers) as run:
        for part in run(read_jsonl_chunks(train_jsonl, CHUNK_BYTES)):
            counts += part
    return counts


def select_draft_tokens(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """The ``draft_vocab_size`` most frequent ids, ascending; ties and unseen tokens by lower id."""
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id asc
    return np.sort(order[:draft_vocab_size])


def mapping_tensors(draft_ids: np.ndarray, target_vocab_size: int) -> dict[str, torch.Tensor]:
    """vLLM/speculators convention: target id = i + d2t[i]; t2d[t] marks target ids in the draft vocab."""
    ids = torch.from_numpy(draft_ids).long()
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(len(ids)), "t2d": t2d}


def coverage_curve(counts: np.ndarray) -> dict[int, float]:
    total = max(int(counts.sum()), 1)
    ranked = np.sort(counts)[::-1].cumsum()
    return {k: float(ranked[min(k, len(ranked)) - 1] / total) for k in COVERAGE_SIZES if k <= len(counts)}


def size_for_coverage(counts: np.ndarray, coverage: float) -> int:
    """The smallest draft vocabulary that covers ``coverage`` of the loss-masked tokens."""
    ranked = np.sort(counts)[::-1].cumsum()
    return int(np.searchsorted(ranked, coverage * max(int(counts.sum()), 1))) + 1


def build_vocab_mapping(train_jsonl: str | Path, target_vocab_size: int, draft_vocab_size: int,
                        mapping_path: str | Path, stats_path: str | Path, workers: int = 1) -> dict:
    """Write ``mapping.safetensors`` (d2t, t2d) and ``stats.json`` (coverage of loss-masked tokens),
    the tokens counted by ``workers`` processes."""
    if draft_vocab_size > target_vocab_size:
        raise ConfigError(
            f"draft_vocab_size {draft_vocab_size} is larger than the target's vocabulary ({target_vocab_size})",
            where="vocab.draft_vocab_size", fix=f"use at most {target_vocab_size}")
    counts = count_loss_tokens(train_jsonl, target_vocab_size, workers)
    draft_ids = select_draft_tokens(counts, draft_vocab_size)
    total = int(counts.sum())
    covered = int(counts[draft_ids].sum())
    stats = {
        "target_vocab_size": target_vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "loss_tokens": total,
        "distinct_loss_tokens": int((counts > 0).sum()),
        "coverage": covered / total if total else 0.0,
        "coverage_by_draft_vocab_size": coverage_curve(counts),
    }
    if total and stats["coverage"] < MIN_COVERAGE:
        raise ConfigError(
            f"a draft vocabulary of {draft_vocab_size} tokens covers only {stats['coverage']:.1%} of the "
            f"{total:,} loss-masked training tokens ({stats['distinct_loss_tokens']:,} distinct): the draft "
            f"could not propose most of what the target writes", where="vocab.draft_vocab_size",
            fix=f"raise vocab.draft_vocab_size to at least {size_for_coverage(counts, WARN_COVERAGE)} "
                f"({WARN_COVERAGE:.0%} coverage)")
    if total and stats["coverage"] < WARN_COVERAGE:
        log.warning("the draft vocabulary covers only %.1f%% of the loss-masked tokens; "
                    "vocab.draft_vocab_size: %d would cover %.0f%%", 100 * stats["coverage"],
                    size_for_coverage(counts, WARN_COVERAGE), 100 * WARN_COVERAGE)
    atomic_write_bytes(mapping_path, save_safetensors(mapping_tensors(draft_ids, target_vocab_size)))
    atomic_write_json(stats_path, stats)
    log.info("draft vocab of %d tokens covers %.2f%% of %d loss-masked tokens (%d distinct)",
             draft_vocab_size, 100 * stats["coverage"], total, stats["distinct_loss_tokens"])
    return stats
