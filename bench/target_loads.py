"""Target loads of a whole run: the workflow through Snakemake with every stage that runs the target
in vLLM (regeneration, extraction, evaluation), on one GPU, reporting per stage the loads of the
target, their seconds and the stage's seconds, then the same for a rerun of ``evaluate_draft``.

Two ways to run it, each in a workdir of its own:

- ``before``: every job loads and closes its own engine (``warm_target.minutes: 0``) and evaluation
  runs three engines (``eval.separate_engines: true``): the workflow as it loaded the target before
  the warm target;
- ``after``: the defaults: engines stay warm between jobs, capture and evaluation share one engine.

    python bench/target_loads.py --case deepseek_v3 --modes before after --out /tmp/loads.json
    python bench/target_loads.py --case llama_8b --modes before after --out /tmp/loads-8b.json

The cases are the GPU lane's (``tests/workflow_helpers.py``: ``VLLM_CASES``) and ``llama_8b``: the
lane's Llama case with a real-size target, the Llama-3-8B shape in bf16 with random weights
(``bench/regeneration.py``'s build, made once for both modes) and the vocabulary of the lane's
tokenizer (384 tokens: with Llama-3's 128,256 a random target writes ids the tokenizer cannot
decode, and every regenerated answer is empty; 7.0B parameters, 14 GB), without the HF loop's check
(an 8B target in the HF loop beside the sleeping engine tells nothing about loads). The summary
(JSON, also on stdout) holds each mode's per-stage figures and the totals, and a Markdown table
goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from workflow_helpers import VLLM_CASES, engine_starts, snakemake, stage_seconds, target_loads, vllm_workflow  # noqa: E402

MODES = {
    "before": {"warm_target": {"minutes": 0}, "eval": {"separate_engines": True}},
    "after": {},
}
BENCH_CASES = {"llama_8b": ("llama", "8b")}  # case: (the lane's case it runs, the bench/regeneration.py shape)
TOKENIZER_VOCAB = 384  # tests/tiny.py's tokenizer, which the lane's cases use
STAGES = ("regenerate_responses", "extract_hidden_states/part-0", "train_draft", "evaluate_draft")
# vLLM's own lines on where an engine's start went (0.33's model runner, loader and engine core)
VLLM_START_LINE = re.compile(r"(Initializing model took|Loading weights took|Model loading took|torch\.compile takes"
                             r"|Graph capturing finished|init engine \(profile, create kv cache, warmup model\) took)"
                             r"[^\n]*")


def run_mode(work: Path, case: str, mode: str, target: dict, logs: Path | None) -> dict:
    """One workflow run and a rerun of evaluate_draft; the figures of each job that runs the target.
    ``target``: config sections that replace the case's target (empty: the case's own); ``logs``: where
    the jobs' and the warm engines' logs are copied (none: not kept)."""
    from draftsmith.engines import registry

    os.environ[registry.ENGINE_DIR_ENV] = str(work / "engines")  # the run's jobs inherit it
    sections = {**MODES[mode]}
    for section, value in target.items():
        sections[section] = {**sections.get(section, {}), **value}
    try:
        workdir, configfile, _ = vllm_workflow(work, case, **sections)
        started = time.monotonic()
        _snakemake(work / "snakemake-run.log", workdir, "--resources", "gpu=1", configfile=configfile)
        run = {"wall_seconds": round(time.monotonic() - started, 1),
               "stages": _figures(workdir)}
        started = time.monotonic()
        _snakemake(work / "snakemake-rerun.log", workdir, "--resources", "gpu=1", "--forcerun", "evaluate_draft",
                   "--until", "evaluate_draft", configfile=configfile)
        run["rerun_evaluate_draft"] = {"wall_seconds": round(time.monotonic() - started, 1),
                                       **_figures(workdir)["evaluate_draft"]}
        return run
    finally:
        try:
            for engine in registry.list_engines():
                registry.stop_engine(Path(engine["folder"]))
        finally:
            if logs:
                keep_logs(work, logs / mode)


def _snakemake(console: Path, workdir: Path, *args: str, configfile: Path) -> None:
    """A Snakemake run, its console kept in ``console``: a job's own engine logs vLLM's lines there
    (vLLM's logger writes to the job's stdout, not to the rule's log)."""
    done = snakemake(workdir, *args, configfile=configfile, timeout=3600, check=False)
    console.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"snakemake {' '.join(args)} failed (its console: {console}):\n{done.stderr[-4000:]}")


