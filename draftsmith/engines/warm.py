"""The warm target: a vLLM engine that outlives the job that started it, so that a retried stage, a
stage rerun after a patch, and the next stage that needs the same engine attach to it in seconds
instead of loading the target again (about half an hour for a 1T model).

A job asks for an engine by its exact arguments (``open_llm``). Without ``KEEP_WARM_ENV`` set (the
Python API, tests, benches) it gets ``vllm.LLM`` in its own process, as before. With it (the
workflow sets it from ``warm_target.minutes``) the engine runs in a process of its own
(``draftsmith.engines.service``), found by its key in a per-user folder of this machine
(``draftsmith.engines.registry``).

The key hashes everything that decides what the engine computes: every ``LLM`` argument, the
content fingerprint of each folder they name (the target's weights, config and tokenizer; a draft
served as speculator), the draftsmith code the engine process runs (this service, the capture
hooks), the vLLM release, the GPUs (the UUIDs the job claimed), the engine's environment variables
(secrets left out) and the Python running it. A job attaches only to an engine of its own key,
so a changed target, draft, setting, release or GPU set never meets a stale engine. One job at a
time is attached (others queue at the socket; the GPU claims make that rare); a job that dies
leaves the engine serving the next one, and its GPU claim held until the engine has finished the
call it was in (the job passes its device locks' descriptors with its connection). Between jobs a
CUDA engine sleeps (vLLM's sleep mode: its weights in host memory, its GPU memory free for training)
and wakes in seconds when a job attaches;
an engine left idle for ``KEEP_WARM_ENV`` seconds exits. Before a new engine starts, idle engines
on the same GPUs or of the same target are stopped, so that they hold neither GPU nor host memory a
new one needs. If the engine a job expected is gone (exited, crashed, or exiting as the job came),
the job loads cold and says so in its log.
``python -m draftsmith.engines`` lists and stops them. docs/design.md ("The warm target") says how
this fits Snakemake's model of jobs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from draftsmith.engines.loads import target_load
from draftsmith.engines.registry import (
    POLL_S,
    engine_state,
    exit_reason,
    held,
    idle_engines,
    list_engines,
    registry,
    registry_folder,
    socket_address,
    stop_if_idle,
    wait_stopped,
)
from draftsmith.errors import DraftsmithError
from draftsmith.io import atomic_write_json
from draftsmith.placement import JOB_GPUS_ENV, KEEP_WARM_ENV, held_device_locks
from draftsmith.targets.vllm_install import installed_vllm_version, vllm_device_type, vllm_import_error

log = logging.getLogger(__name__)

# The environment an engine's numerics or placement depend on; the rest (OMP_NUM_THREADS, which
# Snakemake sets per rule, paths) is the job's, not the engine's; secrets decide nothing and stay out.
ENGINE_ENV_PREFIXES = ("VLLM_", "NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "NVSHMEM_", "HF_", "TRANSFORMERS_")
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
# The draftsmith code that runs inside the engine process: the service, and the worker extension.
ENGINE_CODE = ("draftsmith.engines.service", "draftsmith.extract.vllm_worker")
# The most of the machine's memory a warm engine's weights may take asleep (too_large_to_keep).
HOST_SHARE_FOR_WEIGHTS = 0.8
WAIT_LOG_S = 60.0
LOG_TAIL_LINES = 40


class EngineStartError(DraftsmithError):
    """The engine process could not load the target."""


class EngineGone(DraftsmithError):
    """The warm engine stopped before or while this job was attached."""


class EngineCallError(DraftsmithError):
    """A call failed inside the warm engine (its log holds the traceback)."""


def keep_warm_seconds() -> float:
    """How long an idle engine stays, from ``KEEP_WARM_ENV``; 0 when engines die with their job
    (also under SLURM, which ends every process of a job with it)."""
    if os.environ.get("SLURM_JOB_ID"):
        return 0.0
    try:
        return max(float(os.environ.get(KEEP_WARM_ENV) or 0), 0.0)
    except ValueError:
        return 0.0


def too_large_to_keep(model_path: str | Path) -> str | None:
    """Why an engine of this target is not kept warm on this machine, or None. Asleep, a CUDA engine
    holds its weights in (pinned) host memory, and a CPU engine always does: weights over
    ``HOST_SHARE_FOR_WEIGHTS`` of the machine's memory would leave too little for the jobs between
    (training, the data loaders), and pinning more than the machine has can stop it. The figure is
    the weight files' size against the machine's total (or its cgroup's limit), so every job of a
    run decides alike."""
    from draftsmith.placement import host_memory_bytes

    folder = Path(model_path)
    weights = weight_bytes(folder)
    memory = host_memory_bytes()
    if weights <= HOST_SHARE_FOR_WEIGHTS * memory:
        return None
    return (f"the target's weights ({weights / 1e9:.1f} GB in {folder}) would take more than "
            f"{HOST_SHARE_FOR_WEIGHTS:.0%} of this machine's {memory / 1e9:.1f} GB of memory while its engine "
            f"sleeps between jobs")


def weight_bytes(model_path: str | Path | None) -> int:
    """The size of the weight files vLLM loads from a target's folder (safetensors only: the
    preflight refuses pickled weights); 0 for what is not a folder."""
    from draftsmith.targets.identity import checkpoint_files

    folder = Path(model_path) if model_path else None
    return sum(p.stat().st_size for p in checkpoint_files(folder)) if folder and folder.is_dir() else 0


# ---------------------------------------------------------------------------------------------
# What an engine is


def engine_identity(kwargs: dict) -> dict:
    """Everything that decides what an engine with these ``LLM`` arguments computes, as JSON."""
    from draftsmith.fingerprint import code_fingerprint
    from draftsmith.targets.identity import weights_fingerprint
    folders = {"model": kwargs.get("model"), "tokenizer": kwargs.get("tokenizer")}
    speculator = kwargs.get("speculative_config") or {}
    if isinstance(speculator, dict) and speculator.get("model"):
        folders["speculator"] = speculator["model"]
    environment = {k: v for k, v in sorted(os.environ.items())
                   if k.startswith(ENGINE_ENV_PREFIXES) and not any(w in k for w in SECRET_WORDS)}
    return {
        "arguments": kwargs,
        "content": {name: weights_fingerprint(path) for name, path in folders.items() if path},
        "code": code_fingerprint(*ENGINE_CODE),
        "vllm": installed_vllm_version(),
        "gpus": _job_gpus(),
        "environment": environment,
        "python": sys.executable,
        "host": socket.gethostname(),
    }


def engine_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def absolute_paths(kwargs: dict) -> dict:
    """``kwargs`` with the folders it names made absolute: the engine process runs in a folder of its
    own, and its key must not depend on the job's working directory."""
    def absolute(path):
        return str(Path(path).resolve()) if path and Path(path).exists() else path

    out = {**kwargs, **{k: absolute(kwargs[k]) for k in ("model", "tokenizer", "download_dir") if kwargs.get(k)}}
    speculator = out.get("speculative_config")
    if isinstance(speculator, dict) and speculator.get("model"):
        out["speculative_config"] = {**speculator, "model": absolute(speculator["model"])}
    return out


