"""Figures for the report: training curves from train/metrics.jsonl, acceptance from eval/acceptance.json.

Figures are drawn on matplotlib ``Figure`` objects with the Agg canvas (no pyplot, no display, no
global state) and written atomically as PNG.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path

from draftsmith.errors import EvaluationError, TrainingError
from draftsmith.io import atomic_write_bytes, read_json, read_jsonl
from draftsmith.payoff import measured_range

DPI = 120
DRAFT_COLOR, BASELINE_COLOR = "#1f77b4", "#ff7f0e"


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, out_path: str | Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write_bytes(out_path, buffer.getvalue())
    return Path(out_path)


def _log_scale(ax, which: str, base: float = 10) -> None:
    """A log scale whose tick labels are plain text (0.2, 1, 10). The default labels are mathtext
    (10^0), and the first mathtext of a process loads its fallback families (STIX, Computer Modern):
    where matplotlib's font cache lacks them (a cache another matplotlib wrote without its bundled
    fonts), each logs a findfont warning, about 20 in the rule's log."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        def __call__(self, x, pos=None):  # LogFormatter picks the ticks to label, %g writes them
            return self.fix_minus(f"{x:g}") if super().__call__(x, pos) else ""

    getattr(ax, f"set_{which}scale")("log", base=base)
    axis = getattr(ax, f"{which}axis")
    axis.set_major_formatter(PlainLogFormatter(base))
    axis.set_minor_formatter(PlainLogFormatter(base, labelOnlyBase=False))


def _nan(values: Sequence) -> list[float]:
    """None (a ratio with nothing to count) -> NaN, which matplotlib leaves as a gap."""
    return [math.nan if v is None else float(v) for v in values]


# ---------------------------------------------------------------------------------------------
# Training


def read_metrics(path: str | Path) -> list[dict]:
    """The rows draftsmith.train logs: step, and per TTT step lists loss, acc (None where a step had
    no positions to score), plus the simulated acceptance length tau."""
    rows = []
    for lineno, row in read_jsonl(path, error=TrainingError,
                                  fix="rerun train_draft (it rewrites metrics.jsonl on resume)"):
        missing = [k for k in ("step", "loss", "acc") if k not in row]
        if missing or not isinstance(row["loss"], list) or not isinstance(row["acc"], list):
            raise TrainingError(f"a metrics row lacks {missing or 'per-step lists of loss and acc'}",
                                where=f"{path}:{lineno}",
                                fix="metrics.jsonl must come from draftsmith.train; rerun train_draft")
        rows.append(row)
    return rows


def plot_training(metrics_jsonl: str | Path, out_path: str | Path) -> Path:
    """Loss and accuracy of each TTT step, and the simulated acceptance length, over optimizer steps."""
    rows = read_metrics(metrics_jsonl)
    fig = _figure(13, 4)
    axes = fig.subplots(1, 3)
    if not rows:
        fig.suptitle("Draft training")
        for ax in axes:
            ax.set_axis_off()
        axes[1].text(0.5, 0.5, "no metrics were logged\n(the run had fewer steps than train.log_every)",
                     ha="center", va="center", fontsize=12)
        return _save(fig, out_path)
    steps = [r["step"] for r in rows]
    ttt = max(len(r["loss"]) for r in rows)
    colors = [f"C{j}" for j in range(ttt)]
    for key, ax, title, ylabel in (("loss", axes[0], "Loss per TTT step", "KL divergence to the target"),
                                   ("acc", axes[1], "Accuracy per TTT step", "top-1 agreement with the target")):
        for j in range(ttt):
            values = _nan([r[key][j] if j < len(r[key]) else None for r in rows])
            ax.plot(steps, values, color=colors[j], marker="o" if len(steps) < 30 else None, markersize=3,
                    label=f"step {j}")
            last = next((v for v in reversed(values) if not math.isnan(v)), None)
            if last is not None:
                ax.annotate(f"{last:.3g}", (steps[-1], last), textcoords="offset points", xytext=(4, 0),
                            fontsize=8, color=colors[j], va="center")
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(title="TTT step", fontsize=8)
    losses = [v for r in rows for v in r["loss"] if v is not None]
    if losses and min(losses) > 0 and max(losses) / min(losses) > 10:  # a log axis only where it spreads things
        _log_scale(axes[0], "y")
    axes[1].set_ylim(0, 1)
    tau = _nan([r.get("tau") for r in rows])
    ax = axes[2]
    ax.plot(steps, tau, color="C3", marker="o" if len(steps) < 30 else None, markersize=3)
    ax.axhline(ttt + 1, color="grey", linestyle="--", linewidth=1, label=f"maximum with {ttt} TTT steps")
    last = next((v for v in reversed(tau) if not math.isnan(v)), None)
    if last is not None:
        ax.annotate(f"{last:.2f}", (steps[-1], last), textcoords="offset points", xytext=(4, 0), fontsize=8,
                    color="C3", va="center")
    ax.set_title("Acceptance length τ expected from training")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("1 + Σ_j P(TTT steps 0..j all right)")  # no mathtext: see _log_scale
    ax.set_ylim(1, ttt + 1.2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"Draft training: {len(rows)} logged points, last at step {steps[-1]}")
    return _save(fig, out_path)


