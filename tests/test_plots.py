"""Report figures from small synthetic inputs shaped like what the trainer and the evaluator write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

import tiny
from draftsmith import plots
from draftsmith.errors import TrainingError
from draftsmith.plots import plot_evaluation, plot_payoff, plot_prompt_sets, plot_training


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


def _payoff_json(tmp_path) -> Path:
    """payoff.json as estimate_payoff writes it (the keys the plot reads): evaluation measured k = 1..3."""
    kinds = ["measured"] * 3 + ["extrapolated"] * 2
    drafter = {"measured_positions": 3, "acceptance_at_k": kinds,
               "speedup": [[1.2 + 0.1 * k, 0.9 - 0.05 * k] for k in range(5)]}
    payoff = {"batch_sizes": [1, 16], "k": [1, 2, 3, 4, 5], "draft": drafter, "baseline": drafter,
              "server": {"tensor_parallel_size": 1, "gpu": "h100", "context_tokens": 2048},
              "target": {"kind": "dense", "active_params": 8e9}}
    path = tmp_path / "payoff.json"
    path.write_text(json.dumps(payoff))
    return path


def _drawn_figure(monkeypatch) -> dict:
    """Keeps the figure a plot function saves, to read its artists (labels, line styles), not pixels."""
    drawn = {}

    def save(fig, out_path):
        drawn["figure"] = fig
        return Path(out_path)

    monkeypatch.setattr(plots, "_save", save)
    return drawn


def test_payoff_figure_marks_the_extrapolated_k(tmp_path, monkeypatch):
    _png(plot_payoff(_payoff_json(tmp_path), tmp_path / "payoff.png"))
    drawn = _drawn_figure(monkeypatch)
    plot_payoff(_payoff_json(tmp_path), tmp_path / "payoff.png")
    for ax in drawn["figure"].axes:
        lines = {line.get_label(): line for line in ax.get_lines() if line.get_label().startswith("k = ")}
        assert list(lines) == ["k = 1", "k = 2", "k = 3", "k = 4 (extrapolated)", "k = 5 (extrapolated)"]
        for label, line in lines.items():  # dashed with hollow markers exactly where extrapolated
            extrapolated = "extrapolated" in label
            assert (line.get_linestyle() == "--") == extrapolated
            assert (line.get_markerfacecolor() == "none") == extrapolated
        legend = ax.get_legend()
        assert [t.get_text() for t in legend.get_texts()] == list(lines)
        assert legend.get_title().get_text() == "dashed, hollow: acceptance extrapolated\nbeyond the measured k=1..3"


def test_payoff_figure_of_measured_k_alone_has_no_note(tmp_path, monkeypatch):
    path = _payoff_json(tmp_path)
    payoff = json.loads(path.read_text())
    payoff["k"] = [1, 2, 3]
    for name in ("draft", "baseline"):
        payoff[name] = {**payoff[name], "acceptance_at_k": ["measured"] * 3, "speedup": payoff[name]["speedup"][:3]}
    path.write_text(json.dumps(payoff))
    drawn = _drawn_figure(monkeypatch)
    plot_payoff(path, tmp_path / "payoff.png")
    for ax in drawn["figure"].axes:
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["k = 1", "k = 2", "k = 3"]
        assert not ax.get_legend().get_title().get_text()
        assert {line.get_linestyle() for line in ax.get_lines() if line.get_label().startswith("k = ")} == {"-"}


def test_figures_log_no_findfont_warning(tmp_path, caplog, monkeypatch):
    """The fonts of the figures are the default family alone: on a font cache that lists nothing else
    (one written by a matplotlib without its bundled STIX and Computer Modern fonts), rendering logs
    no "findfont: Font family ... not found" warning. Log axes and τ's label once pulled in mathtext."""
    from matplotlib import font_manager

    manager = font_manager.fontManager
    monkeypatch.setattr(manager, "ttflist", [f for f in manager.ttflist if f.name == "DejaVu Sans"])
    manager._findfont_cached.cache_clear()
    rows = [_metrics_row(s) for s in range(10, 210, 10)]  # its loss spans two decades: a log axis
    try:
        with caplog.at_level("WARNING"):
            plot_training(tiny.write_jsonl(tmp_path / "metrics.jsonl", rows), tmp_path / "curves.png")
            plot_payoff(_payoff_json(tmp_path), tmp_path / "payoff.png")
    finally:
        manager._findfont_cached.cache_clear()  # no font found on the short list outlives the test
    assert not [r.getMessage() for r in caplog.records if "findfont" in r.getMessage()]
