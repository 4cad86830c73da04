"""The evaluation stage on a finished run: its seconds and figures, this tree against an older revision.

Runs ``evaluate_draft`` (the function the ``evaluate_draft`` rule calls) on a run's draft, target and
held-out prompts (by default the embedded demo's, after `make demo`) with the eval settings of a
config, each time in a fresh process as the rule's job would, and prints each run's seconds, τ at k
and τ against k. With ``--before REV`` the same evaluation runs first on that revision's code (a
detached git worktree), then on this tree, and the ratio of their seconds is printed:

    python bench/evaluation.py --run results/demo --before ff8fd82 --set eval.sweep_max_prompts=3
    python bench/evaluation.py --run results/demo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter with the code under test first on sys.path.
JOB = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from draftsmith.evaluate import EvalSettings, evaluate_draft
run, config, out = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
started = time.perf_counter()
result = evaluate_draft(run + "/draft", run + "/target.json", run + "/data/heldout.jsonl", out,
                        EvalSettings.from_config(config))
print(json.dumps({"seconds": time.perf_counter() - started, "tau": result["tau"],
                  "baseline_tau": result["baseline"]["tau"], "tau_by_k": result["tau_by_k"],
                  "checked_generations": result["lossless"]["checked_generations"]}))
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, default=ROOT / "results/demo", help="a run's results folder")
    p.add_argument("--config", type=Path, default=ROOT / "config/config.yaml", help="the eval settings' config")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="override config values (YAML values), for both revisions")
    p.add_argument("--before", metavar="REV", help="a git revision to time first, on the same run and settings")
    return p.parse_args(argv)


def config_with(path: Path, overrides: list[str]) -> dict:
    config = yaml.safe_load(path.read_text())
    for item in overrides:
        key, value = item.split("=", 1)
        *sections, name = key.split(".")
        node = config
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = yaml.safe_load(value)
    return config


def evaluate(code: Path, run: Path, config: dict, out: Path) -> dict:
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}  # as the Snakefile sets it for every job
    done = subprocess.run([sys.executable, "-c", JOB, str(code), str(run.resolve()), json.dumps(config), str(out)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"the evaluation with the code in {code} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    args = parse_args(argv)
    config = config_with(args.config, args.set)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            tree = Path(tmp) / "before"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.before],
                           check=True, capture_output=True)
            try:
                results[f"before ({args.before})"] = evaluate(tree, args.run, config, Path(tmp) / "before.json")
            finally:  # never hides the run's own failure
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
                subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)
        results["this tree"] = evaluate(ROOT, args.run, config, Path(tmp) / "after.json")
    for name, r in results.items():
        by_k = r["tau_by_k"]
        print(f"{name}: {r['seconds']:.1f} s; τ {r['tau']:.4f} against the baseline's {r['baseline_tau']:.4f}; "
              f"τ for k = {by_k['k']} on {by_k['num_prompts']} prompts: draft {[round(t, 3) for t in by_k['draft']]}, "
              f"baseline {[round(t, 3) for t in by_k['baseline']]}; {r['checked_generations']} runs checked")
    if args.before:
        before, after = results.values()
        print(f"this tree / before: {after['seconds'] / before['seconds']:.2f} of the seconds")


if __name__ == "__main__":
    main()
