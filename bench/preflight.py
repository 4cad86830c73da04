"""How long the workflow's planning and preflight take for the Kimi-K2.5 example on this machine.

Builds Kimi-K2.5's config and a tokenizer (no weights: preflight never reads them), a copy of the
workflow and the example config (regeneration on, as shipped) pointing at them, then times, each a
fresh process as a user would start it:

  preflight        `snakemake preflight --configfile=kimi.yaml --cores 2` (or `--cores N`) from nothing,
                   no description of the target kept either (goal < 10 s)
  described before the same with the results wiped but the target's description kept from the run
                   before (draftsmith.targets.inspection_memo): a user's next preflight of a target
  no-op rerun      the same command again: 0 jobs
  64-part plan     `snakemake -n` of the whole workflow with extraction.parts: 64 (goal < 3 s; the
                   jobs left once preflight has run)
  inspect_target   the inspect_target job's own Python process (imports included)

The example asks for device: cuda, which inspect_target refuses where torch sees no GPU; the bench
runs as inside a SLURM allocation (SLURM_JOB_ID set), whose GPU jobs run on other nodes, so that
check steps aside on a machine without one (every other check runs).

    .venv/bin/python bench/preflight.py                 # best of 3 for each
    .venv/bin/python bench/preflight.py --repeats 1 --cores 1
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


CPU = {"seconds": 0.0}  # CPU time (user + system) of the last command and its jobs


def _run(cmd: list[str], cwd: Path) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": str(cwd), "SLURM_JOB_ID": "bench"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU["seconds"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return seconds, done.stdout + done.stderr


def _jobs(output: str) -> int:
    """Jobs planned or run, from Snakemake's job stats table (the target rules all/preflight not counted)."""
    table = output.split("Job stats:", 1)
    if len(table) < 2:
        return 0  # "Nothing to be done"
    counts = re.findall(r"^(\w+)\s+(\d+)$", table[1].split("total", 1)[0], flags=re.M)
    return sum(int(n) for rule, n in counts if rule not in ("all", "preflight", "job"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cores", type=int, default=2, help="snakemake --cores of the preflight runs")
    args = parser.parse_args()

    import tiny
    from workflow_helpers import copy_workflow

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        kimi = tiny.build_kimi_k25_config(tmp / "kimi")
        data = tiny.write_jsonl(tmp / "chats.jsonl", [{"messages": [
            {"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]} for i in range(64)])
        workdir = copy_workflow(tmp / "wf")
        config = yaml.safe_load((ROOT / "config" / "examples" / "kimi-k2.5.yaml").read_text())
        config["target"]["path"], config["data"]["sources"] = str(kimi), [str(data)]
        assert config["regenerate"]["enabled"]
        (workdir / "kimi.yaml").write_text(yaml.safe_dump(config))
        config["extraction"]["parts"] = 64
        (workdir / "kimi64.yaml").write_text(yaml.safe_dump(config))

        preflight = [SNAKEMAKE, "preflight", "--configfile=kimi.yaml", "--cores", str(args.cores)]
        results: dict[str, list[float]] = {"preflight": [], "described before": [], "no-op rerun": [],
                                           "64-part plan": [], "inspect_target": []}
        memo = tmp / "cache"
        os.environ["DRAFTSMITH_CACHE_DIR"] = str(memo)  # the commands' own, emptied for each "from nothing"
        cpu: dict[str, list[float]] = {name: [] for name in results}
        jobs = {}
        for _ in range(args.repeats):
            for name in ("preflight", "described before"):
                if name == "preflight":
                    shutil.rmtree(memo, ignore_errors=True)
                shutil.rmtree(workdir / "results", ignore_errors=True)
                shutil.rmtree(workdir / ".snakemake", ignore_errors=True)
                seconds, out = _run(preflight, workdir)
                results[name].append(seconds)
                cpu[name].append(CPU["seconds"])
                jobs[name] = _jobs(out)
            seconds, out = _run(preflight, workdir)
            results["no-op rerun"].append(seconds)
            cpu["no-op rerun"].append(CPU["seconds"])
            jobs["no-op rerun"] = _jobs(out)
            seconds, out = _run([SNAKEMAKE, "-n", "--configfile=kimi64.yaml", "--cores", "2",
                                 "--resources", "gpu=8"], workdir)
            results["64-part plan"].append(seconds)
            cpu["64-part plan"].append(CPU["seconds"])
            jobs["64-part plan"] = _jobs(out)
            code = ("from draftsmith.targets.inspect import write_target_json; "
                    f"write_target_json({str(tmp / 't.json')!r}, {str(kimi)!r}, aux_layer_ids=[2, 30, 58], "
                    "trust_remote_code=True)")
            shutil.rmtree(memo, ignore_errors=True)
            seconds, _ = _run([sys.executable, "-c", code], workdir)
            results["inspect_target"].append(seconds)
            cpu["inspect_target"].append(CPU["seconds"])
            jobs["inspect_target"] = 1

    load = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} after the runs")
    print(f"{'what':<16} {'best s':>7} {'all runs (s)':<24} {'CPU s (best)':>12} jobs")
    for name, times in results.items():
        print(f"{name:<16} {min(times):7.2f} {' '.join(f'{t:.2f}' for t in times):<24} {min(cpu[name]):12.2f} "
              f"{jobs[name]}")


if __name__ == "__main__":
    main()