# ---------------------------------------------------------------------------------------------
# The engine a job holds


@dataclass
class Engine:
    """A job's handle on the target loaded in vLLM: ``llm`` is ``plain.ServedLLM`` (vLLM in this
    process) or a ``RemoteLLM`` (a warm engine), which answer alike in plain data; ``loaded`` is
    False when the job attached to a warm one."""

    llm: Any
    load_seconds: float
    loaded: bool
    max_model_len: int
    _close: Any = field(repr=False, default=None)
    slot: str | None = None  # the folder of the speculator slot's draft (draftsmith.engines.shared)
    v2_model_runner: bool = False  # vLLM's V2 model runner (targets.vllm_compat.uses_v2_model_runner)

    def close(self) -> None:
        close, self._close = self._close, None
        if close is not None:
            close()


def open_llm(kwargs: dict, *, what: str, set_num_threads, speculator_slot: dict | None = None) -> Engine:
    """The engine for ``vllm.LLM(**kwargs)``: a warm one of the same key when one runs, else a new
    one (kept warm after this job when ``KEEP_WARM_ENV`` says so). ``what`` describes it in the logs
    (``engines.loads``). ``speculator_slot`` ({"slot": ..., "num_speculative_tokens": k}, from
    ``engines.shared``) adds an EAGLE-3 speculator whose draft the engine process builds; it needs a
    warm engine. A load that fails raises; ``EngineStartError`` for one in an engine process."""
    keep_warm = keep_warm_seconds()
    too_large = too_large_to_keep(kwargs["model"]) if keep_warm else None
    if too_large:
        log.warning("%s: the engine is this job's own and ends with it (warm_target does not apply)", too_large)
    if not keep_warm or too_large:
        if speculator_slot is not None:  # engines.shared asks for one only where an engine stays warm
            raise ValueError("a speculator slot is built by a warm engine's process: set DRAFTSMITH_KEEP_WARM_S, "
                             "on a machine whose memory holds the target's weights")
        if registry_folder().is_dir():  # engines a run kept warm before still sleep on these GPUs
            try:
                _stop_idle_beside(None, _job_gpus(), None)
            except DraftsmithError as e:  # a registry that is not the user's alone: this job needs none
                log.warning("the warm engines beside this job are left as they are: %s", e.what)
        return _in_process(kwargs, what, set_num_threads)
    kwargs = absolute_paths(kwargs)
    if vllm_device_type() == "cuda":
        # Between jobs the engine sleeps: its weights in host memory, the GPU free for training.
        kwargs = {**kwargs, "enable_sleep_mode": True}
    identity = {**engine_identity(kwargs), "speculator_slot": speculator_slot}
    key = engine_key(identity)
    folder = registry() / key
    folder.mkdir(exist_ok=True, mode=0o700)
    return _attach_or_start(folder, key, {"kwargs": kwargs, "what": what, "identity": identity,
                                          "speculator_slot": speculator_slot, "keep_warm_s": keep_warm})


