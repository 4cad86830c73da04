"""What training reports: per-TTT-step loss and acceptance figures from the summed statistics, written
to metrics.jsonl, TensorBoard and the log by the main process, with a progress bar."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from draftsmith.io import atomic_write_text, read_jsonl, storage_error

log = logging.getLogger(__name__)


def summarize(stats: list[list[float]]) -> dict:
    """Per-step metrics from summed [K, 6] stats (``TTTObjective.forward``).

    ``loss`` and ``draft_vocab_acc`` (top-1 agreement with the teacher within the draft
    vocabulary, an upper bound of acc) cover every step since the last log; ``acc``, ``cond_acc``,
    ``joint_acc`` and ``tau`` (the acceptance vLLM would see: the target's argmax over its whole
    vocabulary) cover the logging step's batch, ``tokens_scored_exact`` positions.
    """
    out: dict[str, Any] = {"loss": [], "acc": [], "cond_acc": [], "joint_acc": [], "draft_vocab_acc": []}
    starts = stats[0][3] if stats else 0.0
    prev_chain = starts
    for kl, n, agree, checked, correct, chain in stats:  # None where a ratio has no positions to count
        out["loss"].append(kl / n if n else None)
        out["draft_vocab_acc"].append(agree / n if n else None)
        out["acc"].append(correct / checked if checked else None)
        out["cond_acc"].append(chain / prev_chain if prev_chain else None)
        out["joint_acc"].append(chain / starts if starts else None)
        prev_chain = chain
    # tau = 1 + E[accepted prefix length]; the accepted prefix has length >= j+1 exactly when
    # steps 0..j are all correct (chain), so E = sum_j P(chain_j), per start position.
    out["tau"] = 1.0 + sum(out["joint_acc"]) if starts else None
    out["tokens_scored"] = stats[0][1] if stats else 0.0
    out["tokens_scored_exact"] = starts
    return out


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop log lines past the resumed step, so metrics.jsonl reads like one uninterrupted run."""
    if not path.exists():
        return
    # rows are rewritten as _log_metrics wrote them (json.dumps); a line torn by a kill is dropped
    keep = [row for _, row in read_jsonl(path, error=None) if row.get("step", 0) <= step]
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in keep))


def _log_metrics(metrics_file, writer, entry: dict) -> None:
    metrics_file.write(json.dumps(entry) + "\n")
    metrics_file.flush()
    step = entry["step"]
    for key in ("lr", "tokens_per_s", "grad_norm", "tau"):
        if entry[key] is not None:
            writer.add_scalar(f"train/{key}", entry[key], step)
    for key in ("loss", "acc", "cond_acc", "joint_acc", "draft_vocab_acc"):
        for j, value in enumerate(entry[key]):
            if value is not None:
                writer.add_scalar(f"train/{key}_{j}", value, step)
    log.info("step %d: loss %s acc %s tau %s %.0f tok/s", step, _rounded(entry["loss"]), _rounded(entry["acc"]),
             _rounded(entry["tau"]), entry["tokens_per_s"])


def _rounded(x):
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return None if x is None else round(x, 4)


class RunLog:
    """metrics.jsonl, TensorBoard and the progress bar of the main process (the others log nothing).

    A resumed run (``start`` > 0) drops the lines past its step, so the files read like one run.
    """

    def __init__(self, work_dir: Path, start: int, step_tokens: list[int], *, main: bool, progress: bool) -> None:
        self.writer = self.metrics_file = self.progress = None
        if main:
            work_dir.mkdir(parents=True, exist_ok=True)
            _truncate_metrics(work_dir / "metrics.jsonl", start)
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(work_dir / "tensorboard"), purge_step=start if start else None)
            self.metrics_file = open(work_dir / "metrics.jsonl", "a", encoding="utf-8")
        if main and progress:
            from tqdm import tqdm

            self.progress = tqdm(total=sum(step_tokens), initial=sum(step_tokens[:start]), unit="tok",
                                 unit_scale=True, desc="train_draft", mininterval=2.0)

    def advance(self, tokens: int) -> None:
        if self.progress is not None:
            self.progress.update(tokens)

    def write(self, entry: dict) -> None:
        """Log one entry (``summarize``'s figures plus step, lr, tokens, throughput, gradient norm)."""
        if self.metrics_file is None:
            return
        try:
            _log_metrics(self.metrics_file, self.writer, entry)
        except OSError as e:  # a full disk: say so, not TensorBoard's thread
            raise storage_error(self.metrics_file.name, e) from e
        if self.progress is not None:
            self.progress.set_postfix(loss=_rounded(entry["loss"][0]), acc0=_rounded(entry["acc"][0]),
                                      tau=_rounded(entry["tau"]))

    def close(self) -> None:
        for sink in (self.progress, self.metrics_file, self.writer):
            if sink is not None:
                try:
                    sink.close()
                except OSError as e:
                    raise storage_error(getattr(sink, "name", None) or getattr(sink, "log_dir", "tensorboard"), e) from e
