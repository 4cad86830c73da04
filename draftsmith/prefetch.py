"""Work done ahead on a background thread: ``make(*job)`` for each job, in order, at most ``depth``
results queued, so the consumer's own work overlaps the next results' making (the trainer's
micro-batches, the vLLM capture's batches)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

_POLL_S = 0.1  # how often a producer waiting on a full queue looks whether the consumer has stopped


class Prefetcher:
    """``make(*job)`` for each of ``jobs`` on a daemon thread; ``get`` (or iteration) hands the results
    over in order and raises what the thread raised, in its place."""

    def __init__(self, jobs: Iterable[tuple[Any, ...]], make: Callable[..., Any], depth: int,
                 name: str = "draftsmith-prefetch") -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(jobs, make), name=name, daemon=True)
        self._thread.start()

    def _run(self, jobs, make) -> None:
        try:
            for job in jobs:
                if self._stop.is_set() or not self._put(("ok", make(*job))):
                    return
            self._put(("end", None))
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._put(("error", e))

    def _put(self, item) -> bool:
        """Queue ``item``; False once the consumer has stopped (it may never take it)."""
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=_POLL_S)
                return True
        return False

    def get(self) -> Any:
        kind, value = self._queue.get()
        if kind == "error":
            raise value
        if kind == "end":
            raise StopIteration
        return value

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                yield self.get()
            except StopIteration:
                return

    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, wait: bool = True) -> None:
        """Stop making; with ``wait``, return once the job being made has ended."""
        self._stop.set()
        with contextlib.suppress(queue.Empty):  # the results no one will take: their memory goes now
            while True:
                self._queue.get_nowait()
        if wait:
            self._thread.join()