def _in_process(kwargs: dict, what: str, set_num_threads) -> Engine:
    try:
        from vllm import LLM
    except ImportError as e:  # installed (the stages found it) but broken
        raise vllm_import_error(e) from e

    from draftsmith.engines.plain import ServedLLM
    from draftsmith.targets.vllm_compat import shutdown_llm, uses_v2_model_runner

    with target_load(what) as load:
        llm = LLM(**kwargs)
    return Engine(ServedLLM(llm), load.seconds, True, engine_max_model_len(llm, kwargs.get("max_model_len")),
                  lambda: shutdown_llm(llm, set_num_threads), v2_model_runner=uses_v2_model_runner(llm))


def engine_max_model_len(llm, asked: int | None) -> int:
    """The context length an engine settled on (the model's own when none was asked for)."""
    engine = getattr(llm, "llm_engine", None)
    config = getattr(engine, "model_config", None) or getattr(getattr(engine, "vllm_config", None), "model_config", None)
    value = getattr(config, "max_model_len", None) or asked
    if value is None:
        raise DraftsmithError("cannot read the vLLM engine's max_model_len", where="vLLM engine",
                              fix="set the engine's max_model_len explicitly")
    return int(value)


def _attach_or_start(folder: Path, key: str, spec: dict) -> Engine:
    with held(folder / "start.lock", waiting=f"another job is starting or attaching to the warm target engine {key}"):
        state = engine_state(folder)
        if state["alive"] and state.get("status") == "loading":  # started by a job that is gone: it loads on
            log.info("the warm target engine %s (pid %s) is still loading: waiting for it", key, state.get("pid"))
            state = _wait_ready(folder, key, None)
        if state["alive"] and state.get("status") == "ready":
            try:
                return _attach(folder, key, spec["what"])
            except EngineGone as e:  # it exited as this job came (its idle time up, say)
                log.warning("%s: loading the target cold", e.what)
                wait_stopped(folder, state.get("pid"))
        elif state["alive"]:  # exited or failed, its process still shutting down
            wait_stopped(folder, state.get("pid"))
        elif state.get("status") in ("ready", "loading"):
            log.warning("the warm target engine %s (pid %s) is gone (%s): loading the target cold; its log: %s",
                        key, state.get("pid"), exit_reason(state), folder / "engine.log")
        _stop_idle_beside(key, spec["identity"]["gpus"], spec["kwargs"].get("model"))
        with target_load(f"{spec['what']} in a warm engine process") as load:
            _start(folder, key, spec)
            engine = _attach(folder, key, spec["what"], cold=True)
        engine.load_seconds = load.seconds
        return engine


