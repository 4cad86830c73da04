"""What ``train.packing`` costs the data path: every micro-batch of one epoch built from a store's
shards (``BatchFeed``'s own ``build_batch`` on the rows of the open shards), with each packing side
by side, from a cold page cache where the machine lets this process drop it (root on Linux).

    python bench/batch_reads.py --index results/demo/hidden_states/index.json --batch-tokens 1024

Printed per packing: batches, tokens, seconds, tokens/s and MB/s of states read, and the ratio of
``shuffled`` to ``best_fit``. ``best_fit`` batches read one shard each, ``shuffled`` ones the
group's shards; every sample's rows are one contiguous run of each layer file either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.extract.hidden_states import HiddenStateIndex, ShardRows, bytes_per_token  # noqa: E402
from draftsmith.train.batches import build_batch, plan_run  # noqa: E402
from draftsmith.train.settings import TrainSettings  # noqa: E402


def drop_page_cache() -> bool:
    """Write dirty pages and drop the page cache (root only): the next reads come from the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_epoch(index_path: Path, settings: TrainSettings) -> dict:
    """Build every micro-batch of the first epoch as training builds them, one group's shards open at a time."""
    index = HiddenStateIndex.load(index_path)
    metas, steps = plan_run(index, settings, 1, index_path)
    layers = [*index.aux_layer_ids, index.final_layer_id]
    cold = drop_page_cache()
    started, tokens, batches, open_rows, group = time.perf_counter(), 0, 0, {}, None
    for step in (s for s in steps if s.epoch == 0):
        for pack in step.packs:
            if pack.group != group:
                open_rows, group = {}, pack.group
            for shard in pack.shards:
                open_rows.setdefault(shard, ShardRows(index, index.shards[shard], layers))
            build_batch(pack, metas, open_rows, index.aux_layer_ids, index.final_layer_id, index.hidden_size,
                        settings.ttt_steps, pack.tokens, torch.bfloat16, False)
            tokens, batches = tokens + pack.tokens, batches + 1
    seconds = time.perf_counter() - started
    read = tokens * bytes_per_token(index.hidden_size, len(layers), index.dtype)
    return {"packing": settings.packing, "cold_cache": cold, "batches": batches, "tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds), "mb_per_s": round(read / seconds / 1e6)}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--index", type=Path, required=True, help="a store's index.json")
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--mix-shards", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="runs of each packing, alternating")
    args = p.parse_args(argv)
    base = TrainSettings(batch_tokens=args.batch_tokens, mix_shards=args.mix_shards, epochs=1, device="cpu",
                         progress=False)
    results = []
    for _ in range(args.repeats):
        for packing in ("best_fit", "shuffled"):
            results.append(read_epoch(args.index, dataclasses.replace(base, packing=packing)))
            print(results[-1])
    best = {k: min(r["seconds"] for r in results if r["packing"] == k) for k in ("best_fit", "shuffled")}
    print(f"fastest run: best_fit {best['best_fit']:.3f} s, shuffled {best['shuffled']:.3f} s; "
          f"shuffled / best_fit time {best['shuffled'] / best['best_fit']:.2f}")
    return results


if __name__ == "__main__":
    main()
