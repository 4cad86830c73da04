"""CPU stages beside a busy process: regeneration on the CPU, quiet and with one core taken.

Torch's CPU kernels run on OpenMP threads, as many as the job has cores (Snakemake sets
``OMP_NUM_THREADS`` to the job's threads). Between parallel regions GNU OpenMP lets its threads
spin, waiting for the next one. When another process holds one of the cores, the thread that
shares it with that process is descheduled for whole time slices while its peers spin at the
barrier: every region waits for the slowest thread, and a stage can take several times as long.
``OMP_WAIT_POLICY=PASSIVE`` makes the waiting threads sleep instead; the workflow sets it
(``Snakefile``) unless the user has set it.

This bench regenerates the same conversations with the HF backend (``bench/regeneration.py``,
the function the workflow's rule calls) on a random-init model of the demo target's shape
(SmolLM2-135M, float32), with all the machine's cores, under each wait policy, quiet and beside a
busy-looping process, one run after the other, and prints the times and their ratios:

    python bench/cpu_contention.py --work /tmp/contention
    python bench/cpu_contention.py --work /tmp/contention --policies default PASSIVE --conversations 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

BUSY_LOOP = "while True: pass"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="model, conversations and outputs go here")
    p.add_argument("--shape", default="135m", help="a shape of bench/extraction.py's SHAPES (135m: SmolLM2-135M)")
    p.add_argument("--policies", nargs="+", default=["default", "PASSIVE"],
                   help="OMP_WAIT_POLICY values to compare ('default': unset)")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS of the stage (all cores)")
    return p.parse_args(argv)


def timed_regeneration(args: argparse.Namespace, policy: str, busy: bool) -> float:
    """Seconds of generation (model load excluded) in a fresh process, as the rule's job would run."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    competitor = subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) if busy else None
    try:
        subprocess.run([sys.executable, str(ROOT / "bench" / "regeneration.py"), "--tiny", "--work", str(args.work),
                        "--backends", "hf", "--conversations", str(args.conversations),
                        "--max-new-tokens", str(args.max_new_tokens), "--hf-batch-size", str(args.batch_size),
                        "--only", "hf"], env=env, check=True, stdout=subprocess.DEVNULL)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    return json.loads((args.work / "result-hf.json").read_text())["generation_seconds"]


def main(argv=None) -> int:
    import regeneration

    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    regeneration.build_target(args.work / "model", args.shape, "float32", "cpu")
    regeneration.write_conversations(args.work / "conversations.jsonl", args.conversations)
    rows = []
    for policy in args.policies:
        quiet = timed_regeneration(args, policy, busy=False)
        busy = timed_regeneration(args, policy, busy=True)
        rows.append({"policy": policy, "quiet_s": round(quiet, 1), "busy_s": round(busy, 1),
                     "busy_over_quiet": round(busy / quiet, 2)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    base = rows[0]
    for row in rows:
        row["quiet_vs_first"] = round(row["quiet_s"] / base["quiet_s"], 2)
        row["busy_vs_first"] = round(row["busy_s"] / base["busy_s"], 2)
    print(f"\n{'policy':<10}{'quiet s':>10}{'busy s':>10}{'busy/quiet':>12}{'quiet vs ' + base['policy']:>20}"
          f"{'busy vs ' + base['policy']:>20}")
    for r in rows:
        print(f"{r['policy']:<10}{r['quiet_s']:>10}{r['busy_s']:>10}{r['busy_over_quiet']:>12}"
              f"{r['quiet_vs_first']:>20}{r['busy_vs_first']:>20}")
    summary = {"shape": args.shape, "threads": args.threads, "conversations": args.conversations,
               "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "cpu_count": os.cpu_count(),
               "started": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    (args.work / "contention.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
