"""The online window's disk: the shard store writing while a reader reads each shard back as soon
as it is complete and then deletes it, as the online trainer does, against the store writing alone.

The store is fed by ``store_rate.ReadyStates`` (ready states in shared memory, no engine), so what
is measured is the disk and the CPU the writer and the reader share. Three modes, interleaved:

  alone            the store as extraction writes it (``O_DIRECT`` on a local disk), nothing reading
  read back        the same store, each shard read back and deleted once complete
  read soon        the store as the online window writes it (``PartStore(read_soon=True)``: through
                   the page cache, its pages kept), each shard read back and deleted once complete

Printed and written to ``--json``: each mode's store rate (tokens/s and GB/s of states), the
reader's seconds of reading, and how long after the store's end the last shard was read.

    python bench/window_read_back.py --out /tmp/wrb       # a folder on the disk to measure
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store_rate import ReadyStates, plan_shards, store_arguments  # noqa: E402

from draftsmith.extract.capture import extract_shards  # noqa: E402
from draftsmith.extract.hidden_states import SHARD_MANIFEST, shard_dir_name  # noqa: E402
from draftsmith.extract.safetensors_stream import direct_io_pays  # noqa: E402
from draftsmith.extract.shard_writer import PartStore  # noqa: E402

MODES = ("alone", "read back", "read soon")
READ_BYTES = 16 << 20


class Reader(threading.Thread):
    """Reads every file of each shard once its manifest is there (in shard order), then deletes the shard."""

    def __init__(self, store_dir: Path, shards: int) -> None:
        super().__init__(daemon=True)
        self.store_dir, self.shards = store_dir, shards
        self.read_seconds, self.bytes, self.finished = 0.0, 0, None

    def run(self) -> None:
        buffer = bytearray(READ_BYTES)
        for n in range(self.shards):
            folder = self.store_dir / shard_dir_name(n)
            while not (folder / SHARD_MANIFEST).exists():
                time.sleep(0.01)
            started = time.perf_counter()
            for path in sorted(folder.glob("*.safetensors")):
                with open(path, "rb", buffering=0) as file:
                    while count := file.readinto(buffer):
                        self.bytes += count
            self.read_seconds += time.perf_counter() - started
            shutil.rmtree(folder)
        self.finished = time.perf_counter()


def run_mode(mode: str, backend, folder: Path, shards, args) -> dict:
    shutil.rmtree(folder / "store", ignore_errors=True)
    store = PartStore(folder / "store", 0, fingerprint="bench", dtype=args.storage, hidden_size=args.hidden,
                      layer_ids=list(range(args.layers)), read_soon=mode == "read soon")
    reader = Reader(store.dir, len(shards)) if mode != "alone" else None
    if reader:
        reader.start()
    started = time.perf_counter()
    extract_shards(backend, store, shards, batch_tokens=args.batch_tokens)
    ended = time.perf_counter()
    if reader:
        reader.join()
    return {"seconds": ended - started,
            "read_seconds": reader.read_seconds if reader else None,
            "read_gb": reader.bytes / 1e9 if reader else None,
            "last_read_after_store_s": reader.finished - ended if reader else None}


def main(argv=None) -> dict:
    p = store_arguments(__doc__.split("\n")[0])
    args = p.parse_args(argv)
    shards, tokens = plan_shards(p, args)
    folder = args.out or Path(tempfile.mkdtemp(prefix="window-read-back-"))
    folder.mkdir(parents=True, exist_ok=True)
    row_bytes = args.hidden + 4 if args.storage == "fp8" else args.hidden * 2  # fp8: values and a scale
    state_gb = tokens * args.layers * row_bytes / 1e9
    backend = ReadyStates(list(range(args.layers)), args.batch_tokens, args.hidden, fp8=args.storage == "fp8")
    runs = {mode: [] for mode in MODES}
    try:
        for _ in range(args.repeats):
            for mode in MODES:
                runs[mode].append(run_mode(mode, backend, folder, shards, args))
    finally:
        shutil.rmtree(folder if args.out is None else folder / "store", ignore_errors=True)
    best = {mode: min(r, key=lambda run: run["seconds"]) for mode, r in runs.items()}
    result = {"tokens": tokens, "state_gb": state_gb, "direct_io": direct_io_pays(folder), "modes": best,
              "runs": runs, "args": {**vars(args), "out": str(folder), "json": str(args.json)}}
    print(f"{tokens} tokens, {state_gb:.1f} GB of {args.storage} states into {folder} (direct I/O "
          f"{'on' if result['direct_io'] else 'off'}), best of {args.repeats}:")
    print(f"{'mode':<11} {'store s':>8} {'tokens/s':>10} {'GB/s':>6} {'vs alone':>9} {'read s':>7} {'last read after':>16}")
    for mode, run in best.items():
        read = "" if run["read_seconds"] is None else f"{run['read_seconds']:>7.2f} {run['last_read_after_store_s']:>14.2f} s"
        print(f"{mode:<11} {run['seconds']:>8.2f} {tokens / run['seconds']:>10,.0f} {state_gb / run['seconds']:>6.2f} "
              f"{best['alone']['seconds'] / run['seconds']:>8.2f}x {read}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
