"""Online training against its two halves: extraction alone, training alone, and both at once
through the window, in one run; plus the window's peak on disk against ``online.window_tokens``.

On two GPUs the engine (HF backend) runs on GPU 0 and the trainer on GPU 1, for a random-init
model of the 8B Llama shape; each phase runs in a process of its own with its
``CUDA_VISIBLE_DEVICES``. Rates are training tokens over each phase's wall time (model loads and
compilation included, so use enough ``--tokens`` for them to amortise). Printed and written to
``--out``: the three rates, online / min(extraction, training), and the peak window in bytes.

    python bench/online_training.py --out bench-online.json     # 2 GPUs
    python bench/online_training.py --tiny                      # CPU smoke check, seconds

Disk: the 8B shape stores 32 KiB per token, so the defaults (2,097,152 tokens in 16 shards of
131,072) need 64 GiB for the offline store, 16 GiB for the model and, for the window, the least the
plan accepts: 1,048,576 tokens (32 GiB), two of the trainer's groups of four shards and its
read-ahead. With fewer, larger shards the least window nears the whole store and the engine never waits.

Each phase can also run in a command of its own (``--dir`` keeps the inputs and each phase's
seconds in ``phases.json``): ``--phases extract``, then ``--phases train``, then ``--phases online``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PHASE = """
import json, sys
sys.path.insert(0, {root!r})
from draftsmith.extract.extract import extract_part, merge
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.online import OnlineSettings, run_online_training
from draftsmith.train import TrainSettings, run_training
a = json.loads({args!r})
ex, tr = ExtractionSettings(**a["extraction"]), TrainSettings(**a["train"])
d = a["dir"]
if a["phase"] == "extract":
    extract_part(d + "/train.jsonl", d + "/target.json", 0, ex, d + "/hs", d + "/hs/part-0.json")
    merge([d + "/hs/part-0.json"], d + "/hs/index.json")
elif a["phase"] == "train":
    run_training(d + "/hs/index.json", d + "/mapping.safetensors", d + "/target.json", d + "/draft-offline",
                 d + "/work-offline", tr)
else:
    run_online_training(d + "/train.jsonl", d + "/target.json", d + "/mapping.safetensors", d + "/draft-online",
                        d + "/work-online", tr, ex, OnlineSettings(**a["online"]),
                        engine_devices=a["engine"], trainer_devices=a["trainer"])