def keep_logs(work: Path, into: Path) -> None:
    """The mode's job logs, its warm engines' logs and Snakemake's console under ``into``, and vLLM's
    own lines on where each engine's start went (``vllm-start.txt``), for comparing one mode's loads
    with the other's."""
    shutil.rmtree(into, ignore_errors=True)
    for log in [*work.glob("*/logs/**/*.log"), *work.glob("engines/*/engine.log"), *work.glob("snakemake-*.log")]:
        copy = into / log.relative_to(work)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(log, copy)
    lines = [f"{log.relative_to(into)}: {match.group(0)}" for log in sorted(into.rglob("*.log"))
             for match in VLLM_START_LINE.finditer(log.read_text(errors="replace"))]
    (into / "vllm-start.txt").write_text("\n".join(lines) + "\n")


def build_target(folder: Path, shape: str) -> Path:
    """The random-init Llama of ``shape`` (bf16, on the GPU), built in a process of its own so that
    this one holds no CUDA context beside the engines; kept for the next mode and the next run."""
    code = ("import sys; from pathlib import Path; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
            "from regeneration import build_target; "
            "build_target(Path(sys.argv[3]), sys.argv[4], 'bfloat16', 'cuda', vocab_size=int(sys.argv[5]))")
    subprocess.run([sys.executable, "-c", code, str(ROOT / "bench"), str(ROOT / "tests"), str(folder), shape,
                    str(TOKENIZER_VOCAB)], check=True, stdout=sys.stderr)
    return folder


def _figures(workdir: Path) -> dict:
    seconds, loads, starts = stage_seconds(workdir), target_loads(workdir), engine_starts(workdir)
    return {stage: {"loads": len(loads.get(stage, [])), "load_seconds": round(sum(s for _, s in loads.get(stage, [])), 1),
                    "stage_seconds": seconds.get(stage), "what": [w for w, _ in loads.get(stage, [])],
                    "engine_starts": starts.get(stage, [])}
            for stage in STAGES}


def table(summary: dict) -> str:
    lines = ["| mode | stage | target loads | load seconds | stage seconds |", "| --- | --- | ---: | ---: | ---: |"]
    for mode, run in summary["modes"].items():
        rows = [*run["stages"].items(), ("rerun of evaluate_draft", run["rerun_evaluate_draft"])]
        for stage, f in rows:
            lines.append(f"| {mode} | {stage} | {f['loads']} | {f['load_seconds']} | {f['stage_seconds']} |")
        total = run["stages"].values()
        lines.append(f"| {mode} | **the run** | **{sum(f['loads'] for f in total)}** | "
                     f"**{round(sum(f['load_seconds'] for f in total), 1)}** | {run['wall_seconds']} (wall) |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=[*VLLM_CASES, *BENCH_CASES], default="deepseek_v3")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="the summary as JSON (rewritten after each mode)")
    parser.add_argument("--logs", type=Path, default=None,
                        help="keep each mode's job and engine logs here, with vLLM's start lines in vllm-start.txt")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="target-loads-"))
    summary = {"case": args.case, "modes": {}}
    case, target = args.case, {}
    if case in BENCH_CASES:
        case, shape = BENCH_CASES[args.case]
        target = {"target": {"path": str(build_target(work / f"model-{shape}", shape)), "dtype": "bfloat16"},
                  "eval": {"hf_check": False}}
    for mode in args.modes:
        folder = work / mode
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        summary["modes"][mode] = run_mode(folder, case, mode, target, args.logs)
        print(table(summary), file=sys.stderr)
        if args.out:  # after each mode: a run cut short keeps the modes it finished
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
