"""What the target's identity costs on a checkpoint of a trillion-parameter model's size.

Builds a folder of sparse safetensors files (real headers, holes for the tensor bytes: no disk
space is used) of ``--total-tb`` terabytes in ``--files`` files, as Kimi-K2.5 ships its ~2 TB in 64,
and times ``weights_fingerprint`` on it (every file stat'ed, every header hashed), best of
``--repeats`` runs in this process, the first with the headers out of the page cache.

    python bench/identity.py --work /tmp/identity-bench
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.targets.identity import weights_fingerprint  # noqa: E402


def sparse_checkpoint(folder: Path, files: int, total_bytes: int, tensors_per_file: int) -> None:
    """``files`` safetensors files of total_bytes/files each: a header naming ``tensors_per_file``
    bf16 tensors that fill the file, then a hole where their bytes would be."""
    folder.mkdir(parents=True)
    per_file = total_bytes // files
    per_tensor = per_file // tensors_per_file // 2 * 2
    for f in range(files):
        header = {f"model.layers.{f}.t{t}.weight": {"dtype": "BF16", "shape": [per_tensor // 2],
                                                     "data_offsets": [t * per_tensor, (t + 1) * per_tensor]}
                  for t in range(tensors_per_file)}
        blob = json.dumps(header).encode()
        path = folder / f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(blob)) + blob)
            out.truncate(8 + len(blob) + per_tensor * tensors_per_file)
    (folder / "config.json").write_text('{"model_type": "deepseek_v3"}')


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="a folder to create (removed first)")
    p.add_argument("--files", type=int, default=64)
    p.add_argument("--total-tb", type=float, default=2.0)
    p.add_argument("--tensors-per-file", type=int, default=1000, help="header entries per file (Kimi-K2.5: ~1,000)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    sparse_checkpoint(args.work, args.files, int(args.total_tb * 1e12), args.tensors_per_file)
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        weights_fingerprint(args.work)
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"files": args.files, "total_bytes": int(args.total_tb * 1e12),
                      "tensors_per_file": args.tensors_per_file, "seconds": [round(s, 4) for s in seconds],
                      "best_s": round(min(seconds), 4)}))
    shutil.rmtree(args.work)


if __name__ == "__main__":
    main()