# ---------------------------------------------------------------------------------------------
# Evaluation


def _read_acceptance(path: str | Path) -> dict:
    result = read_json(path)
    missing = [k for k in ("tau", "acceptance_rate_by_position", "baseline", "tau_by_k", "settings")
               if k not in result]
    if missing:
        raise EvaluationError(f"acceptance.json lacks {missing}", where=str(path), fix="rerun evaluate_draft")
    return result


def _label(result: dict) -> tuple[str, str]:
    baseline = result["baseline"]
    name = f"n-gram baseline (n ≤ {baseline['ngram_max']})" if baseline.get("kind") == "ngram" \
        else f"baseline ({baseline.get('kind')})"
    return "EAGLE-3 draft", name


def plot_acceptance_by_position(acceptance_json: str | Path, out_path: str | Path) -> Path:
    """Grouped bars: the share of verification steps whose draft token j was accepted."""
    result = _read_acceptance(acceptance_json)
    draft, baseline = _nan(result["acceptance_rate_by_position"]), _nan(result["baseline"]["acceptance_rate_by_position"])
    names = _label(result)
    k = max(len(draft), len(baseline))
    fig = _figure(max(6, 1.1 * k + 3), 4.5)
    ax = fig.subplots()
    width = 0.38
    speedup = result.get("speedup") or {}
    for offset, values, name, color, tau, faster in (
            (-width / 2, draft, names[0], DRAFT_COLOR, result["tau"], speedup.get("draft")),
            (width / 2, baseline, names[1], BASELINE_COLOR, result["baseline"]["tau"], speedup.get("baseline"))):
        xs = [j + 1 + offset for j in range(len(values))]
        label = f"{name}: τ = {'n/a' if tau is None else f'{tau:.2f}'}"
        if faster:
            label += f", {faster:.2f}× greedy speed"
        bars = ax.bar(xs, [0 if math.isnan(v) else v for v in values], width, color=color, label=label)
        ax.bar_label(bars, labels=["n/a" if math.isnan(v) else f"{v:.2f}" for v in values], fontsize=8, padding=2)
    ax.set_xticks(range(1, k + 1))
    ax.set_xlabel("draft position j (1 = first draft token of a step)")
    ax.set_ylabel("acceptance rate (share of verification steps)")
    ax.set_ylim(0, 1.1)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=9)
    ax.set_title(f"Acceptance by draft position, k = {result['settings']['k']}, "
                 f"{result['num_prompts']} prompts, {result['num_steps']} steps")
    return _save(fig, out_path)


