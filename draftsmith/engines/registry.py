"""The registry of warm target engines: a per-user folder of this machine, one folder per engine
key (``draftsmith.engines.warm`` says what a key holds), and what jobs and ``python -m
draftsmith.engines`` read and do there:

    <root>/<key>/spec.json    what the engine runs: LLM arguments, identity, lifetime
                 lock         locked (POSIX, lockf) by the engine process for its whole life: alive = locked
                 start.lock   flock-ed by the job starting it or attaching to it (one at a time)
                 state.json   loading | ready | failed (with the error), pid, load seconds, who is attached
                 socket       where jobs attach (the folder is the user's alone: mode 0700)
                 engine.log   the engine's own output

An engine's liveness is a lock test, so a killed engine is seen as gone at once; an idle engine is
stopped only under its start lock, so that no job attaches to it on its way out.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.io import read_json

log = logging.getLogger(__name__)

ENGINE_DIR_ENV = "DRAFTSMITH_ENGINE_DIR"  # the registry's folder (default: <tmp>/draftsmith-engines-<user>)
POLL_S = 0.25
STOP_WAIT_S = 120.0
# Linux holds a Unix socket's address in 108 bytes; a registry deep in a project folder goes past it.
SOCKET_PATH_BYTES = 100


def registry_folder() -> Path:
    """Where this user's warm engines are registered on this machine (the folder may not exist)."""
    return Path(os.environ.get(ENGINE_DIR_ENV) or Path(tempfile.gettempdir()) / f"draftsmith-engines-{_user()}")


def registry() -> Path:
    """This user's folder of warm engines on this machine. Attaching to an engine is controlling it
    (and unpickling what it sends), so the folder must be the user's alone: refused otherwise."""
    root = registry_folder()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = root.lstat()
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise DraftsmithError(f"the warm engines' folder {root} is not this user's alone (a link, another owner, "
                              f"or mode {oct(info.st_mode & 0o777)})", where=str(root),
                              fix=f"remove it, or name a folder of your own in {ENGINE_DIR_ENV}")
    return root


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


@contextlib.contextmanager
def socket_address(folder: Path) -> Iterator[str]:
    """The address of ``folder``'s socket for ``bind`` or ``connect``: its path, or where that is too
    long for a Unix socket, the same file reached through a descriptor of the folder
    (``/proc/self/fd/N/socket``), valid while the block runs."""
    path = str(folder / "socket")
    if len(os.fsencode(path)) <= SOCKET_PATH_BYTES:
        yield path
        return
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{descriptor}/socket"
    finally:
        os.close(descriptor)


def engine_state(folder: Path) -> dict:
    """What ``folder``'s engine wrote of itself, and whether its process holds the lock (``alive``)."""
    try:
        state = read_json(folder / "state.json")
    except (FileNotFoundError, ValueError):
        state = {}
    state["alive"] = engine_alive(folder)
    return state


def engine_alive(folder: Path) -> bool:
    """Whether a process holds ``folder``'s engine lock. A POSIX record lock (``lockf``), not
    ``flock``: the processes vLLM forks inherit an ``flock`` and would keep a dead engine "alive"."""
    return _locked_elsewhere(folder / "lock", fcntl.lockf)


def _locked_elsewhere(path: Path, lock) -> bool:
    """Whether another process holds ``lock`` (``fcntl.lockf`` or ``fcntl.flock``) on ``path``:
    tried without waiting, and let go at once."""
    try:
        f = open(path, "a")
    except FileNotFoundError:
        return False
    with f:
        try:
            lock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # lockf: EAGAIN or EACCES; flock: BlockingIOError
            return True
        lock(f, fcntl.LOCK_UN)
        return False


def list_engines() -> list[dict]:
    """Every engine folder of this user on this machine, live or not, with its spec's description."""
    found = []
    for folder in sorted(p for p in registry().iterdir() if p.is_dir()):
        state = engine_state(folder)
        try:
            spec = read_json(folder / "spec.json")
        except (FileNotFoundError, ValueError):
            spec = {}
        found.append({**state, "key": folder.name, "folder": str(folder), "what": spec.get("what"),
                      "gpus": (spec.get("identity") or {}).get("gpus"),
                      "model": ((spec.get("kwargs") or {}).get("model"))})
    return found


def idle_engines(engines: list[dict] | None = None) -> list[dict]:
    """Live, ready engines no job is attached to nor starting (its start lock free), of ``engines``
    (as ``list_engines`` gave them) or of the registry."""
    return [e for e in (list_engines() if engines is None else engines)
            if e["alive"] and e.get("status") == "ready" and not e.get("attached")
            and not _locked_elsewhere(Path(e["folder"]) / "start.lock", fcntl.flock)]


def stop_if_idle(folder: Path) -> bool:
    """Stop ``folder``'s engine if it is idle now, not as it was when listed: no job attached, none
    attaching or starting it. Its start lock is held through the stop, so that no job attaches to an
    engine on its way out. Whether it was stopped."""
    with _start_lock_if_free(folder) as free:
        if not free:  # a job is starting it or attaching to it
            return False
        state = engine_state(folder)
        if not state["alive"] or state.get("status") != "ready" or state.get("attached"):
            return False
        return stop_engine(folder)


def stop_engine(folder: Path, *, timeout: float = STOP_WAIT_S) -> bool:
    """Ask ``folder``'s engine to exit (SIGTERM) and wait until its lock is free, then end its whole
    process group (vLLM's engine core and workers with it); whether it was alive."""
    state = engine_state(folder)
    if not state["alive"] or not state.get("pid"):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(state["pid"]), signal.SIGTERM)
    wait_stopped(folder, state["pid"], timeout)
    return True


def wait_stopped(folder: Path, pid: int | None, timeout: float = STOP_WAIT_S) -> None:
    """Wait for ``folder``'s engine to release its lock; past ``timeout``, kill its process group (it
    leads a session of its own) and wait as long again."""
    for kill in (False, True):
        deadline = time.monotonic() + timeout
        while engine_alive(folder):
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        else:
            return
        if kill and pid:
            raise DraftsmithError(f"the warm target engine in {folder} (pid {pid}) does not exit", where=str(folder),
                                  fix=f"kill its processes (kill -9 -- -{pid}) and rerun")
        if pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), signal.SIGKILL)


def say_warm_engines() -> None:
    """At the end of a Snakemake run: which target engines stay up for the next one, and how to stop
    them (they hold the target's weights in host memory while they sleep)."""
    live = [e for e in list_engines() if e["alive"]]
    if live:
        print(f"{len(live)} warm target engine(s) stay up for the next run (each until it has been idle for "
              "warm_target.minutes): python -m draftsmith.engines list | stop", file=sys.stderr)


def forget_engine(folder: Path) -> None:
    """Remove the folder of an engine that is gone, unless a job is starting it again."""
    with _start_lock_if_free(folder) as free:
        if free and not engine_alive(folder):
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _start_lock_if_free(folder: Path) -> Iterator[bool]:
    """``folder``'s start lock for the block if no job holds it (whether it was free)."""
    with open(folder / "start.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def exit_reason(state: dict) -> str:
    if state.get("status") == "exited":
        return state.get("reason") or "it exited"
    return "its process is gone (killed, or it crashed: see its log)"


@contextlib.contextmanager
def held(path: Path, *, waiting: str) -> Iterator[None]:
    """``path`` flock-ed for the block; the log says what it waits for when another process holds it."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: waiting for it", waiting)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield
