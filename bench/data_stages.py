"""prepare_dataset and the vocabulary count at 1, 2, 4 and 8 workers, on many conversations.

The conversations are made here, deterministically and without downloads: sentences of the demo's
chatterbot corpus (installed with Draftsmith) drawn by a seeded generator into 1–3 exchanges, a
system prompt in half of them, answers of 8–40 sentences (about 660 tokens a conversation). The
tokenizer is tests/tiny.py's byte-level BPE with a ChatML template, trained here on the same
sentences (8,192 tokens), or ``--tokenizer`` (a folder with a tokenizer and chat template, e.g. the
demo target's ``results/demo/target`` after ``make demo``). Both are written once into ``--work``
and reused.

Each worker count runs in a fresh process, as the rule's job would: ``prepare_dataset`` (both
passes: reading, rendering, tokenizing, writing), then ``count_loss_tokens`` over its train.jsonl
(the heart of ``build_vocab_mapping``). Printed per worker count: seconds and tokens/s of each
(tokens: stats.json's train tokens), the speed-up against 1 worker, the peak RSS of the main process
and of the largest worker, the peak PSS of all the job's processes together (sampled every 0.2 s;
forked workers share most of their pages with the main process, which RSS counts in each), the
main process's part of the CPU seconds (it alone reads, counts and writes: one over it bounds the
speed-up any number of workers can give), the load average before and after each run (other work
on the machine), and whether the three output files had the same SHA-256 for every worker count.
Each run's figures are also kept in ``--work``/result-<workers>.json.

    python bench/data_stages.py --work /tmp/ds                                    # 1,000,000 conversations
    python bench/data_stages.py --work /tmp/ds --conversations 100000 --workers 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SEED = 0
TOKENIZER_VOCAB = 8192
OUTPUTS = ("train.jsonl", "heldout.jsonl", "stats.json")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="conversations, tokenizer and outputs go here")
    p.add_argument("--conversations", type=int, default=1_000_000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="worker counts to measure; those above the machine's cores are left out")
    p.add_argument("--tokenizer", type=Path, help="a tokenizer folder to use instead of the tiny one")
    p.add_argument("--out", type=Path, help="also write the results here as JSON")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one worker count, in this process
    return p.parse_args(argv)


def sentences() -> list[str]:
    """Every distinct turn of the demo's chatterbot conversations."""
    from draftsmith.demo import write_chatterbot_demo

    with_rows = Path(os.environ.get("TMPDIR", "/tmp")) / f"chatterbot-{os.getpid()}.jsonl"
    write_chatterbot_demo(with_rows)
    turns = {m["content"] for line in with_rows.read_text().splitlines() for m in json.loads(line)["messages"]}
    with_rows.unlink()
    return sorted(turns)


def write_conversations(path: Path, count: int, pool: list[str]) -> None:
    rng = random.Random(SEED)
    with path.open("w", encoding="utf-8") as f:
        for i in range(count):
            messages = [{"role": "system", "content": " ".join(rng.choices(pool, k=2))}] if rng.random() < 0.5 else []
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": " ".join(rng.choices(pool, k=rng.randint(1, 3)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(pool, k=rng.randint(8, 40)))})
            f.write(json.dumps({"id": f"synthetic:{i}", "messages": messages}, ensure_ascii=False) + "\n")


def prepare_inputs(args: argparse.Namespace) -> tuple[Path, Path]:
    """The conversations file and the tokenizer folder, made once per count and tokenizer."""
    import tiny

    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / f"conversations-{args.conversations}.jsonl"
    tokenizer = args.tokenizer or args.work / "tokenizer"
    pool = None
    if not data.exists():
        pool = sentences()
        write_conversations(data.with_suffix(".tmp"), args.conversations, pool)
        data.with_suffix(".tmp").rename(data)
    if args.tokenizer is None and not (tokenizer / "tokenizer.json").exists():
        tiny.build_tokenizer(tokenizer, vocab_size=TOKENIZER_VOCAB, corpus=pool or sentences())
    return data, tokenizer


