"""The CPU stages' work spread over the cores their job is given: a task mapped over chunks of rows
in worker processes, its results handed back in the chunks' order, so an output never depends on how
many workers made it.

Processes, not threads: rendering chat templates (Jinja), normalizing rows and parsing JSON are
Python code, which holds the GIL. The workers are forked (Linux), after ``gc.freeze``: they start at
once, share the parent's imported libraries and loaded tokenizer instead of importing and loading
their own, and need no ``if __name__ == "__main__"`` guard in the scripts that call a stage (spawned
workers re-run an unguarded main script, such as a Snakemake ``script:``). They are forked before
the stage starts a thread of its own (its progress bar's), so none holds a lock in the copy.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from draftsmith.errors import DraftsmithError

Item = TypeVar("Item")
Result = TypeVar("Result")

# Chunks in flight per worker: one being worked on and one waiting, so no worker idles while the
# main process reads; memory holds at most this many chunks per worker, however long the input.
IN_FLIGHT_PER_WORKER = 2

_task: Callable | None = None  # in a worker process: the task every chunk goes through


@contextlib.contextmanager
def ordered_map(task: Callable[[Item], Result], workers: int) -> Iterator[Callable[[Iterable[Item]], Iterator[Result]]]:
    """A function that maps ``task`` over items in ``workers`` processes (in this one when
    ``workers`` is 1) and yields the results in the items' order, reading items only as workers
    free up. The workers exist for the ``with`` block; a task's exception reaches the caller."""
    if workers <= 1:
        yield lambda items: map(task, items)
        return
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=_start_worker, initargs=(task,))
    gc.freeze()  # the workers' collections then leave the parent's objects, and so their pages, shared
    try:
        pool.submit(int).result()  # forks every worker now, while this process runs no other thread
    finally:
        gc.unfreeze()
    try:
        yield lambda items: _in_order(pool, workers, items)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _start_worker(task: Callable) -> None:
    global _task
    _task = task
    # Each worker is one core's work: the Rust tokenizer's own thread pool would only compete with
    # the other workers (and tokenizers warns when a process that used it forks).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _run(item):
    return _task(item)


def _in_order(pool: ProcessPoolExecutor, workers: int, items: Iterable) -> Iterator:
    pending: collections.deque = collections.deque()
    try:
        for item in items:
            if len(pending) == IN_FLIGHT_PER_WORKER * workers:
                yield pending.popleft().result()
            pending.append(pool.submit(_run, item))
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise DraftsmithError(
            f"a worker process of this stage ended without a word (one of {workers}): killed by a signal, "
            "most often the out-of-memory killer", where="the job's worker processes (dmesg names an OOM kill)",
            fix="give the job more memory, or fewer workers (snakemake --cores, or the rule's threads)") from None
