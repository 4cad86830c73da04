"""Loads of the target, counted and timed: the costliest thing a run does (about half an hour for a
1T target), so each stage's log says how many it paid for and what each cost."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)

# One process is one job: the count is that job's loads of the target.
_loads = itertools.count(1)


@dataclass
class Load:
    what: str
    seconds: float = 0.0


@contextmanager
def target_load(what: str) -> Iterator[Load]:
    """Time the load of the target described by ``what`` (engine, parallelism, eager or CUDA graphs)
    and log it with its number in this process; a load that fails is logged as such."""
    load = Load(what)
    number, started = next(_loads), time.monotonic()
    try:
        yield load
    except BaseException:
        log.warning("target load %d (%s) failed after %.1f s", number, what, time.monotonic() - started)
        raise
    load.seconds = time.monotonic() - started
    log.info("target load %d of this job: %s in %.1f s", number, what, load.seconds)
