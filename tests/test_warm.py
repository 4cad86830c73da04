"""The warm target: engines that outlive their job, attached to by the next job of the same key.

Each "job" here is a process of its own that opens the target's engine the way the stages do
(``VllmServer``) with ``DRAFTSMITH_KEEP_WARM_S`` set, as the workflow sets it: the first loads the
target in an engine process, the next attaches to it; a changed target, a dead engine or a crashed
job are what a user's runs meet.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from draftsmith.engines import warm
from draftsmith.engines.registry import (
    ENGINE_DIR_ENV,
    engine_alive,
    engine_state,
    idle_engines,
    list_engines,
    say_warm_engines,
    stop_engine,
)
from draftsmith.engines.registry import registry as registry_root
from draftsmith.errors import DraftsmithError
from tiny_vllm import ENGINE_ARGS, HAS_VLLM, vllm_test

JOB = textwrap.dedent("""
    import json, logging, os, sys
    sys.path.insert(0, {tests!r})
    from draftsmith.logs import setup_logging
    from draftsmith.engines.vllm_serving import VllmServer
    import draftsmith.placement
    if __name__ == "__main__":
        if os.environ.get("MACHINE_MEMORY"):  # a machine of this much memory
            draftsmith.placement.host_memory_bytes = lambda: int(os.environ["MACHINE_MEMORY"])
        setup_logging({log!r})
        with VllmServer({model!r}, dtype="float32", max_model_len=64, **{engine_args!r}) as server:
            if os.environ.get("CRASH_AFTER_ATTACH"):
                os._exit(3)  # a job killed while attached (no detach, no clean-up)
            served, _, _ = server.generate([[5, 6, 7, 8], [40, 41]], max_new_tokens=8)
            print("RESULT", json.dumps({{"tokens": [s.tokens for s in served], "loaded": server.engine.loaded,
                                         "imported_vllm": "vllm" in sys.modules}}))
""")


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A registry of this test's own, every engine in it stopped afterwards."""
    folder = tmp_path / "engines"
    monkeypatch.setenv("DRAFTSMITH_ENGINE_DIR", str(folder))
    yield folder
    for engine in list_engines():
        stop_engine(Path(engine["folder"]))


def run_job(model: Path, log: Path, *, keep_warm: float = 120, crash: bool = False,
            machine_memory: int | None = None) -> dict | None:
    """One job's process: its result, or None when it was made to crash."""
    script = JOB.format(tests=str(Path(__file__).parent), log=str(log), model=str(model), engine_args=ENGINE_ARGS)
    env = {**os.environ, "DRAFTSMITH_KEEP_WARM_S": str(keep_warm), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", **({"CRASH_AFTER_ATTACH": "1"} if crash else {}),
           **({"MACHINE_MEMORY": str(machine_memory)} if machine_memory else {})}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    if crash:
        assert out.returncode == 3, out.stderr[-3000:]
        return None
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT", 1)[1])


def loads_in(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "target load" in line]


@vllm_test
def test_the_next_job_attaches_and_a_crashed_one_leaves_the_engine_usable(tmp_path, registry, monkeypatch):
    # a registry deep in a project folder: its sockets' paths are longer than a Unix socket's address holds
    deep = registry / ("a-project-folder-of-a-long-name-" * 3)
    monkeypatch.setenv(ENGINE_DIR_ENV, str(deep))
    model = tiny.build_llama(tmp_path / "target", num_layers=2)
    first = run_job(model, tmp_path / "first.log")
    assert first["loaded"] and len(loads_in(tmp_path / "first.log")) == 1
    assert not first["imported_vllm"]  # the engine's process imports it: the job would wait for its own import
    # where the engine process's start went beyond vLLM's own load, each step timed
    [start] = re.findall(r"was ready ([\d.]+) s after its process started: (.*)", (tmp_path / "first.log").read_text())
    phases = dict(phase.rsplit(" ", 2)[:2] for phase in start[1].strip().split(", "))
    assert list(phases) == ["the process and its imports", "importing vLLM", "vLLM's load"]
    assert 0 < sum(map(float, phases.values())) <= float(start[0]) + 0.05 * (len(phases) + 1)  # each rounded to 0.1 s
    [engine] = list_engines()
    assert engine["alive"] and engine["status"] == "ready" and engine["attached"] is None
    assert len(os.fsencode(Path(engine["folder"]) / "socket")) > 108

    again = run_job(model, tmp_path / "again.log")
    assert not again["loaded"] and again["tokens"] == first["tokens"]
    assert not again["imported_vllm"]  # requests and answers in plain data: seconds of imports saved
    assert loads_in(tmp_path / "again.log") == []  # no load of the target, and the log says what it did instead
    assert "attached to the warm target engine" in (tmp_path / "again.log").read_text()

    run_job(model, tmp_path / "crashed.log", crash=True)
    after = run_job(model, tmp_path / "after.log")
    assert not after["loaded"] and after["tokens"] == first["tokens"]
    [engine] = list_engines()
    assert engine["jobs"] == 4 and engine["pid"] == engine_state(Path(engine["folder"]))["pid"]