def run_one(args: argparse.Namespace, data: Path, tokenizer: Path) -> dict:
    """One worker count, in this process: prepare_dataset, then the count; seconds, memory, hashes."""
    from transformers import AutoTokenizer

    from draftsmith.data import DataSettings, prepare_dataset
    from draftsmith.io import sha256_file
    from draftsmith.vocab import count_loss_tokens

    out = args.work / f"out-{args.one}"
    shutil.rmtree(out, ignore_errors=True)
    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer))
    started, cpu_started = time.perf_counter(), cpu_seconds()
    stats = prepare_dataset([data], tokenizer, out, DataSettings(), workers=args.one)
    prepared, cpu_prepared = time.perf_counter(), cpu_seconds()
    counts = count_loss_tokens(out / "train.jsonl", vocab_size, args.one)
    counted, cpu_counted = time.perf_counter(), cpu_seconds()
    assert int(counts.sum()) == stats["loss_tokens"]
    hashes = {name: sha256_file(out / name) for name in OUTPUTS}  # read in chunks: no new memory peak
    shutil.rmtree(out)
    return {"workers": args.one, "tokens": stats["tokens"], "train_rows": stats["train_rows"],
            "prepare_s": prepared - started, "count_s": counted - prepared,
            "prepare_cpu_s": [b - a for a, b in zip(cpu_started, cpu_prepared)],  # main process, workers
            "count_cpu_s": [b - a for a, b in zip(cpu_prepared, cpu_counted)],
            "main_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, "sha256": hashes}


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds of this process and of its ended children (the workers, once their pool is shut down)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime


def tree_pss_mb(pid: int) -> float:
    """Proportional set size of ``pid`` and its descendants: shared pages split between them."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo.extend(int(child) for child in f.read().split())
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue  # ended while being read
    return total / 1024


def measure(args: argparse.Namespace, workers: int) -> dict:
    cmd = [sys.executable, __file__, "--work", str(args.work), "--conversations", str(args.conversations),
           "--one", str(workers)] + (["--tokenizer", str(args.tokenizer)] if args.tokenizer else [])
    # The checkout first, then whatever path the caller's packages need (a --target install, say)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(workers)}  # threads as Snakemake sets them
    load_before = os.getloadavg()[0]
    with open(args.work / f"run-{workers}.log", "w") as log:
        child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        peak = 0.0
        while child.poll() is None:
            peak = max(peak, tree_pss_mb(child.pid))
            time.sleep(0.2)
        output = child.stdout.read()
    if child.returncode != 0:
        raise SystemExit(f"the run with {workers} workers failed; see {args.work / f'run-{workers}.log'}")
    result = {**json.loads(output.strip().splitlines()[-1]), "total_pss_mb": peak,
              "load_average": [load_before, os.getloadavg()[0]]}  # other work on the machine, before and after
    (args.work / f"result-{workers}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main_share(cpu: list[float]) -> str:
    """The main process's part of a stage's CPU seconds: with workers, it bounds the speed-up
    (1 / share), since the main process alone reads, counts and writes."""
    main, workers = cpu
    return f"{main:.1f} s ({main / (main + workers):.1%})" if workers else f"{main:.1f} s (all)"


def main(argv=None) -> None:
    args = parse_args(argv)
    data, tokenizer = prepare_inputs(args)
    if args.one is not None:
        print(json.dumps(run_one(args, data, tokenizer)))
        return
    counts = [w for w in args.workers if w <= os.cpu_count()]
    skipped = [w for w in args.workers if w > os.cpu_count()]
    results = [measure(args, w) for w in counts]
    base = results[0]
    print(f"{args.conversations:,} conversations, {base['tokens']:,} train tokens, {base['train_rows']:,} rows; "
          f"{os.cpu_count()} cores" + (f"; not measured here: {skipped} workers" if skipped else ""))
    print("| workers | prepare_dataset s | tokens/s | speed-up | main process CPU | count s | tokens/s | speed-up "
          "| main process CPU | main RSS MB | largest worker RSS MB | all processes PSS MB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['workers']} | {r['prepare_s']:.1f} | {r['tokens'] / r['prepare_s']:,.0f} "
              f"| {base['prepare_s'] / r['prepare_s']:.2f}x | {main_share(r['prepare_cpu_s'])} "
              f"| {r['count_s']:.1f} | {r['tokens'] / r['count_s']:,.0f} | {base['count_s'] / r['count_s']:.2f}x "
              f"| {main_share(r['count_cpu_s'])} | {r['main_rss_mb']:.0f} "
              f"| {r['worker_rss_mb'] if r['workers'] > 1 else 0:.0f} | {r['total_pss_mb']:.0f} |")
    print("load average (1 min) before and after each run:",
          ", ".join(f"{r['workers']} workers {r['load_average'][0]:.2f}/{r['load_average'][1]:.2f}" for r in results))
    same = all(r["sha256"] == base["sha256"] for r in results)
    print("outputs identical across worker counts:", same)
    if args.out:
        args.out.write_text(json.dumps({"conversations": args.conversations, "cores": os.cpu_count(),
                                        "results": results, "identical": same}, indent=2) + "\n")
    if not same:
        raise SystemExit("the outputs differ between worker counts")


if __name__ == "__main__":
    main()
