"""The warm engine's process: ``python -m draftsmith.engines.service FOLDER`` (started by
``draftsmith.engines.warm``, never by hand).

It takes FOLDER's lock for its whole life, binds FOLDER's socket, loads ``vllm.LLM`` with the
arguments of FOLDER's spec.json (with a speculator slot, its draft built first: see
``draftsmith.engines.shared``), then serves one attached job at a time: a job's connection first
passes copies of its device locks' descriptors, held until the engine is asleep again; each
request names a call of ``draftsmith.engines.plain.ServedLLM`` (``generate``, ``collective_rpc``,
``get_metrics``, in plain data) and gets its result or the exception's text back (its traceback
goes to this process's log). A job that
detaches or dies ends its session; the capture hooks' state is reset and, where the engine was
started with sleep mode, it sleeps until the next job attaches (so it does after its load, when the
job that started it is gone). With no job for the latest job's ``keep_warm_s`` seconds, or on
SIGTERM, it shuts the engine down and exits; an engine that vLLM reports dead exits at once, so the
next job loads cold.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from draftsmith.engines.loads import target_load
from draftsmith.io import atomic_write_json, read_json

log = logging.getLogger("draftsmith.engines.service")

METHODS = ("generate", "collective_rpc", "get_metrics")
# vLLM's exceptions after which its engine cannot serve another request
FATAL = ("EngineDeadError", "EngineGenerateError")
FIRST_JOB_S = 60.0  # after its load, how long the engine stays awake for the job that started it
SLOT_DRAFT = "slot-draft"  # the folder of the speculator slot's draft, beside the engine's state
LOCK_WAIT_S = 2.0  # how long a new engine tries for its lock (engines.warm probes it for an instant)
MAX_DEVICE_LOCKS = 64  # the most device-lock descriptors a job passes with its connection
HANDSHAKE_S = 30.0  # how long a connection may take to pass them


class _Stop(BaseException):
    """SIGTERM: shut down and exit (a BaseException, so that no handler of a call's errors takes it)."""


def main(folder: Path) -> int:
    lock = open(folder / "lock", "a")  # noqa: SIM115 - held until the process exits
    if not _take(lock):
        log.error("another engine process holds %s", folder / "lock")
        return 1
    spec = read_json(folder / "spec.json")
    state = {"status": "loading", "pid": os.getpid(), "started": time.time(), "jobs": 0, "attached": None}
    _write(folder, state)
    signal.signal(signal.SIGTERM, _on_sigterm)
    import torch

    set_num_threads = torch.set_num_threads  # an in-process CPU engine replaces it; shutdown_llm puts it back
    listener = llm = None
    reason = "stopped (SIGTERM)"
    try:
        listener = _listen(folder)
        llm, load_seconds = _load(folder, spec, state)
        from draftsmith.engines.warm import engine_max_model_len
        from draftsmith.targets.vllm_compat import uses_v2_model_runner

        state.update(status="ready", load_seconds=round(load_seconds, 2),
                     max_model_len=engine_max_model_len(llm.llm, spec["kwargs"].get("max_model_len")),
                     v2_model_runner=uses_v2_model_runner(llm.llm))
        _write(folder, state)
        state["keep_warm_s"] = float(spec["keep_warm_s"])
        reason = _serve(folder, llm, listener, state, sleeps=bool(spec["kwargs"].get("enable_sleep_mode")))
    except _Stop:
        pass
    except Exception as e:  # noqa: BLE001 - the job reads it in state.json, the user in this log
        reason = f"{type(e).__name__}: {e}"
        log.exception("the engine stops")
        if state["status"] == "loading":
            state.update(status="failed", error={"type": type(e).__name__, "message": str(e)})
            _write(folder, state)
            return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the shutdown short
        if listener is not None:
            listener.close()
        with contextlib.suppress(FileNotFoundError):
            (folder / "socket").unlink()
        if state["status"] != "failed":
            try:
                _write(folder, {**state, "status": "exited", "attached": None, "reason": reason})
            except Exception as e:  # noqa: BLE001 - a full disk must not keep the engine from shutting down
                log.error("cannot record the engine's exit in state.json: %s", e)
        log.info("the engine exits: %s", reason)
        if llm is not None:
            with contextlib.suppress(Exception):  # the process ends either way
                from draftsmith.targets.vllm_compat import shutdown_llm

                shutdown_llm(llm.llm, set_num_threads)
        # the speculator slot's draft (a GB or more with a large vocabulary) is the engine's alone
        shutil.rmtree(folder / SLOT_DRAFT, ignore_errors=True)
    return 0


def _take(lock) -> bool:
    """Take the engine's lock (a POSIX lock: vLLM's forked processes do not inherit it), retrying for
    ``LOCK_WAIT_S``: whoever checks whether an engine is alive takes the lock for an instant, and the
    new engine must not take that instant for another engine's life."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def _listen(folder: Path) -> socket.socket:
    """The socket jobs attach at, bound before the load: a path it cannot take stops it before minutes
    of loading, not after."""
    from draftsmith.engines.registry import socket_address

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with socket_address(folder) as address:
        listener.bind(address)
    listener.listen(8)
    return listener


def _load(folder: Path, spec: dict, state: dict):
    """``vllm.LLM`` of the spec's arguments (and its speculator slot), as ``plain.ServedLLM``; the
    load's seconds. Each step's
    seconds go to ``state["phases"]``, so that the job that started the engine can say where its
    start went beyond vLLM's own load."""
    phases = state.setdefault("phases", {})
    state["load_started"] = time.time()  # the job counts the process's own start up to here
    started = time.monotonic()
    from vllm import LLM

    from draftsmith.engines.plain import ServedLLM
    from draftsmith.engines.vllm_serving import eagle3_config

    phases["importing vLLM"] = round(time.monotonic() - started, 2)
    kwargs = dict(spec["kwargs"])
    if spec.get("speculator_slot"):
        started = time.monotonic()
        state["slot"] = str(_slot_draft(folder, spec["speculator_slot"]))
        kwargs["speculative_config"] = eagle3_config(state["slot"], spec["speculator_slot"]["num_speculative_tokens"])
        phases["the speculator slot's draft"] = round(time.monotonic() - started, 2)
    with target_load(spec["what"]) as load:
        llm = LLM(**kwargs)
    phases["vLLM's load"] = round(load.seconds, 2)
    return ServedLLM(llm), load.seconds


def _slot_draft(folder: Path, slot: dict) -> Path:
    """The speculator slot's draft (draftsmith.engines.shared): the architecture training will
    produce for this run, with random weights until a job loads the trained ones in place. Its
    embedding is random too, so vLLM never shares the target's with it: every tensor a trained
    draft brings can be loaded into the slot."""
    import torch

    from draftsmith.draft.config import Eagle3DraftConfig
    from draftsmith.draft.model import Eagle3Draft
    from draftsmith.draft.speculators_format import save_speculators

    config = Eagle3DraftConfig.from_target(slot["slot"]["target"], draft_vocab_size=slot["slot"]["draft_vocab_size"],
                                           **slot["slot"]["draft"])
    torch.manual_seed(0)
    return save_speculators(Eagle3Draft(config), folder / SLOT_DRAFT)


def _serve(folder: Path, llm, listener: socket.socket, state: dict, sleeps: bool) -> str:
    """Serve jobs one at a time until none comes for ``state["keep_warm_s"]`` seconds (the latest
    job's ``warm_target.minutes``); why it stopped. An engine with sleep mode sleeps whenever no job
    is attached, after a grace for the first job."""
    asleep, idle_since = False, time.monotonic()
    while True:
        keep_warm_s = state["keep_warm_s"]
        waited = time.monotonic() - idle_since
        grace = FIRST_JOB_S if sleeps and not asleep and state["jobs"] == 0 else keep_warm_s
        listener.settimeout(max(min(grace, keep_warm_s) - waited, 0.001))
        try:
            conn_socket, _ = listener.accept()
        except TimeoutError:
            if time.monotonic() - idle_since >= keep_warm_s:
                return f"idle for {keep_warm_s:.0f} s"
            if sleeps and not asleep:  # the job that started it did not come: its GPU memory goes free
                _sleep(llm)
                asleep = True
            continue
        try:  # the job's device locks, held until this engine is done with the GPU for it, even if it dies
            conn_socket.settimeout(HANDSHAKE_S)
            _, device_locks, _, _ = socket.recv_fds(conn_socket, 1, MAX_DEVICE_LOCKS)
            conn_socket.settimeout(None)
        except OSError:
            conn_socket.close()
            continue
        try:
            conn = Connection(conn_socket.detach())
            if asleep:
                started = time.monotonic()
                llm.wake_up()
                asleep = False
                log.info("woke up in %.1f s", time.monotonic() - started)
            fatal, detached = _session(folder, llm, conn, state)
            if fatal:
                conn.close()
                return f"vLLM's engine died ({fatal})"
            with contextlib.suppress(Exception):  # engines without the capture extension have nothing to reset
                llm.collective_rpc("draftsmith_reset")
            if sleeps:
                _sleep(llm)
                asleep = True
        finally:
            for lock in device_locks:
                os.close(lock)
        state.update(attached=None, last_job=time.time())
        _write(folder, state)
        if detached:  # the job waits for this: its GPU memory is free when it goes on
            with contextlib.suppress(OSError, EOFError):
                conn.send(("ok", None))
        conn.close()
        idle_since = time.monotonic()


def _sleep(llm) -> None:
    started = time.monotonic()
    llm.sleep(level=1)
    log.info("asleep (weights in host memory) in %.1f s", time.monotonic() - started)


def _session(folder: Path, llm, conn: Connection, state: dict) -> tuple[str | None, bool]:
    """One attached job's requests until it detaches or goes: the fatal error's name if vLLM died,
    and whether the job detached (and waits for the engine to be put away)."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            log.info("job pid %s went without detaching", state.get("attached"))
            return None, False
        if message[0] == "detach":
            log.info("job pid %s detached", state.get("attached"))
            return None, True
        if message[0] == "attach":
            # the job's warm_target.minutes from now on: a run that changes it changes the engines it uses
            state.update(attached=message[1]["pid"], jobs=state["jobs"] + 1,
                         keep_warm_s=float(message[1].get("keep_warm_s", state["keep_warm_s"])))
            _write(folder, state)
            log.info("job pid %s attached (%s)", message[1]["pid"], " ".join(message[1]["argv"]))
            reply = ("ok", {"pid": os.getpid(), "load_seconds": state["load_seconds"], "jobs": state["jobs"] - 1,
                            "max_model_len": state["max_model_len"], "slot": state.get("slot"),
                            "v2_model_runner": state["v2_model_runner"]})
            fatal = None
        else:
            reply, fatal = _call(llm, *message[1:])
        try:
            conn.send(reply)
        except (OSError, EOFError):
            log.info("job pid %s went before its answer", state.get("attached"))
            return fatal, False
        except Exception as e:  # noqa: BLE001 - a result that does not pickle: the job gets why
            log.exception("the answer to job pid %s cannot be sent", state.get("attached"))
            with contextlib.suppress(OSError, EOFError):
                conn.send(("error", type(e).__name__, f"the engine's answer cannot be sent back: {e}"))
        if fatal:
            return fatal, False


def _call(llm, name: str, args: tuple, kwargs: dict) -> tuple[tuple, str | None]:
    if name not in METHODS:
        return ("error", "ValueError", f"{name} is not served"), None
    try:
        return ("ok", getattr(llm, name)(*args, **kwargs)), None
    except Exception as e:  # noqa: BLE001 - the job gets it and decides; the engine serves on
        kind = type(e).__name__
        log.error("%s failed:\n%s", name, traceback.format_exc())
        return ("error", kind, str(e)), (kind if kind in FATAL else None)


def _write(folder: Path, state: dict) -> None:
    atomic_write_json(folder / "state.json", state)


def _on_sigterm(signum, frame) -> None:
    raise _Stop()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main(Path(sys.argv[1])))
