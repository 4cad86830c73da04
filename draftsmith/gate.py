"""The preflight's verdict, which every job that loads the target waits for.

A failing ``check_setup`` must start no engine: on a 1T-parameter target a load is half an hour
spent after the preflight has said no. Snakemake orders jobs only through files, and a file edge
from ``check_setup`` to the engine jobs breaks the cache (docs/design.md, "The preflight gate"). So
the order is kept by a small file beside ``preflight.json``, outside the graph:

* the workflow's ``onstart`` hook (before any job starts) marks it ``pending`` when the plan runs
  ``check_setup``, and removes it when not (``preflight.json`` is then current);
* ``check_setup`` writes its verdict into it: removed when it passes, ``failed`` with its message
  when not;
* each job that loads the target calls ``wait_for_preflight`` before the load: ``pending`` waits
  (``check_setup`` runs first, by priority, and takes seconds), ``failed`` stops the job with the
  preflight's message, no file goes on.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.io import atomic_write_json

log = logging.getLogger(__name__)

GATE_NAME = "preflight.gate.json"
POLL_SECONDS = 2.0
WAIT_LIMIT_SECONDS = 3600.0  # check_setup takes seconds; this long means its process was killed


class PreflightGateError(DraftsmithError):
    """A job that loads the target did not start because the preflight failed or never finished."""


def gate_for_run(run: str) -> Path:
    """The gate of ``results/<run>/`` (relative to the workflow's folder, where every job runs)."""
    return Path("results", run, GATE_NAME)


def mark_planned(path: Path, check_setup_planned: bool) -> None:
    """The ``onstart`` hook: ``pending`` when this run's plan holds ``check_setup``, else no gate."""
    if check_setup_planned:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"state": "pending"})
    else:
        path.unlink(missing_ok=True)


def record_verdict(path: Path, error: BaseException | None) -> None:
    """``check_setup``'s last act: the gate opens (removed) or says why it stays shut."""
    if error is None:
        path.unlink(missing_ok=True)
    else:
        atomic_write_json(path, {"state": "failed", "error": f"{type(error).__name__}: {error}"})


@contextmanager
def deciding(path: Path) -> Iterator[None]:
    """Run ``check_setup`` inside: whatever ends the block, its verdict goes into the gate."""
    try:
        yield
    except BaseException as error:
        record_verdict(path, error)
        raise
    record_verdict(path, None)


def wait_for_preflight(path: Path, *, poll_seconds: float = POLL_SECONDS, limit_seconds: float = WAIT_LIMIT_SECONDS,
                       sleep: Callable[[float], None] = time.sleep,
                       clock: Callable[[], float] = time.monotonic) -> None:
    """Return once the preflight has passed (or this run does not run it); raise if it failed."""
    start, announced = clock(), False
    while True:
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except json.JSONDecodeError:  # written atomically: only a file damaged by hand gets here
            raise PreflightGateError("the preflight gate is not valid JSON", where=str(path),
                                     fix="remove it and rerun (the workflow writes it again)") from None
        if state.get("state") == "failed":
            raise PreflightGateError(
                "check_setup failed, so this job did not load the target:\n" + state.get("error", "(no message)"),
                where=f"{path.parent / 'preflight.json'} (check_setup's log has the details)",
                fix="fix what check_setup names and rerun; jobs that load the target wait for its verdict")
        if clock() - start > limit_seconds:
            raise PreflightGateError(
                f"check_setup gave no verdict in {limit_seconds:.0f} s",
                where=str(path),
                fix="check_setup's process was probably killed: rerun the workflow (it runs check_setup again)")
        if not announced:
            log.info("waiting for check_setup's verdict (%s) before loading the target", path)
            announced = True
        sleep(poll_seconds)
