"""Where a span of a benchmark spent its time: the GPU's busy share and the CPU seconds of every
thread of this process and of its child processes (an engine's), grouped by thread name.

A bench that falls short of its goal only when two halves run together needs this to say which
half waits for which: the GPU idles while some thread is busy.

    with Usage() as usage:
        run()
    print(usage.report())
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import psutil


def _thread_names() -> dict[int, str]:
    """This process's Python threads by their OS id (Python does not name OS threads)."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def _processes() -> list[tuple[str, psutil.Process]]:
    """This process ("driver") and its children ("child <pid>": an engine's), labelled."""
    me = psutil.Process()
    return [("driver", me), *((f"child {p.pid}", p) for p in me.children(recursive=True))]


def _cpu_by_thread() -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (a readable thread label, CPU seconds so far) for this process and its children."""
    named = _thread_names()
    seen = {}
    for owner, proc in _processes():
        try:
            threads = proc.threads()
        except psutil.Error:
            continue
        for t in threads:
            try:
                with open(f"/proc/{proc.pid}/task/{t.id}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                comm = "?"
            label = named.get(t.id, comm) if owner == "driver" else comm
            seen[(proc.pid, t.id)] = (f"{owner}: {label}", t.user_time + t.system_time)
    return seen


def _gpu_handle():
    """An NVML handle for the first visible GPU, or None (no NVIDIA driver or no nvidia-ml-py)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        handle = (pynvml.nvmlDeviceGetHandleByUUID(visible) if visible.startswith("GPU-")
                  else pynvml.nvmlDeviceGetHandleByIndex(int(visible)))
        return pynvml, handle
    except Exception:
        return None


class Usage:
    """The GPU's mean busy share (NVML's utilisation, sampled) and the CPU seconds per thread over a span."""

    def __init__(self, interval: float = 0.1, cpu_every: int = 5) -> None:
        self.interval, self.cpu_every = interval, cpu_every
        self.gpu_samples: list[int] = []
        self._stop = threading.Event()
        self._gpu = _gpu_handle()

    def __enter__(self) -> Usage:
        self.started, self.before = time.perf_counter(), _cpu_by_thread()
        self.last = dict(self.before)  # each thread's latest reading: threads that end keep theirs
        self.process_before = self._process_cpu()
        self._thread = threading.Thread(target=self._sample, name="usage-sampler", daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _process_cpu() -> dict[str, float]:
        """CPU seconds of this process and its children so far (a process's count keeps its ended threads')."""
        totals = {}
        for owner, proc in _processes():
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            totals[owner] = times.user + times.system
        return totals

    def _sample(self) -> None:
        ticks = 0
        while not self._stop.wait(self.interval):
            ticks += 1
            if self._gpu is not None:
                nvml, handle = self._gpu
                self.gpu_samples.append(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            if ticks % self.cpu_every == 0:
                self.last.update(_cpu_by_thread())

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.started
        self._stop.set()
        self._thread.join()
        self.last.update(_cpu_by_thread())
        after = self._process_cpu()
        self.process_cpu = {k: v - self.process_before.get(k, 0.0) for k, v in after.items()}

    @property
    def gpu_busy(self) -> float | None:
        return sum(self.gpu_samples) / len(self.gpu_samples) / 100 if self.gpu_samples else None

    def cpu_seconds(self) -> Counter:
        """CPU seconds per thread label over the span (a thread that ended is counted to its last
        reading, up to ``interval * cpu_every`` seconds before it ended)."""
        spent = Counter()
        for key, (label, seconds) in self.last.items():
            spent[label] += seconds - self.before.get(key, (label, 0.0))[1]
        return spent

    def report(self, top: int = 8) -> str:
        spent = self.cpu_seconds()
        busy = "n/a" if self.gpu_busy is None else f"{self.gpu_busy:.0%}"
        threads = ", ".join(f"{label} {s:.1f}" for label, s in spent.most_common(top) if s >= 0.05)
        processes = ", ".join(f"{k} {v:.1f}" for k, v in self.process_cpu.items() if v >= 0.05)
        return f"GPU busy {busy} of {self.seconds:.1f} s; CPU s by process: {processes}; by thread: {threads}"
