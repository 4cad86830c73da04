"""The online window's disk: the shard store writing while a reader reads each shard back as soon
as it is complete and then deletes it, as the online trainer does, against the same store whose
shards are deleted unread.

The store is fed by ``store_rate.ReadyStates`` (ready states in shared memory, no engine), so what
is measured is the disk and the CPU the writer and the reader share. Four modes, each shard deleted
once complete (read first or not), the order rotated from one repeat to the next, the disk synced
before each:

  direct                 the store as extraction writes it (``O_DIRECT`` on a local disk), unread
  direct, read back      the same, each shard read back before it is deleted
  read soon              the store as the online window writes it (``PartStore(read_soon=True)``:
                         through the page cache, its pages left there), unread
  read soon, read back   the same, each shard read back before it is deleted

Printed and written to ``--json``: each mode's store rate (tokens/s and GB/s of states), the
reader's seconds of reading, the bytes the process read from the disk (``/proc/self/io``), and how
long after the store's end the last shard was read and deleted.

    python bench/window_read_back.py --out /tmp/wrb       # a folder on the disk to measure
"""

from __future__ import annotations

import json
import os
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

MODES = {"direct": (False, False), "direct, read back": (False, True),
         "read soon": (True, False), "read soon, read back": (True, True)}  # mode: (read_soon, read back)
READ_BYTES = 16 << 20


class Consumer(threading.Thread):
    """Takes each shard once its manifest is there (in shard order): reads every file of it when
    ``read``, then deletes it."""

    def __init__(self, store_dir: Path, shards: int, read: bool) -> None:
        super().__init__(daemon=True)
        self.store_dir, self.shards, self.read = store_dir, shards, read
        self.read_seconds, self.bytes, self.finished, self.error = 0.0, 0, None, None

    def run(self) -> None:
        try:
            buffer = bytearray(READ_BYTES)
            for n in range(self.shards):
                folder = self.store_dir / shard_dir_name(n)
                while not (folder / SHARD_MANIFEST).exists():
                    time.sleep(0.01)
                started = time.perf_counter()
                for path in sorted(folder.glob("*.safetensors")) if self.read else ():
                    with open(path, "rb", buffering=0) as file:
                        while count := file.readinto(buffer):
                            self.bytes += count
                self.read_seconds += time.perf_counter() - started
                shutil.rmtree(folder)
            self.finished = time.perf_counter()
        except BaseException as error:  # re-raised by run_mode, in the main thread
            self.error = error


def disk_read_bytes() -> int:
    """Bytes this process has had read from the storage layer (``/proc/self/io``), 0 where unknown."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in lines if line.startswith("read_bytes:")), 0)


def run_mode(mode: str, backend, folder: Path, shards, args) -> dict:
    read_soon, read = MODES[mode]
    shutil.rmtree(folder / "store", ignore_errors=True)
    os.sync()  # the last mode's deletions and writeback done before this one's clock starts
    time.sleep(1.0)
    store = PartStore(folder / "store", 0, fingerprint="bench", dtype=args.storage, hidden_size=args.hidden,
                      layer_ids=list(range(args.layers)), read_soon=read_soon)
    consumer = Consumer(store.dir, len(shards), read)
    disk_before = disk_read_bytes()
    consumer.start()
    started = time.perf_counter()
    extract_shards(backend, store, shards, batch_tokens=args.batch_tokens)
    ended = time.perf_counter()
    consumer.join()
    if consumer.error is not None:
        raise consumer.error
    return {"seconds": ended - started, "read_seconds": consumer.read_seconds if read else None,
            "read_gb": consumer.bytes / 1e9, "disk_read_gb": (disk_read_bytes() - disk_before) / 1e9,
            "consumer_done_after_store_s": consumer.finished - ended}


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
    direct = direct_io_pays(folder)
    try:
        for repeat in range(args.repeats):  # rotated: no mode always follows the same one
            order = list(MODES)[repeat % len(MODES):] + list(MODES)[:repeat % len(MODES)]
            for mode in order:
                runs[mode].append(run_mode(mode, backend, folder, shards, args))
    finally:
        shutil.rmtree(folder if args.out is None else folder / "store", ignore_errors=True)
    best = {mode: min(r, key=lambda run: run["seconds"]) for mode, r in runs.items()}
    result = {"tokens": tokens, "state_gb": state_gb, "direct_io": direct, "modes": best,
              "runs": runs, "args": {**vars(args), "out": str(folder), "json": str(args.json)}}
    print(f"{tokens} tokens, {state_gb:.1f} GB of {args.storage} states into {folder} (direct I/O "
          f"{'on' if direct else 'off'}), best of {args.repeats}:")
    print(f"{'mode':<21} {'store s':>8} {'tokens/s':>10} {'GB/s':>6} {'vs direct':>10} {'read s':>7} "
          f"{'disk read GB':>13} {'done after store':>17}")
    for mode, run in best.items():
        read = "" if run["read_seconds"] is None else f"{run['read_seconds']:.2f}"
        print(f"{mode:<21} {run['seconds']:>8.2f} {tokens / run['seconds']:>10,.0f} {state_gb / run['seconds']:>6.2f} "
              f"{best['direct']['seconds'] / run['seconds']:>9.2f}x {read:>7} {run['disk_read_gb']:>13.2f} "
              f"{run['consumer_done_after_store_s']:>15.2f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
