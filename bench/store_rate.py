"""How fast the shard store takes captured states, with the engine out of the picture.

``extract_shards`` (per batch: the NaN/zero check, the layer files appended on their writer
threads, checksummed while written, writeback started; per shard: fsync, manifest, rename) is fed
by a backend that returns ready states: views of one tensor in shared memory, as the vLLM backend
hands over its mapped spool passes (for fp8, values and scales quantised once up front, as the
capture's device hands them over). Beside it, on the same bytes, one core's rate of each piece:
SHA-256 and the store's checksum (``draftsmith.io``: XXH3-128) and a plain file write into
``--out``, through the page cache and direct (``O_DIRECT``, as ``dd oflag=direct`` writes), with
the CPU seconds each took. The store runs twice, side by side: as it writes (direct I/O where the
file system takes it) and through the page cache, as on a file system without direct I/O. The
store's rate is what extraction can reach at most on this machine and file system, whatever the
engine; ``--prefill`` (tokens/s of the engine's plain prefill) turns it into the ceiling of
extraction / prefill.

    python bench/store_rate.py --out /dev/shm/sr         # tmpfs: the CPU work alone
    python bench/store_rate.py --out /tmp/sr             # the disk too
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.extract.backends import CaptureBackend  # noqa: E402
from draftsmith.extract.capture import extract_shards  # noqa: E402
from draftsmith.extract.hidden_states import Fp8Rows, quantize_fp8  # noqa: E402
from draftsmith.extract.safetensors_stream import direct_io_pays  # noqa: E402
from draftsmith.extract.shard_writer import PartStore  # noqa: E402
from draftsmith.io import CHECKSUM, checksum_hasher  # noqa: E402

SAMPLE_TOKENS = 2048


class ReadyStates(CaptureBackend):
    """Returns each batch's states as views of one [layers, batch tokens, hidden] tensor in shared memory
    (with ``fp8``, of its ``Fp8Rows``)."""

    name = "ready"

    def __init__(self, layer_ids: list[int], batch_tokens: int, hidden: int, fp8: bool = False) -> None:
        self.layer_ids = layer_ids
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        count = len(layer_ids) * batch_tokens * hidden
        with tempfile.NamedTemporaryFile(dir=folder) as f:
            f.truncate(count * 2)
            self.states = torch.from_file(f.name, shared=True, size=count, dtype=torch.bfloat16)
        rows, block = self.states.view(-1, hidden), torch.randn(1024, hidden).to(torch.bfloat16)
        for start in range(0, rows.shape[0], len(block)):
            rows[start:start + len(block)] = block[:rows.shape[0] - start]
        self.states = self.states.view(len(layer_ids), batch_tokens, hidden)
        self.rows = Fp8Rows(*quantize_fp8(self.states)) if fp8 else self.states

    def capture(self, batch: list[list[int]]) -> list[dict[int, torch.Tensor | Fp8Rows]]:
        out, row = [], 0
        for ids in batch:
            out.append({lid: self.rows[k, row:row + len(ids)] for k, lid in enumerate(self.layer_ids)})
            row += len(ids)
        return out


def one_core_rates(data: torch.Tensor, folder: Path) -> dict[str, float]:
    """GB/s of one thread over ``data``'s bytes: each checksum, and a plain write into ``folder``."""
    view = memoryview(data.reshape(-1).view(torch.uint8).numpy())
    rates = {}
    for name, make in (("sha256", hashlib.sha256), (CHECKSUM, checksum_hasher)):  # the store's own, whatever it is
        started = time.perf_counter()
        hasher = make()
        hasher.update(view)
        hasher.hexdigest()
        rates[name] = len(view) / (time.perf_counter() - started) / 1e9
    for name, direct in (("write+fsync", False), ("direct write+fsync", True)):
        path = folder / "plain-write.raw"
        cpu, started = _thread_cpu_seconds(), time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
        with open(fd, "wb", buffering=0) as f:  # the tensor's pages are aligned, its length whole blocks
            f.write(view)
            os.fsync(f.fileno())
        rates[name] = len(view) / (time.perf_counter() - started) / 1e9
        rates[f"{name} CPU s"] = _thread_cpu_seconds() - cpu
        path.unlink()
    return rates


def _thread_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