def _stop_idle_beside(key: str | None, gpus: str, model: str | None) -> None:
    """Before an engine of ``model`` starts on ``gpus``: stop the idle engines that share a GPU with
    it, hold another copy of its weights, or whose weights asleep would, with the ones of every
    other live engine and its own, pin more than ``HOST_SHARE_FOR_WEIGHTS`` of the machine's memory
    (``too_large_to_keep`` counts one engine; two runs' engines would count twice). ``key`` and
    ``model`` are None for an engine of the job's own, which keeps nothing in host memory."""
    from draftsmith.placement import host_memory_bytes

    others = [e for e in list_engines() if e["alive"] and e["key"] != key]
    sizes = {e["key"]: weight_bytes(e.get("model")) for e in others} if model else {}
    pinned = weight_bytes(model) + sum(sizes.values()) if model else 0
    budget = HOST_SHARE_FOR_WEIGHTS * host_memory_bytes() if model else 0
    for other in idle_engines(others):
        if _share_a_gpu(gpus, other.get("gpus")):
            why = "it shares a GPU with the new one"
        elif model is not None and other.get("model") == model:
            why = "it holds another copy of the same target"
        elif model is not None and pinned > budget:
            why = f"the live engines' weights asleep would pass {HOST_SHARE_FOR_WEIGHTS:.0%} of the machine's memory"
        else:
            continue
        started = time.monotonic()
        if stop_if_idle(Path(other["folder"])):
            pinned -= sizes.get(other["key"], 0)
            log.info("stopped the idle warm engine %s (pid %s) before this one starts, in %.1f s: %s", other["key"],
                     other["pid"], time.monotonic() - started, why)


def _job_gpus() -> str:
    """The devices a job's engine runs on, as its key and the idle engines' stop compare them."""
    return os.environ.get(JOB_GPUS_ENV) or os.environ.get("CUDA_VISIBLE_DEVICES") or "all"


def _share_a_gpu(a: str | None, b: str | None) -> bool:
    """Whether two engines' devices overlap ("all", and an engine on the CPU, overlap everything)."""
    if "all" in (a, b) or not a or not b:
        return True
    return bool(set(a.split(",")) & set(b.split(",")))


def _start(folder: Path, key: str, spec: dict) -> dict:
    """Start the engine process of ``folder`` and wait until it is ready; its state."""
    for stale in ("state.json", "socket"):
        with contextlib.suppress(FileNotFoundError):
            (folder / stale).unlink()
    atomic_write_json(folder / "spec.json", spec)
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    log_path = folder / "engine.log"
    spawned = time.time()
    with open(log_path, "ab") as out:
        offset = out.tell()
        process = subprocess.Popen([sys.executable, "-m", "draftsmith.engines.service", str(folder)],
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=folder,
                                   env=env, start_new_session=True, close_fds=True)
    log.info("starting the warm target engine %s (pid %d; it stays %.0f s after its last job; its log: %s)",
             key, process.pid, spec["keep_warm_s"], log_path)
    try:
        state = _wait_ready(folder, key, process)
    except EngineStartError:
        with open(log_path, "rb") as f:
            f.seek(offset)
            tail = f.read().decode("utf-8", "replace").splitlines()[-LOG_TAIL_LINES:]
        log.error("the engine's log (%s), its last %d lines:\n%s", log_path, len(tail), "\n".join(tail))
        raise
    log.info("the warm target engine %s was ready %.1f s after its process started: %s", key, time.time() - spawned,
             start_phases(state, spawned))
    return state


def start_phases(state: dict, spawned: float) -> str:
    """Where an engine process's start went, from its state: the process and its imports (Python,
    torch, draftsmith), then the steps ``service`` times (importing vLLM, the slot's draft, vLLM's load)."""
    phases = {"the process and its imports": state["load_started"] - spawned, **(state.get("phases") or {})}
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())