def plot_tau_vs_k(acceptance_json: str | Path, out_path: str | Path) -> Path:
    """Mean acceptance length τ against the number of draft tokens per step, with the ceiling k + 1."""
    result = _read_acceptance(acceptance_json)
    sweep = result["tau_by_k"]
    ks = sweep["k"]
    names = _label(result)
    fig = _figure(6.5, 4.5)
    ax = fig.subplots()
    ax.plot(ks, [k + 1 for k in ks], color="grey", linestyle="--", linewidth=1, label="ceiling (every token accepted)")
    for values, name, color, below in ((sweep["draft"], names[0], DRAFT_COLOR, False),
                                       (sweep["baseline"], names[1], BASELINE_COLOR, True)):
        ys = _nan(values)
        ax.plot(ks, ys, color=color, marker="o", label=name)
        for k, y in zip(ks, ys):
            if not math.isnan(y):
                ax.annotate(f"{y:.2f}", (k, y), textcoords="offset points", xytext=(0, -13 if below else 7),
                            ha="center", fontsize=8, color=color)
    ax.set_xticks(ks)
    ax.set_xlabel("draft tokens per verification step k")
    ax.set_ylabel("mean acceptance length τ")
    ax.set_ylim(bottom=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    ax.set_title(f"τ against k ({sweep.get('prompts', 'all')} prompts)" if sweep.get("prompts") != "all"
                 else f"τ against k ({sweep['num_prompts']} prompts)")
    return _save(fig, out_path)


def plot_prompt_sets(acceptance_json: str | Path, out_path: str | Path) -> Path:
    """τ of the draft and the baseline on each prompt set (held-out split first, then eval.sources),
    and the draft's acceptance by position on each."""
    result = _read_acceptance(acceptance_json)
    sets = {"held-out": result, **(result.get("sources") or {})}
    names = _label(result)
    fig = _figure(max(11, 1.4 * len(sets) + 7), 4.5)
    bars_ax, position_ax = fig.subplots(1, 2)
    width = 0.38
    xs = range(len(sets))
    for offset, pick, name, color in ((-width / 2, lambda r: r["tau"], names[0], DRAFT_COLOR),
                                      (width / 2, lambda r: r["baseline"]["tau"], names[1], BASELINE_COLOR)):
        values = _nan([pick(r) for r in sets.values()])
        bars = bars_ax.bar([x + offset for x in xs], [0 if math.isnan(v) else v for v in values], width,
                           color=color, label=name)
        bars_ax.bar_label(bars, labels=["n/a" if math.isnan(v) else f"{v:.2f}" for v in values], fontsize=8,
                          padding=2)
    bars_ax.set_xticks(list(xs), [f"{n}\n({r['num_prompts']} prompts)" for n, r in sets.items()], fontsize=8)
    bars_ax.set_ylabel("mean acceptance length τ")
    bars_ax.set_title(f"τ by prompt set, k = {result['settings']['k']}")
    bars_ax.grid(axis="y", alpha=0.3)
    bars_ax.legend(fontsize=9)
    for i, (name, found) in enumerate(sets.items()):
        rates = _nan(found["acceptance_rate_by_position"])
        position_ax.plot(range(1, len(rates) + 1), rates, marker="o", color=f"C{i}", label=name)
    position_ax.set_xticks(range(1, len(result["acceptance_rate_by_position"]) + 1))
    position_ax.set_xlabel("draft position j")
    position_ax.set_ylabel("acceptance rate (share of verification steps)")
    position_ax.set_ylim(0, 1.05)
    position_ax.grid(alpha=0.3)
    position_ax.legend(fontsize=8, title=names[0])
    position_ax.set_title("The draft's acceptance by position, per prompt set")
    return _save(fig, out_path)


def plot_evaluation(acceptance_json: str | Path, by_position_png: str | Path, tau_vs_k_png: str | Path,
                    prompt_sets_png: str | Path) -> None:
    """The evaluation figures from one acceptance.json."""
    plot_acceptance_by_position(acceptance_json, by_position_png)
    plot_tau_vs_k(acceptance_json, tau_vs_k_png)
    plot_prompt_sets(acceptance_json, prompt_sets_png)


def plot_payoff(payoff_json: str | Path, out_path: str | Path) -> Path:
    """Expected decode speedup against the batch size, one line per k, for the draft and the baseline;
    a k beyond the positions evaluation measured (its rates extrapolated) dashed, with hollow markers."""
    payoff = read_json(payoff_json)
    batches = payoff["batch_sizes"]
    fig = _figure(12, 4.5)
    axes = fig.subplots(1, 2, sharey=True)
    server = payoff["server"]
    for ax, name, title in ((axes[0], "draft", "EAGLE-3 draft"), (axes[1], "baseline", "n-gram baseline")):
        drafter = payoff[name]
        ax.set_title(title)
        if drafter["speedup"] is None:
            ax.text(0.5, 0.5, "not estimated:\n" + drafter["not_measured"].replace(" (", "\n("), ha="center",
                    va="center", transform=ax.transAxes, fontsize=9, wrap=True)
            continue
        kinds = drafter.get("acceptance_at_k") or ["measured"] * len(payoff["k"])  # payoff.json before it
        for i, (k, row, kind) in enumerate(zip(payoff["k"], drafter["speedup"], kinds)):
            extrapolated = kind == "extrapolated"
            ax.plot(batches, row, color=f"C{i}", marker="o", markersize=4 if extrapolated else 3,
                    linestyle="--" if extrapolated else "-", markerfacecolor="none" if extrapolated else f"C{i}",
                    label=f"k = {k} (extrapolated)" if extrapolated else f"k = {k}")
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        _log_scale(ax, "x", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("concurrent sequences (batch)")
        ax.grid(alpha=0.3)
        note = None
        if "extrapolated" in kinds:
            note = (f"dashed, hollow: acceptance extrapolated\nbeyond the measured "
                    f"{measured_range(drafter['measured_positions'])}")
        ax.legend(fontsize=8, title=note, title_fontsize=8)
    axes[0].set_ylabel("expected decode speedup (below 1: slower)")
    target = payoff["target"]
    shape = (f"MoE, {target['experts']} experts top-{target['top_k']}" if target["kind"] == "moe" else "dense")
    fig.suptitle(f"Expected speedup on {server['tensor_parallel_size']}× {server['gpu'].upper()} "
                 f"({shape}, {target['active_params'] / 1e9:.1f}B active), context {server['context_tokens']} "
                 "tokens: a cost model (docs/payoff.md)")
    return _save(fig, out_path)