def disk_write_rate(folder: Path, total_bytes: int, block_bytes: int = 64 << 20) -> dict[str, float | bool]:
    """GB/s of one thread writing ``total_bytes`` into a new file in ``folder`` and syncing it: what
    ``dd bs=64M oflag=direct conv=fsync`` measures where the store writes with direct I/O (a local
    disk file system), ``dd conv=fsync`` elsewhere. The block is random bytes in page-aligned memory,
    as direct I/O needs."""
    direct = direct_io_pays(folder)
    block = mmap.mmap(-1, block_bytes)
    block.write(os.urandom(block_bytes))
    count = max(1, total_bytes // block_bytes)
    path = folder / "disk-rate.raw"
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        for _ in range(count):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink()
    seconds = time.perf_counter() - started
    return {"gb_per_s": count * block_bytes / seconds / 1e9, "bytes": count * block_bytes, "direct": direct}


@contextlib.contextmanager
def page_cache_only():
    """The store's streams as on a file system without direct I/O (they look for os.O_DIRECT)."""
    direct = os.O_DIRECT
    del os.O_DIRECT
    try:
        yield
    finally:
        os.O_DIRECT = direct


def run_store(backend, folder: Path, shards, args) -> tuple[float, float]:
    """Wall and CPU seconds (this process, every thread) of ``extract_shards`` into a fresh store."""
    shutil.rmtree(folder / "store", ignore_errors=True)
    store = PartStore(folder / "store", 0, fingerprint="bench", dtype=args.storage, hidden_size=args.hidden,
                      layer_ids=list(range(args.layers)))
    usage, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    extract_shards(backend, store, shards, batch_tokens=args.batch_tokens)
    seconds, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    return seconds, (after.ru_utime + after.ru_stime) - (usage.ru_utime + usage.ru_stime)


def store_arguments(description: str) -> argparse.ArgumentParser:
    """The options of a bench that feeds the store with ready states (this one, window_read_back.py)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=None, help="the store's folder (default: a temporary one)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4, help="captured layers (EAGLE-3: three aux + the final)")
    p.add_argument("--tokens", type=int, default=524_288)
    p.add_argument("--batch-tokens", type=int, default=65_536)
    p.add_argument("--shard-tokens", type=int, default=131_072)
    p.add_argument("--storage", default="bfloat16", choices=["bfloat16", "fp8"])
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved; the best is kept")
    p.add_argument("--json", type=Path, default=None)
    return p


def plan_shards(p: argparse.ArgumentParser, args) -> tuple[list[tuple[int, list[dict]]], int]:
    """Shards of samples of ``SAMPLE_TOKENS`` tokens as ``extract_shards`` takes them, and their tokens."""
    if min(args.batch_tokens, args.shard_tokens) < SAMPLE_TOKENS or args.tokens < args.shard_tokens:
        p.error(f"--batch-tokens and --shard-tokens take at least one sample ({SAMPLE_TOKENS} tokens), "
                "and --tokens at least one shard")
    samples = [{"id": f"s{i}", "input_ids": [1] * SAMPLE_TOKENS, "loss_mask": [1] * SAMPLE_TOKENS}
               for i in range(args.tokens // SAMPLE_TOKENS)]
    per_shard = args.shard_tokens // SAMPLE_TOKENS
    shards = [(n, samples[n * per_shard:(n + 1) * per_shard]) for n in range(len(samples) // per_shard)]
    return shards, sum(len(s) for _, s in shards) * SAMPLE_TOKENS


def main(argv=None) -> dict:
    p = store_arguments(__doc__.split("\n")[0])
    p.add_argument("--prefill", type=float, default=42_400.0, help="the engine's plain prefill, tokens/s")
    args = p.parse_args(argv)
    shards, tokens = plan_shards(p, args)
    folder = args.out or Path(tempfile.mkdtemp(prefix="store-rate-"))
    folder.mkdir(parents=True, exist_ok=True)
    layer_ids = list(range(args.layers))
    backend = ReadyStates(layer_ids, args.batch_tokens, args.hidden, fp8=args.storage == "fp8")
    try:
        runs = {"store": [], "page cache": []}
        for _ in range(args.repeats):  # interleaved: neither mode gets the fresher file system
            with page_cache_only():
                runs["page cache"].append(run_store(backend, folder, shards, args))
            runs["store"].append(run_store(backend, folder, shards, args))
        (seconds, cpu_seconds), (cache_seconds, cache_cpu_seconds) = min(runs["store"]), min(runs["page cache"])
        direct = direct_io_pays(folder)
        row_bytes = args.hidden + 4 if args.storage == "fp8" else args.hidden * 2  # fp8: values and a scale
        state_bytes = tokens * args.layers * row_bytes
        result = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                  "captured_gb_per_s": state_bytes / seconds / 1e9, "cpu_seconds": cpu_seconds, "direct_io": direct,
                  "ceiling_vs_prefill": tokens / seconds / args.prefill,
                  "page_cache": {"seconds": cache_seconds, "captured_gb_per_s": state_bytes / cache_seconds / 1e9,
                                 "cpu_seconds": cache_cpu_seconds},
                  "one_core_gb_per_s": one_core_rates(backend.states[0], folder),
                  "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "args": {**vars(args), "out": str(folder),
                                                                                        "json": str(args.json)}}
    finally:
        if args.out is None:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            shutil.rmtree(folder / "store", ignore_errors=True)
    print(f"store ({args.storage}) on {folder}: {tokens} tokens in {seconds:.2f} s = {result['tokens_per_s']:,.0f} "
          f"tokens/s, {result['captured_gb_per_s']:.2f} GB/s of captured states; "
          f"at most {result['ceiling_vs_prefill']:.2f}x a prefill of {args.prefill:,.0f} tokens/s")
    cache = result["page_cache"]
    print(f"  direct I/O {'on' if result['direct_io'] else 'off (not a local disk file system)'}, CPU {cpu_seconds:.1f} s; "
          f"through the page cache {cache['captured_gb_per_s']:.2f} GB/s, CPU "
          f"{cache['cpu_seconds']:.1f} s: the store {cache['seconds'] / seconds:.2f}x its rate")
    print("one core: " + ", ".join(f"{k} {v:.2f}" + ("" if k.endswith("CPU s") else " GB/s")
                                   for k, v in result["one_core_gb_per_s"].items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