def _wait_ready(folder: Path, key: str, process: subprocess.Popen | None) -> dict:
    """Wait until ``folder``'s engine is ready (its state); raise if it fails or its process ends."""
    started = last_log = time.monotonic()
    while True:
        state = engine_state(folder)
        if state.get("status") == "ready":
            return state
        ended = process.poll() is not None if process is not None else not state["alive"]
        if state.get("status") == "failed" or ended:
            error = state.get("error") or {"type": "exit", "message": "the engine process ended while loading"}
            raise EngineStartError(f"{error['type']}: {error['message']}", where=str(folder / "engine.log"),
                                   fix="the engine's log (its last lines are above) says why it stopped")
        if time.monotonic() - last_log >= WAIT_LOG_S:
            log.info("the warm target engine %s is loading (%.0f s so far; its log: %s; if it hangs, "
                     "`python -m draftsmith.engines stop %s` ends it and the job loads cold)",
                     key, time.monotonic() - started, folder / "engine.log", key)
            last_log = time.monotonic()
        time.sleep(POLL_S)


def _attach(folder: Path, key: str, what: str, *, cold: bool = False) -> Engine:
    started = time.monotonic()
    state = engine_state(folder)
    if state.get("attached"):
        log.info("the warm target engine %s serves job pid %s: waiting for it", key, state["attached"])
    remote = RemoteLLM(folder, key)
    info = remote.attach()
    if not cold:
        log.info("attached to the warm target engine %s in %.1f s: %s (pid %s, loaded in %.1f s, %d job(s) before "
                 "this one; no load of the target)", key, time.monotonic() - started, what, info["pid"],
                 info["load_seconds"], info["jobs"])
    return Engine(remote, info["load_seconds"], cold, info["max_model_len"], remote.detach, slot=info.get("slot"),
                  v2_model_runner=bool(info.get("v2_model_runner")))


# ---------------------------------------------------------------------------------------------
# Talking to an engine process


class RemoteLLM:
    """``plain.ServedLLM``'s calls (``generate``, ``collective_rpc``, ``get_metrics``), run by a warm
    engine process over its socket: requests and answers are plain data, so the job imports no vLLM."""

    def __init__(self, folder: Path, key: str) -> None:
        self.folder, self.key = folder, key
        self._conn: Connection | None = None

    def attach(self) -> dict:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with socket_address(self.folder) as address:
                sock.connect(address)
            # the job's device locks, which the engine holds too while it works for this job
            socket.send_fds(sock, [b"L"], held_device_locks())
        except OSError as e:
            sock.close()
            raise EngineGone(f"cannot reach the warm target engine {self.key}: {e}", where=str(self.folder),
                             fix="rerun the job: it loads the target cold") from e
        self._conn = Connection(sock.detach())
        return self._request("attach", {"pid": os.getpid(), "argv": sys.argv[:3], "keep_warm_s": keep_warm_seconds()})

    def detach(self) -> None:
        """End this job's session; returns once the engine has reset and gone to sleep, so that the
        GPU memory it frees is free for what the job does next."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(OSError, EOFError):
                conn.send(("detach",))
                conn.recv()
            conn.close()

    def generate(self, *args, **kwargs):
        return self._request("call", "generate", args, kwargs)

    def collective_rpc(self, *args, **kwargs):
        return self._request("call", "collective_rpc", args, kwargs)

    def get_metrics(self):
        return self._request("call", "get_metrics", (), {})

    def _request(self, *message):
        what = message[1] if message[0] == "call" else message[0]
        if self._conn is None:
            raise EngineGone("not attached to the warm target engine", where=str(self.folder))
        try:
            self._conn.send(message)
            reply = self._conn.recv()
        except (OSError, EOFError) as e:
            self._conn = None
            state = engine_state(self.folder)
            raise EngineGone(f"the warm target engine {self.key} stopped during {what!r}: {exit_reason(state)}",
                             where=str(self.folder / "engine.log"),
                             fix="rerun the job: it loads the target cold (the engine's log says why it stopped)") from e
        except BaseException:  # interrupted (Ctrl-C) before the answer: the next request would read this one's
            conn, self._conn = self._conn, None
            conn.close()  # the engine ends the session once it has answered
            raise
        if reply[0] == "ok":
            return reply[1]
        _, kind, text = reply
        raise EngineCallError(f"{kind} in the warm target engine, in {what!r}: {text}",
                              where=f"{self.folder / 'engine.log'} (the traceback)")
