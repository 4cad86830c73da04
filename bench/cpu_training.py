"""Training on the CPU: the TTT attention block by block of whole samples against the whole batch.

On the CPU the draft's TTT attention is dense (``sdpa``): each step scores T x (j+1)T pairs of a
packed batch of T positions, all but those within a sample masked out. Computed block by block of
whole samples (``draftsmith.train.attention.document_blocks``) it scores only pairs within a block;
the math is the same (tests/test_draft.py). This bench trains on a real store (by default the embedded
demo's, after `make demo`) with the trainer the workflow runs (``run_training``, the demo's train
settings from the config), once per way, for the same steps, one after the other in one process,
and prints each run's tokens/s, its final loss and the ratio:

    python bench/cpu_training.py --run results/demo --steps 60
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import draftsmith.train.attention as attention  # noqa: E402
from draftsmith.train import TrainSettings, run_training  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, default=ROOT / "results/demo", help="a run's results folder (store, vocab, target.json)")
    p.add_argument("--config", type=Path, default=ROOT / "config/config.yaml", help="the train settings' config")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    return p.parse_args(argv)


def train(args: argparse.Namespace, settings: TrainSettings, work: Path) -> dict:
    started = time.perf_counter()
    summary = run_training(args.run / "hidden_states/index.json", args.run / "vocab/mapping.safetensors",
                           args.run / "target.json", work / "draft", work / "work", settings)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens_per_s": summary["tokens"] / summary["seconds"],
            "loss": (summary["final"] or {}).get("loss")}


def main(argv=None) -> None:
    args = parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    settings = dataclasses.replace(TrainSettings.from_config(config), max_steps=args.steps, warmup_steps=None,
                                   progress=False, checkpoint_every=10**9, device="cpu")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["blocks"] = train(args, settings, Path(tmp) / "blocks")
        with mock.patch.object(attention, "document_blocks", lambda doc: [(0, doc.shape[0])]):
            results["whole batch"] = train(args, settings, Path(tmp) / "whole")
    for name, r in results.items():
        print(f"{name:12s} {r['seconds']:7.1f} s (the call)  {r['tokens_per_s']:7.0f} tokens/s (the training)  "
              f"last logged loss by TTT step {r['loss']}")
    print(f"blocks / whole batch: {results['blocks']['tokens_per_s'] / results['whole batch']['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
