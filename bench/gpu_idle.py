"""Where the GPU waits in a profiled run: its idle time between kernels, and what the host was doing
when the GPU ran dry, from a ``torch.profiler`` trace (``export_chrome_trace``, optionally gzipped).

For every gap between the device's work (kernels, copies, memsets; merged over streams), the next
piece of work was launched by a host thread (the launch's correlation id). If that launch came
after the gap opened, the host was late, and the gap is put down to the ops that thread was inside
when the GPU went idle (outermost and innermost; a synchronising call there is named as such). If it
came before, the work waited on something else (another stream, an event, the launch latency).

    python bench/gpu_idle.py TRACE.json.gz --steps 5      # a trace of 5 training steps

``bench/train_throughput.py --profile`` writes each trainer's trace and this report beside it.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

DEVICE_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCHES = {"cuda_runtime", "cuda_driver"}
HOST_RANGES = {"cpu_op", "user_annotation", "python_function"}


def load_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def _busy_intervals(work: list[dict]) -> list[tuple[float, float, dict]]:
    """The device's work merged into busy intervals, each with the event that opened it."""
    merged: list[list] = []
    for e in sorted(work, key=lambda e: e["ts"]):
        start, end = e["ts"], e["ts"] + e["dur"]
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end, e])
    return [tuple(m) for m in merged]


def _open_ranges(ranges: list[dict], times: list[float]) -> dict[float, list[dict]]:
    """For each time in ``times``, the host ranges (of one thread, which nest) open then, outermost
    first: one sweep over the ranges in start order."""
    found, stack, i = {}, [], 0
    ranges = sorted(ranges, key=lambda r: (r["ts"], -r["dur"]))
    for t in sorted(times):
        while i < len(ranges) and ranges[i]["ts"] <= t:
            r = ranges[i]
            stack = [s for s in stack if s["ts"] + s["dur"] > r["ts"]] + [r]
            i += 1
        found[t] = [s for s in stack if s["ts"] + s["dur"] > t]
    return found


def idle_report(events: list[dict], steps: int, min_gap_us: float = 20.0, top: int = 25) -> tuple[float, str]:
    """(GPU idle ms a step, a report of where the idle time went) for a trace of ``steps`` steps."""
    work = [e for e in events if e.get("cat") in DEVICE_WORK]
    if not work:
        return 0.0, "no device work in the trace\n"
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    busy = _busy_intervals(work)
    span = busy[-1][1] - busy[0][0]
    idle_total, small = 0.0, 0.0
    by_cause: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    late: dict[tuple, list[tuple[float, float]]] = defaultdict(list)  # thread -> (gap start, gap)
    for (_, gap_start, _), (next_start, _, opener) in zip(busy, busy[1:]):
        gap = next_start - gap_start
        idle_total += gap
        if gap < min_gap_us:
            small += gap
            continue
        launch = launches.get(opener.get("args", {}).get("correlation"))
        if launch is None:
            cause = "next work launched outside the trace"
        elif launch["ts"] + launch["dur"] <= gap_start:
            cause = "launched before the gap: waited on another stream, an event or the launch itself"
        else:
            late[(launch["pid"], launch["tid"])].append((gap_start, gap))
            continue
        by_cause[cause][0] += gap
        by_cause[cause][1] += 1

    # Late launches: what the launching thread was inside when the GPU went idle.
    ranges, syncs = defaultdict(list), defaultdict(list)
    for e in events:
        thread = (e.get("pid"), e.get("tid"))
        if thread in late and e.get("cat") in HOST_RANGES:
            ranges[thread].append(e)
        elif thread in late and e.get("cat") in LAUNCHES and "Synchronize" in e["name"]:
            syncs[thread].append(e)
    for thread, gaps in late.items():
        open_at = _open_ranges(ranges[thread], [t for t, _ in gaps])
        for gap_start, gap in gaps:
            stack = open_at[gap_start]
            sync = next((e for e in syncs[thread] if e["ts"] <= gap_start < e["ts"] + e["dur"]), None)
            if sync is not None:
                cause = f"host synchronising ({sync['name']}) in " + (stack[-1]["name"] if stack else "?")
            elif stack:
                outer, inner = stack[0]["name"], stack[-1]["name"]
                cause = f"host late: in {outer}" + (f" > {inner}" if inner != outer else "")
            else:
                cause = "host late: between ops (Python)"
            by_cause[cause][0] += gap
            by_cause[cause][1] += 1

    per_step = idle_total / 1e3 / steps
    lines = [f"{span / 1e3 / steps:.2f} ms of device timeline a step, {per_step:.2f} ms of it idle "
             f"({idle_total / span:.1%}); gaps under {min_gap_us:g} us: {small / 1e3 / steps:.2f} ms a step",
             f"{'ms a step':>10} {'gaps':>6}  where the gaps of {min_gap_us:g} us or more came from"]
    for cause, (total, count) in sorted(by_cause.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{total / 1e3 / steps:>10.3f} {count:>6}  {cause}")
    return per_step, "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--steps", type=int, default=1, help="steps the trace holds, for the per-step figures")
    p.add_argument("--min-gap-us", type=float, default=20.0)
    args = p.parse_args(argv)
    print(idle_report(load_trace(args.trace), args.steps, args.min_gap_us)[1], end="")


if __name__ == "__main__":
    main()