@vllm_test
def test_changed_weights_never_meet_a_stale_engine(tmp_path, registry):
    """Weights rewritten in place: another key, so a cold load with the new weights (and the idle
    engine of the old ones, on the same devices, stopped first)."""
    model = tiny.build_llama(tmp_path / "target", num_layers=2)
    first = run_job(model, tmp_path / "first.log")
    [old] = list_engines()
    weights = load_file(model / "model.safetensors")
    weights = {name: (-w if name.endswith("lm_head.weight") else w) for name, w in weights.items()}
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    changed = run_job(model, tmp_path / "changed.log")
    assert changed["loaded"] and changed["tokens"] != first["tokens"]
    assert "stopped the idle warm engine " + old["key"] in (tmp_path / "changed.log").read_text()
    engines = {e["key"]: e for e in list_engines()}
    assert not engines[old["key"]]["alive"] and engines[old["key"]]["status"] == "exited"
    assert [e["alive"] for k, e in engines.items() if k != old["key"]] == [True]


@vllm_test
def test_a_dead_engine_means_a_cold_load_said_in_the_log(tmp_path, registry):
    model = tiny.build_llama(tmp_path / "target", num_layers=2)
    first = run_job(model, tmp_path / "first.log")
    [engine] = list_engines()
    os.kill(engine["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine_state(Path(engine["folder"]))["alive"] and time.monotonic() < deadline:
        time.sleep(0.1)
    again = run_job(model, tmp_path / "again.log")
    assert again["loaded"] and again["tokens"] == first["tokens"]
    text = (tmp_path / "again.log").read_text()
    assert f"the warm target engine {engine['key']} (pid {engine['pid']}) is gone" in text and "loading the target cold" in text
    assert len(loads_in(tmp_path / "again.log")) == 1


@vllm_test
def test_an_idle_engine_exits(tmp_path, registry):
    model = tiny.build_llama(tmp_path / "target", num_layers=2)
    run_job(model, tmp_path / "first.log", keep_warm=2)
    [engine] = list_engines()
    deadline = time.monotonic() + 60
    while engine_state(Path(engine["folder"]))["alive"] and time.monotonic() < deadline:
        time.sleep(0.2)
    state = engine_state(Path(engine["folder"]))
    assert not state["alive"] and state["status"] == "exited" and state["reason"] == "idle for 2 s"


@vllm_test
def test_a_target_too_large_for_the_machines_memory_asleep_is_not_kept_warm(tmp_path, registry):
    """Asleep, an engine's weights sit in host memory: where they would take more than 80% of it, the
    job's engine is its own (a load each job, said in its log) and no engine process stays behind."""
    model = tiny.build_llama(tmp_path / "target", num_layers=2)
    weights = (model / "model.safetensors").stat().st_size
    first = run_job(model, tmp_path / "first.log", machine_memory=weights)
    again = run_job(model, tmp_path / "again.log", machine_memory=weights)
    assert first["loaded"] and again["loaded"] and again["tokens"] == first["tokens"]
    assert list_engines() == []
    text = (tmp_path / "again.log").read_text()
    assert len(loads_in(tmp_path / "again.log")) == 1
    assert f"would take more than 80% of this machine's {weights / 1e9:.1f} GB" in text
    assert "the engine is this job's own and ends with it" in text
    kept = run_job(model, tmp_path / "kept.log", machine_memory=2 * weights)  # 50%: kept warm
    assert kept["loaded"] and [e["alive"] for e in list_engines()] == [True]


def shared_engine_case(tmp_path: Path, max_seq_len: int) -> tuple[Path, dict]:
    """A one-layer Llama with its target.json in ``tmp_path`` (as inspect_target writes the fields
    engines.shared reads), and a config under which capture and evaluation share an engine."""
    model = tiny.build_llama(tmp_path / "target", num_layers=1)
    target = {"model_path": str(model), "architecture": "LlamaForCausalLM", "hidden_size": 64, "vocab_size": 384,
              "aux_layer_ids": [0], "text_config": {"max_position_embeddings": 512},
              "backends": {"vllm": {"supported": True, "supports_eagle3": True}}}
    (tmp_path / "target.json").write_text(json.dumps(target))
    config = {"eval": {"backend": "vllm", "separate_engines": False, "max_new_tokens": 20, "k": 3},
              "extraction": {"backend": "vllm", "max_model_len": None}, "data": {"max_seq_len": max_seq_len},
              "warm_target": {"minutes": 10}, "draft": {"variant": "eagle3", "num_layers": 1},
              "train": {"ttt_steps": 3}, "vocab": {"draft_vocab_size": 64}}
    return model, config


def test_a_target_too_large_to_keep_warm_gets_no_shared_engine(tmp_path, monkeypatch, caplog):
    """Capture and evaluation share an engine only where it can stay warm: the same measure of the
    weights against the machine's memory as each job's engine."""
    from draftsmith import placement
    from draftsmith.engines import shared

    model, config = shared_engine_case(tmp_path, max_seq_len=16)
    weights = (model / "model.safetensors").stat().st_size
    (model / "original").mkdir()  # a copy in another format, which vLLM does not load, counts for nothing
    (model / "original" / "consolidated.00.pth").write_bytes(bytes(4 * weights))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(placement, "host_memory_bytes", lambda: 2 * weights)
    assert shared.SharedEngine.from_config(config, tmp_path / "target.json") is not None
    monkeypatch.setattr(placement, "host_memory_bytes", lambda: weights)
    assert shared.SharedEngine.from_config(config, tmp_path / "target.json") is None
    assert "capture and evaluation load the target each in their own engine" in caplog.text


def test_regeneration_shares_the_engine_where_it_runs_eager_anyway(tmp_path, monkeypatch):
    """Greedy regeneration decodes in the shared engine only in vLLM, eager anyway (its setting, or the
    CPU build) and with extraction's engine environment; the engine's context then holds a whole
    answer after data.max_seq_len tokens, within the target's own positions."""
    from draftsmith.engines import shared
    from draftsmith.targets import vllm_install

    _, config = shared_engine_case(tmp_path, max_seq_len=100)
    config["regenerate"] = {"enabled": True, "backend": "vllm", "max_new_tokens": 300, "enforce_eager": True,
                            "temperature": 0.0}
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(vllm_install, "vllm_cpu_build", lambda: False)

    def engine(**regenerate) -> shared.SharedEngine:
        return shared.SharedEngine.from_config({**config, "regenerate": {**config["regenerate"], **regenerate}},
                                               tmp_path / "target.json")

    assert engine().regeneration == 400 and engine().max_model_len == 400
    assert shared.SharedEngine.for_regeneration(config, tmp_path / "target.json") == engine()
    assert engine(max_new_tokens=1000).max_model_len == 512  # the target's own positions
    assert engine(enforce_eager=False).regeneration is None  # CUDA graphs: an engine of its own
    assert engine(enforce_eager=False).max_model_len == 100 + 20 + 3 + 1
    assert engine(temperature=0.7).regeneration is None  # sampled: its draws would follow the slot's proposals
    assert engine(backend="hf").regeneration is None and engine(enabled=False).regeneration is None
    monkeypatch.setattr(vllm_install, "vllm_cpu_build", lambda: True)
    assert engine(enforce_eager=False).regeneration == 400
    config["engine_env"] = {"regenerate_responses": {"VLLM_ATTENTION_BACKEND": "FLEX_ATTENTION"}}
    assert engine().regeneration is None
    assert shared.SharedEngine.for_regeneration(config, tmp_path / "target.json") is None
    # what the rule keys regeneration's output by: the config alone
    assert shared.regeneration_context({**config, "engine_env": {}}) == 400
    assert shared.regeneration_context({**config, "engine_env": {}, "warm_target": {"minutes": 0}}) is None


def test_an_engines_key_follows_what_it_computes(tmp_path, monkeypatch):
    """The key changes with the target's content, a draft's, any engine argument, the GPUs and the
    engine's environment; not with the job's own thread count."""
    for name in ("DRAFTSMITH_JOB_GPUS", "CUDA_VISIBLE_DEVICES", "VLLM_ATTENTION_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    model = tiny.build_llama(tmp_path / "target", num_layers=1)
    draft = tmp_path / "draft"
    draft.mkdir()
    save_file({"w": torch.zeros(2)}, draft / "model.safetensors")
    args = {"model": str(model), "dtype": "float32", "max_model_len": 64,
            "speculative_config": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}}

    def key(**changes) -> str:
        return warm.engine_key(warm.engine_identity({**args, **changes}))

    base = key()
    assert key() == base
    assert key(max_model_len=128) != base
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert key() == base
    monkeypatch.setenv("DRAFTSMITH_JOB_GPUS", "GPU-1")
    on_gpu_1 = key()
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASH_ATTN")
    assert len({base, on_gpu_1, key()}) == 3
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND")
    save_file({"w": torch.ones(3)}, draft / "model.safetensors")  # a draft trained again, same folder
    assert key() != on_gpu_1
    retrained = key()
    (model / "config.json").write_text((model / "config.json").read_text().replace("}", ', "x": 1}', 1))
    assert key() != retrained


def test_a_stage_names_the_shared_engine_as_capture_does_whatever_it_asks_of_its_own(tmp_path):
    """Regeneration and evaluation pass the arguments their own engines would take; those the shared
    engine sets itself (its context, eager, its batching) are its own, the rest reach it as they
    reach capture's, so all three name one engine."""
    from draftsmith.engines.shared import SharedEngine, capture_engine_args

    model = str(tiny.build_llama(tmp_path / "target", num_layers=1))
    shared = SharedEngine(max_model_len=1280, speculative_tokens=3, slot={"draft": "settings"})
    capture = capture_engine_args(model, tensor_parallel_size=1, dtype="bfloat16", max_model_len=1024,
                                  shared=shared, **ENGINE_ARGS)
    asked = dict(max_model_len=512, enforce_eager=False, max_num_seqs=64, max_num_batched_tokens=2048,
                 language_model_only=False)
    args, slot = shared.slot_engine(model, tensor_parallel_size=1, dtype="bfloat16", trust_remote_code=False,
                                    **ENGINE_ARGS, **asked)
    assert args == capture and args["max_model_len"] == 1280 and args["enforce_eager"] is True
    assert slot == {"slot": {"draft": "settings"}, "num_speculative_tokens": 3}


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_without_keep_warm_the_engine_is_the_jobs_own(monkeypatch):
    """The Python API, tests and benches (no DRAFTSMITH_KEEP_WARM_S) and SLURM jobs (which end every
    process of theirs) load in their own process."""
    monkeypatch.delenv("DRAFTSMITH_KEEP_WARM_S", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert warm.keep_warm_seconds() == 0
    monkeypatch.setenv("DRAFTSMITH_KEEP_WARM_S", "600")
    assert warm.keep_warm_seconds() == 600
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert warm.keep_warm_seconds() == 0


SHARED_JOB = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    from draftsmith.engines.shared import SharedEngine
    from draftsmith.evaluate import EvalSettings, Prompt
    from draftsmith.evaluate.vllm import evaluate_in_vllm
    from draftsmith.extract.vllm_backend import VllmBackend
    from draftsmith.io import read_json
    from draftsmith.logs import setup_logging
    from tiny_vllm import ENGINE_ARGS
    if __name__ == "__main__":
        setup_logging({log!r})
        config, target = json.loads({config!r}), read_json({target_json!r})
        shared = SharedEngine.from_config(config, {target_json!r}) if {shared!r} else None
        if {stage!r} == "regenerate":
            from transformers import AutoTokenizer
            from draftsmith.regenerate.answering import open_regenerators
            from draftsmith.regenerate.settings import RegenerateSettings
            settings = RegenerateSettings(backend="vllm", max_new_tokens=12, model_dtype="float32", device="cpu")
            tokenizer = AutoTokenizer.from_pretrained(target["model_path"])
            with open_regenerators(target["model_path"], tokenizer, [settings], engine_kwargs=ENGINE_ARGS,
                                   shared_engine=shared) as [regenerator]:
                answers = regenerator.generate(list(json.loads({prompts!r}).values()), seed=0)
            print("RESULT", json.dumps({{"answers": answers}}))
        elif {stage!r} == "capture":
            with VllmBackend(target["model_path"], target["captured_layer_ids"], dtype="float32", max_model_len=16,
                             shared=shared, **ENGINE_ARGS) as backend:
                states = backend.capture([[20, 21, 22, 23], [30, 31]])
            print("RESULT", json.dumps({{"rows": [len(s[target["final_layer_id"]]) for s in states]}}))
        else:
            settings = EvalSettings(backend="vllm", k=3, max_new_tokens=20, model_dtype="float32", device="cpu")
            prompts = [Prompt(name, ids) for name, ids in json.loads({prompts!r}).items()]
            result = evaluate_in_vllm(target, {draft!r}, prompts, settings, dtype="float32", stop_ids=[],
                                      shared=shared, **ENGINE_ARGS)
            print("RESULT", json.dumps(result))
""")


@vllm_test
def test_regeneration_capture_and_evaluation_share_one_engine(tmp_path, registry):
    """Regeneration (eager anyway on the CPU) starts the engine with evaluation's speculator slot and
    writes the answers an engine of its own writes (vLLM verifies every drafted token); extraction
    attaches to it; evaluation attaches, loads the trained draft into the slot in place and serves it:
    one load of the target for the three, and the same figures as the draft served by an engine of
    its own (the cycle target's, known in advance)."""
    from test_vllm_serving import CYCLE_PROMPTS, CYCLE_STEPS, build_cycle_draft, build_cycle_target

    from draftsmith.targets.inspect import inspect_target, write_target_json

    build_cycle_target(tmp_path / "target")
    write_target_json(tmp_path / "target.json", tmp_path / "target")
    target = inspect_target(tmp_path / "target")
    draft = build_cycle_draft(target, tmp_path / "draft")
    config = {"eval": {"backend": "vllm", "separate_engines": False, "max_new_tokens": 20, "k": 3},
              "extraction": {"backend": "vllm", "max_model_len": None}, "data": {"max_seq_len": 16},
              "warm_target": {"minutes": 10}, "draft": {"variant": "eagle3", "num_layers": 1},
              "train": {"ttt_steps": 3}, "vocab": {"draft_vocab_size": target["hidden_size"]},
              "regenerate": {"enabled": True, "backend": "vllm", "max_new_tokens": 12, "enforce_eager": False}}

    def job(stage: str, name: str, *, shared: bool = True) -> dict:
        log = tmp_path / f"{name}.log"
        script = SHARED_JOB.format(tests=str(Path(__file__).parent), log=str(log), config=json.dumps(config),
                                   target_json=str(tmp_path / "target.json"), shared=shared, stage=stage,
                                   prompts=json.dumps(CYCLE_PROMPTS), draft=str(draft))
        env = {**os.environ, "DRAFTSMITH_KEEP_WARM_S": "120" if shared else "0",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return {**json.loads(out.stdout.split("RESULT", 1)[1]), "log": log.read_text()}

    regenerated = job("regenerate", "regenerate")
    assert len(loads_in(tmp_path / "regenerate.log")) == 1
    assert "shared with capture and evaluation" in regenerated["log"]
    assert re.search(r"ready [\d.]+ s after its process started: .*the speculator slot's draft [\d.]+ s",
                     regenerated["log"])
    captured = job("capture", "capture")
    assert captured["rows"] == [4, 2] and loads_in(tmp_path / "capture.log") == [], captured["log"]
    assert "attached to the warm target engine" in captured["log"]
    shared = job("evaluate", "evaluate")
    assert loads_in(tmp_path / "evaluate.log") == [], shared["log"]  # no load of the target: attached
    assert "loaded into the speculator slot of the engine shared with capture" in shared["log"]
    [engine] = [e for e in list_engines() if e["alive"]]
    assert engine["jobs"] == 3
    own = job("evaluate", "own-engine", shared=False)
    assert len(loads_in(tmp_path / "own-engine.log")) == 1
    # a job's own engine on the same devices: the idle shared engine is stopped first
    assert f"stopped the idle warm engine {engine['key']}" in own["log"]
    assert not engine_alive(Path(engine["folder"]))
    for key in ("tau", "acceptance_rate_by_position", "num_tokens", "lossless"):
        assert shared[key] == own[key], key
    steps = sum(CYCLE_STEPS.values(), [])
    assert shared["tau"] == pytest.approx(1 + sum(steps) / len(steps))
    assert shared["vllm"]["speculative_config"]["model"] == str(draft)
    own_answers = job("regenerate", "own-regeneration", shared=False)
    assert len(loads_in(tmp_path / "own-regeneration.log")) == 1
    assert regenerated["answers"] == own_answers["answers"]
    assert all(len(a) == 12 for a in own_answers["answers"])  # the cycle target never stops: every answer whole


def test_the_end_of_a_run_says_which_engines_stay_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTSMITH_ENGINE_DIR", str(tmp_path / "engines"))
    say_warm_engines()
    assert capsys.readouterr().err == ""
    folder = registry_root() / "0123456789abcdef"
    folder.mkdir()
    (folder / "state.json").write_text(json.dumps({"status": "ready", "pid": os.getpid()}))
    # a process holding the engine's lock, as an engine process holds it
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.lockf(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(folder / "lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        say_warm_engines()
    finally:
        holder.kill()
        holder.wait()
    said = capsys.readouterr().err
    assert "1 warm target engine(s) stay up" in said and "python -m draftsmith.engines list | stop" in said
    assert not engine_alive(folder)  # the lock goes with its process


def test_a_registry_that_is_not_the_users_alone_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("DRAFTSMITH_ENGINE_DIR", str(shared))
    with pytest.raises(DraftsmithError, match="is not this user's alone") as error:
        registry_root()
    assert "DRAFTSMITH_ENGINE_DIR" in error.value.fix


# An engine process as the registry sees it (its lock, its state), without vLLM: ready and idle
# until SIGTERM, which it records before it exits.
FAKE_ENGINE = textwrap.dedent("""
    import fcntl, json, os, signal, sys, time
    folder = sys.argv[1]
    lock = open(os.path.join(folder, "lock"), "a")
    fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    def stop(*_):
        state = json.load(open(os.path.join(folder, "state.json")))
        open(os.path.join(folder, "stopped"), "w").write(json.dumps({"attached": state.get("attached")}))
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    json.dump({"status": "ready", "pid": os.getpid(), "attached": None}, open(os.path.join(folder, "state.json"), "w"))
    while True:
        time.sleep(1)
""")


def fake_engine(root: Path, key: str, *, gpus: str, model: str) -> subprocess.Popen:
    folder = root / key
    folder.mkdir(mode=0o700)
    (folder / "spec.json").write_text(json.dumps({"identity": {"gpus": gpus}, "kwargs": {"model": model}}))
    process = subprocess.Popen([sys.executable, "-c", FAKE_ENGINE, str(folder)])
    deadline = time.monotonic() + 30
    while not (folder / "state.json").exists() or not engine_alive(folder):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    return process


def test_an_engine_a_job_came_to_since_the_list_is_not_stopped(tmp_path, monkeypatch):
    """A new engine stops the idle ones beside it from a list read once; an engine a job attached to
    (or is attaching to) since then is left serving it, an engine still idle is stopped."""
    root = tmp_path / "engines"
    monkeypatch.setenv(ENGINE_DIR_ENV, str(root))
    registry_root()
    engines = {key: fake_engine(root, key, gpus="GPU-0", model="/m/other") for key in ("attached", "attaching", "idle")}
    try:
        listed = idle_engines()
        assert sorted(e["key"] for e in listed) == sorted(engines)
        state = json.loads((root / "attached" / "state.json").read_text())
        (root / "attached" / "state.json").write_text(json.dumps({**state, "attached": 4242}))  # a job came
        with open(root / "attaching" / "start.lock", "a") as attaching:
            import fcntl

            fcntl.flock(attaching, fcntl.LOCK_EX)  # a job attaching holds the start lock
            monkeypatch.setattr(warm, "idle_engines", lambda engines: listed)
            warm._stop_idle_beside("new", "GPU-0,GPU-1", str(tmp_path / "target"))
        assert engine_alive(root / "attached") and engine_alive(root / "attaching")
        assert not engine_alive(root / "idle")
        assert json.loads((root / "idle" / "stopped").read_text()) == {"attached": None}
    finally:
        for process in engines.values():
            process.kill()
            process.wait()


def test_idle_engines_asleep_never_pin_more_than_the_machine_allows_between_them(tmp_path, monkeypatch):
    """Each target passes the one-engine memory rule; two of them asleep with the new one would not:
    the idle one on other GPUs is stopped before the new one starts. A job that loads an engine of its
    own stops the idle ones on its GPUs (an engine asleep still holds some of a GPU's memory)."""
    from draftsmith import placement

    root = tmp_path / "engines"
    monkeypatch.setenv(ENGINE_DIR_ENV, str(root))
    registry_root()
    targets = {}
    for name in ("a", "b", "c"):
        targets[name] = tmp_path / name
        targets[name].mkdir()
        (targets[name] / "model.safetensors").write_bytes(b"0" * 300)
    monkeypatch.setattr(placement, "host_memory_bytes", lambda: 1000)  # 800 bytes may sleep, one target 300
    assert warm.too_large_to_keep(targets["a"]) is None
    engines = {"a": fake_engine(root, "a", gpus="GPU-0", model=str(targets["a"])),
               "b": fake_engine(root, "b", gpus="GPU-1", model=str(targets["b"]))}
    try:
        state = json.loads((root / "b" / "state.json").read_text())
        (root / "b" / "state.json").write_text(json.dumps({**state, "attached": 4242}))  # b serves a job
        warm._stop_idle_beside("c", "GPU-2", str(targets["c"]))  # 900 bytes asleep with a and b: a goes
        assert not engine_alive(root / "a") and engine_alive(root / "b")

        (root / "b" / "state.json").write_text(json.dumps(state))  # b idle again
        warm._stop_idle_beside(None, "GPU-3", None)  # a job's own engine elsewhere: b stays
        assert engine_alive(root / "b")
        warm._stop_idle_beside(None, "GPU-1,GPU-3", None)  # on b's GPU: b goes
        assert not engine_alive(root / "b")
    finally:
        for process in engines.values():
            process.kill()
            process.wait()


@pytest.fixture
def service_main(tmp_path, monkeypatch):
    """``service.main`` on a folder of this test's, in this process (its SIGTERM handler put back after)."""
    from draftsmith.engines import service

    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the test process keeps its own handlers
    folder = tmp_path / "engine"
    folder.mkdir()
    (folder / "spec.json").write_text(json.dumps({"kwargs": {}, "what": "a test engine", "keep_warm_s": 1}))
    return service, folder


def test_a_new_engine_takes_its_lock_from_a_liveness_probe(service_main, monkeypatch):
    """Whoever asks whether an engine is alive takes its lock for an instant; an engine starting in that
    instant waits it out instead of exiting as if another engine held the folder."""
    service, folder = service_main

    def load(folder, spec, state):
        raise RuntimeError("the load, reached")

    monkeypatch.setattr(service, "_load", load)
    probe = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, time
        f = open({str(folder / "lock")!r}, "a")
        fcntl.lockf(f, fcntl.LOCK_EX)
        open({str(folder / "probing")!r}, "w").close()
        time.sleep(0.5)
    """)])
    while not (folder / "probing").exists():
        time.sleep(0.01)
    assert service.main(folder) == 1
    probe.wait()
    state = json.loads((folder / "state.json").read_text())
    assert state["status"] == "failed" and state["error"]["message"] == "the load, reached"


def test_an_engine_that_cannot_write_its_state_still_shuts_down(service_main, monkeypatch):
    """A full disk while the engine records a job or its exit: vLLM is shut down all the same, and the
    speculator slot's draft it built is removed."""
    from draftsmith.engines.plain import ServedLLM
    from draftsmith.io import storage_error
    from draftsmith.targets import vllm_compat

    service, folder = service_main
    (folder / "slot-draft").mkdir()
    (folder / "slot-draft" / "model.safetensors").write_bytes(b"0" * 1024)
    shut = []
    monkeypatch.setattr(service, "_load", lambda folder, spec, state: (ServedLLM("the engine"), 0.1))
    monkeypatch.setattr(vllm_compat, "shutdown_llm", lambda llm, set_num_threads: shut.append(llm))
    monkeypatch.setattr("draftsmith.engines.warm.engine_max_model_len", lambda llm, asked: 64)
    written = service._write

    def write(folder, state):
        if state["status"] not in ("loading", "ready"):
            raise storage_error(folder / "state.json", OSError(28, "No space left on device"))
        written(folder, state)

    def serve(folder, llm, listener, state, sleeps):
        write(folder, {**state, "status": "attached"})  # a job's arrival, recorded on a full disk

    monkeypatch.setattr(service, "_write", write)
    monkeypatch.setattr(service, "_serve", serve)
    service.main(folder)
    assert shut == ["the engine"]
    assert not (folder / "slot-draft").exists()


# The engine process itself (draftsmith.engines.service) around a stand-in for vLLM's LLM.
SERVICE_WITHOUT_VLLM = textwrap.dedent("""
    import logging, os, sys, time
    from pathlib import Path
    from draftsmith.engines import service

    class StandIn:  # plain.ServedLLM's calls, with no vLLM behind them
        llm = None
        def generate(self, prompts, *args, **kwargs):
            if os.environ.get("STAND_IN_SECONDS"):  # a long call, which it says it has begun
                Path(sys.argv[1], "generating").touch()
                time.sleep(float(os.environ["STAND_IN_SECONDS"]))
            return [list(p) for p in prompts]
        def collective_rpc(self, *args, **kwargs):
            return [None]

    service._load = lambda folder, spec, state: (StandIn(), 0.1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    sys.exit(service.main(Path(sys.argv[1])))
""")


def test_an_engine_takes_the_idle_time_of_the_latest_job(tmp_path, monkeypatch):
    """An engine started by a run with a long warm_target.minutes exits after the idle time of the
    job that came last, so that a run that lowers it lowers it for the engines it uses."""
    folder = tmp_path / "engine"
    engine = stand_in_engine(folder)
    try:
        monkeypatch.setenv("DRAFTSMITH_KEEP_WARM_S", "1")
        remote = warm.RemoteLLM(folder, "stand-in")
        remote.attach()
        assert remote.generate([[1, 2, 3]]) == [[1, 2, 3]]
        remote.detach()
        assert engine.wait(timeout=30) == 0
        assert engine_state(folder)["reason"] == "idle for 1 s"
    finally:
        engine.kill()
        engine.wait()


def stand_in_engine(folder: Path, **env) -> subprocess.Popen:
    """The engine process around the stand-in for vLLM, ready."""
    folder.mkdir(mode=0o700)
    (folder / "spec.json").write_text(json.dumps({"kwargs": {"max_model_len": 64}, "what": "a stand-in engine",
                                                  "keep_warm_s": 3600}))
    engine = subprocess.Popen([sys.executable, "-c", SERVICE_WITHOUT_VLLM, str(folder)], env={**os.environ, **env})
    deadline = time.monotonic() + 60
    while engine_state(folder).get("status") != "ready":
        assert time.monotonic() < deadline and engine.poll() is None
        time.sleep(0.05)
    return engine


def test_a_job_killed_mid_call_keeps_its_gpus_until_the_engine_is_done(tmp_path, monkeypatch):
    """The engine holds the job's device locks while it works for it: a job killed during a call
    leaves its GPU claimed until the engine has finished that call, so that no other job starts on
    a GPU the engine still computes on."""
    from draftsmith.placement import DEVICES_ENV, LOCK_DIR_ENV, PlacementError, claim_devices

    monkeypatch.setenv(DEVICES_ENV, "0")
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    monkeypatch.setenv("DRAFTSMITH_KEEP_WARM_S", "60")
    folder = tmp_path / "engine"
    engine = stand_in_engine(folder, STAND_IN_SECONDS="4")
    job = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from pathlib import Path
        from draftsmith.engines import warm
        from draftsmith.placement import engine_placement
        with engine_placement(1):
            remote = warm.RemoteLLM(Path({str(folder)!r}), "stand-in")
            remote.attach()
            remote.generate([[1, 2]])
    """)])
    try:
        deadline = time.monotonic() + 60
        while not (folder / "generating").exists():
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.02)
        job.kill()
        job.wait()
        with pytest.raises(PlacementError):  # the engine still computes for the dead job on GPU 0
            claim_devices(1, timeout=0)
        claim = claim_devices(1, timeout=30)  # free once the call is over
        assert [d.index for d in claim.devices] == ["0"]
        claim.release()
        assert engine.poll() is None  # and the engine serves on
    finally:
        engine.kill()
        engine.wait()


def test_a_request_cut_short_ends_the_session_instead_of_answering_the_next(tmp_path, monkeypatch):
    """A job interrupted (Ctrl-C) while the engine computes must not read that answer as the answer
    to its next request: the session ends, later requests say so, and the engine serves on."""
    monkeypatch.setenv("DRAFTSMITH_KEEP_WARM_S", "60")
    folder = tmp_path / "engine"
    engine = stand_in_engine(folder, STAND_IN_SECONDS="2")

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        remote = warm.RemoteLLM(folder, "stand-in")
        remote.attach()
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            remote.generate([[1, 2]])
        with pytest.raises(warm.EngineGone):
            remote.collective_rpc("draftsmith_reset")
        remote.detach()
        again = warm.RemoteLLM(folder, "stand-in")  # the next job
        again.attach()
        assert again.generate([[3]]) == [[3]]
        again.detach()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        engine.kill()
        engine.wait()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_regeneration_and_capture_load_the_target_once_under_snakemake(tmp_path, registry):
    """The rules as a user runs them, the engines kept warm: regeneration in vLLM (eager on the CPU
    build) starts the engine with evaluation's speculator slot, and extraction attaches to it."""
    from workflow_helpers import snakemake, target_loads, tiny_workflow, write_config

    workdir, config = tiny_workflow(tmp_path)
    config.update(regenerate={"enabled": True, "backend": "vllm", "max_new_tokens": 4, "chunk_size": 64},
                  extraction={"backend": "vllm", "shard_tokens": 512}, eval={"backend": "vllm"},
                  warm_target={"minutes": 10},
                  engine_env={"VLLM_CPU_KVCACHE_SPACE": 1, "VLLM_ENABLE_V1_MULTIPROCESSING": 1})
    snakemake(workdir, "results/t/hidden_states/part-0.json", configfile=write_config(workdir, config))
    loads = target_loads(workdir)
    [(what, _)] = loads["regenerate_responses"]
    assert "shared with capture and evaluation" in what
    assert loads["extract_hidden_states/part-0"] == []
    assert "attached to the warm target engine" in (workdir / "logs/t/extract_hidden_states/part-0.log").read_text()
