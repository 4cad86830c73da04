"""Report figures from small synthetic inputs shaped like what the trainer and the evaluator write."""

from __future__ import annotations

import json

import pytest
from PIL import Image

import tiny
from draftsmith.errors import TrainingError
from draftsmith.plots import plot_evaluation, plot_prompt_sets, plot_training


def _png(path, min_width=400):
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width >= min_width
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is None or len(colors) > 10  # something was drawn


def _metrics_row(step, ttt=3):
    # As draftsmith.train logs it: per-TTT-step lists (None where a step had no positions), tau.
    loss = [2.0 / (1 + step) * (1 + 0.3 * j) for j in range(ttt)]
    acc = [min(0.9, 0.1 + 0.02 * step) * 0.8 ** j for j in range(ttt)]
    return {"step": step, "epoch": 0, "lr": 1e-3, "tokens": 4096 * step, "tokens_per_s": 1e4, "grad_norm": 0.5,
            "loss": loss, "acc": acc, "cond_acc": acc, "joint_acc": acc, "tau": 1 + sum(acc),
            "tokens_scored": 4000.0}


def test_training_curves(tmp_path):
    rows = [_metrics_row(s) for s in range(10, 210, 10)]
    rows[3]["loss"][2] = rows[3]["acc"][2] = None
    metrics = tiny.write_jsonl(tmp_path / "metrics.jsonl", rows)
    out = plot_training(metrics, tmp_path / "train" / "training_curves.png")
    _png(out, min_width=1000)


def test_training_curves_without_logged_steps(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    _png(plot_training(metrics, tmp_path / "curves.png"))


def test_training_curves_reject_foreign_rows(tmp_path):
    metrics = tiny.write_jsonl(tmp_path / "metrics.jsonl", [_metrics_row(10), {"step": 20, "loss": 1.0}])
    with pytest.raises(TrainingError, match="metrics.jsonl:2"):
        plot_training(metrics, tmp_path / "curves.png")


def test_evaluation_figures(tmp_path):
    acceptance = {
        "format": "draftsmith.acceptance/1", "tau": 2.4, "acceptance_rate_by_position": [0.7, 0.45, 0.25],
        "num_prompts": 48, "num_tokens": 3000, "num_steps": 1250,
        "draft": {"kind": "eagle3", "path": "results/demo/draft"},
        "baseline": {"kind": "ngram", "ngram_max": 3, "tau": 1.3, "acceptance_rate_by_position": [0.2, 0.08, 0.02],
                     "num_prompts": 48, "num_tokens": 3000, "num_steps": 2300},
        "tau_by_k": {"k": [1, 2, 3, 4, 5], "draft": [1.7, 2.1, 2.4, 2.5, 2.55],
                     "baseline": [1.2, 1.28, 1.3, None, 1.31], "num_prompts": 16},
        "speedup": {"draft": 1.4, "baseline": 1.1},
        "settings": {"k": 3, "k_sweep": [1, 2, 3, 4, 5]},
    }
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps(acceptance))
    plot_evaluation(path, tmp_path / "by_position.png", tmp_path / "tau_vs_k.png", tmp_path / "sets.png")
    _png(tmp_path / "by_position.png")
    _png(tmp_path / "tau_vs_k.png")
    _png(tmp_path / "sets.png")  # the held-out split alone

    # each eval.sources set beside the held-out split, one with a position never reached
    acceptance["sources"] = {
        "mt-bench": {**acceptance, "tau": 1.9, "num_prompts": 80, "acceptance_rate_by_position": [0.6, 0.3, None],
                     "baseline": {**acceptance["baseline"], "tau": 1.1}},
        "gsm8k": {**acceptance, "num_prompts": 64},
    }
    path.write_text(json.dumps(acceptance))
    _png(plot_prompt_sets(path, tmp_path / "sets.png"))