"""


PHASES = ("extract", "train", "online")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: a smoke check in seconds")
    p.add_argument("--tokens", type=int, default=2_097_152, help="training tokens (samples of --seq-len)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--shard-tokens", type=int, default=131_072,
                   help="extraction.shard_tokens: 16 shards of the default --tokens, so that the least window is half of them")
    p.add_argument("--window-tokens", type=int, default=None,
                   help="online.window_tokens (default: the least this run's plan accepts, where the engine waits most)")
    p.add_argument("--packing", choices=["shuffled", "best_fit"], default=None,
                   help="train.packing for both training phases (default: the trainer's)")
    p.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES),
                   help="phases to run now; the others' seconds come from --dir's phases.json")
    args = p.parse_args(argv)
    if args.dir is None and args.phases != list(PHASES):
        p.error("--phases needs --dir: the phases of separate runs meet there")
    if args.tiny:
        args.tokens, args.seq_len, args.shard_tokens = 4096, 64, 512
    return args


def build_inputs(args, folder: Path) -> None:
    """The model (random init), target.json, train.jsonl of random tokens, and the vocab mapping."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tiny
    from draftsmith.targets.inspect import write_target_json
    from draftsmith.vocab import build_vocab_mapping

    model = folder / "model"
    if args.tiny:
        tiny.build_llama(model)
        vocab, draft_vocab = 384, 128
    else:
        config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                             torch_dtype="bfloat16")
        with torch.device("cuda"):
            LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model)
        tiny.build_tokenizer(model)
        vocab, draft_vocab = 128256, 32000
    write_target_json(folder / "target.json", model)
    rng = random.Random(0)
    # mostly tokens the draft vocabulary can hold, as in real text (build_vocab_mapping refuses less)
    rows = [{"id": f"s{i}", "input_ids": [rng.randrange(1, draft_vocab if rng.random() < 0.95 else vocab)
                                          for _ in range(args.seq_len)],
             "loss_mask": [0] * (args.seq_len // 4) + [1] * (args.seq_len - args.seq_len // 4)}
            for i in range(max(1, args.tokens // args.seq_len))]
    tiny.write_jsonl(folder / "train.jsonl", rows)
    build_vocab_mapping(folder / "train.jsonl", vocab, draft_vocab, folder / "mapping.safetensors",
                        folder / "vocab_stats.json")


def least_window(folder: Path, spec: dict) -> int:
    """The smallest ``online.window_tokens`` the online run accepts: what its own plan needs on disk
    at once (``OnlinePlan.window_needed``), so the engine waits on the trainer as much as it can."""
    from draftsmith.extract.settings import ExtractionSettings
    from draftsmith.online import OnlineSettings
    from draftsmith.online.plan import OnlinePlan
    from draftsmith.targets.inspect import read_target_json
    from draftsmith.train.batches import plan_steps
    from draftsmith.train.settings import TrainSettings

    settings = TrainSettings(**spec["train"])
    plan = OnlinePlan.build(folder / "train.jsonl", read_target_json(folder / "target.json"), folder / "unused",
                            ExtractionSettings(**spec["extraction"]), OnlineSettings(cache_fraction=0.0))
    steps = plan_steps(plan.metas(settings), settings, 1)
    return plan.window_needed(plan.units(steps), len(steps))


def folder_bytes(path: Path) -> int:
    """Bytes of the states under ``path`` (the small JSON files of the window left out)."""
    return sum(f.stat().st_size for f in path.rglob("*.safetensors")) if path.exists() else 0


def run_phase(name: str, spec: dict, env: dict, watch: Path | None = None) -> tuple[float, int]:
    """Wall seconds of the phase's process, and the peak bytes under ``watch`` while it ran."""
    peak, done = [0], threading.Event()

    def poll():
        while not done.is_set():
            try:
                peak[0] = max(peak[0], folder_bytes(watch))
            except FileNotFoundError:  # a shard deleted while listed
                pass
            time.sleep(0.2)

    watcher = threading.Thread(target=poll, daemon=True) if watch is not None else None
    if watcher:
        watcher.start()
    started = time.perf_counter()
    code = PHASE.format(root=str(ROOT), args=json.dumps({**spec, "phase": name}))
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    seconds = time.perf_counter() - started
    done.set()
    if watcher:
        watcher.join()
    return seconds, peak[0]


def summarize(folder: Path, done: dict, window_tokens: int) -> dict:
    summary = json.loads((folder / "work-online" / "summary.json").read_text())
    index = json.loads((folder / "hs" / "index.json").read_text())
    tokens = summary["tokens"]
    per_token = index["bytes"] / index["num_tokens"]
    seconds = {"extraction": done["extract"]["seconds"], "training": done["train"]["seconds"],
               "online": done["online"]["seconds"]}
    rates = {name: tokens / s for name, s in seconds.items()}
    return {
        "tokens": tokens, "seconds": seconds, "tokens_per_s": rates,
        "online_vs_slower": rates["online"] / min(rates["extraction"], rates["training"]),
        "window_tokens": window_tokens, "window_bytes": window_tokens * per_token,
        "peak_window_bytes": done["online"]["peak_bytes"],
        "peak_window_tokens": summary["online"]["peak_window_tokens"], "store_bytes": index["bytes"],
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    folder = args.dir or Path(tempfile.mkdtemp(prefix="online-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.tiny else "cuda"
    spec = {"dir": str(folder), "engine": None if args.tiny else "0", "trainer": None if args.tiny else "1",
            "extraction": {"device": device, "shard_tokens": args.shard_tokens, "batch_tokens": 16384},
            "train": {"device": device, "batch_tokens": max(args.seq_len, 8192 if not args.tiny else 128),
                      "epochs": 1, "warmup_steps": 2, "log_every": 10, "checkpoint_every": 1000,
                      "progress": False, **({"packing": args.packing} if args.packing else {})}}
    result = None
    try:
        if not (folder / "mapping.safetensors").exists():
            build_inputs(args, folder)
        window_tokens = args.window_tokens or least_window(folder, spec)
        spec["online"] = {"window_tokens": window_tokens, "cache_fraction": 0.0}
        # the package beside whatever the environment already puts on the path (an install in --target)
        base = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        devices = {"extract": "0", "train": "1", "online": "0,1"}
        record = folder / "phases.json"
        done = json.loads(record.read_text()) if record.exists() else {}
        for name in args.phases:
            env = {**base, **({} if args.tiny else {"CUDA_VISIBLE_DEVICES": devices[name]})}
            watch = folder / "work-online" / "window" if name == "online" else None
            seconds, peak = run_phase(name, spec, env, watch=watch)
            done[name] = {"seconds": seconds, "peak_bytes": peak}
            record.write_text(json.dumps(done, indent=1))
            print(f"{name}: {seconds:.1f} s", file=sys.stderr, flush=True)
        if all(name in done for name in PHASES):
            result = summarize(folder, done, window_tokens)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    if result is None:
        return {}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
