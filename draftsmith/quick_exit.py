"""Ending a short job without the interpreter's teardown.

A process that imported torch and transformers spends about a second after its last line freeing
modules and running native destructors, on every job; for the preflight's two jobs, whose whole
budget is seconds, that is a tenth of it (docs/benchmarks.md, "Preflight and planning"). A module of
its own, so that only the scripts that call it take it into their code fingerprints; inspect_target
is one, whose target.json every stage reads, so a change here reruns a run (docs/reruns.md).
"""

from __future__ import annotations

import logging
import os
import sys


def end_job() -> None:
    """Exit 0 now, after flushing the logs and the console: for a job whose outputs are written and
    closed and that holds no engine, child process or open file (its work is done, nothing is left
    to clean up). A failing job never gets here: its exception ends it as usual, with status 1."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
