"""Fault injection: extraction and training killed (SIGKILL) at seeded points, shards corrupted on
disk, a disk that fills mid-write, two parts writing at once.

Each run is a forked child of this process (the imports are done once), killed at a point chosen
by a seeded generator: inside the n-th fsync (a file or folder written, not yet durable or
renamed), halfway through writing a file, after the n-th captured batch, once n shards or n
training steps are done, or after a seeded delay. A rerun must end byte-identical to an
uninterrupted run, and recompute only the unit in flight: shards not yet complete (at most the
writer pipeline's depth of them begun before the kill), training steps since the last checkpoint.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import draftsmith.extract.capture as capture_module
import draftsmith.extract.extract as extract
import draftsmith.extract.safetensors_stream as stream
import tiny
from draftsmith.errors import ExtractionError, StorageError
from draftsmith.extract.extract import extract_part, merge, plan_part
from draftsmith.extract.hidden_states import HiddenStateIndex, load_shard_manifest, shard_dir_name, verify_store
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.io import atomic_write_bytes, file_matches, read_json
from draftsmith.targets.inspect import write_target_json
from draftsmith.train import FINISHED, TrainSettings, run_training
from draftsmith.vocab import build_vocab_mapping

SEED = 1729
KILLS = 20
EXTRACTION = dict(device="cpu", shard_tokens=60, batch_tokens=64, min_free_bytes=0)
TRAINING = TrainSettings(batch_tokens=96, lr=3e-3, warmup_steps=2, epochs=2, max_steps=12, log_every=1,
                         checkpoint_every=3, progress=False, device="cpu")
# Shards begun but not complete when a part dies, at most (here a shard is about one batch): the
# batch being written, two queued for the writer, one captured and waiting for the queue, and the
# next batch, launched ahead by the backend.
PIPELINE_DEPTH = 5
FORK = multiprocessing.get_context("fork")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ---------------------------------------------------------------------------------------------
# The uninterrupted run every faulty one is compared with


@dataclass
class World:
    root: Path
    train: Path
    target: Path
    hs: Path  # the reference store (part-0.json, part-0/, index.json)
    mapping: Path
    shard_of: dict[str, int]  # sample key -> shard number
    num_shards: int
    extract_fsyncs: int
    extract_files: int
    train_fsyncs: int
    train_dir: Path  # the reference training run (draft/, work/, metrics.jsonl, summary.json)


def _key(ids) -> str:
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]


class _CountFsync:
    """Counts os.fsync calls in this process (to know the range of fsync kill points)."""

    def __init__(self, monkeypatch):
        self.calls, real = 0, os.fsync

        def fsync(fd):
            self.calls += 1
            return real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("faults")
    model = tiny.build_llama(root / "model")
    write_target_json(root / "target.json", model)
    train = tiny.write_jsonl(root / "train.jsonl", tiny.random_train_rows(36))
    settings = ExtractionSettings(**EXTRACTION)
    shards = plan_part(train, 0, 1, settings)
    shard_of = {_key(s["input_ids"]): n for n, shard in enumerate(shards) for s in shard}
    assert len(shard_of) == 36 and len(shards) >= 15

    with pytest.MonkeyPatch.context() as mp:
        counter = _CountFsync(mp)
        opened = []
        real_open = builtins.open
        mp.setattr(stream, "open", lambda path, mode="r", *a, **k: (opened.append(path), real_open(path, mode, *a, **k))[1],
                   raising=False)
        extract_part(train, root / "target.json", 0, settings, root / "hs", root / "hs" / "part-0.json")
        extract_fsyncs = counter.calls
    merge([root / "hs" / "part-0.json"], root / "hs" / "index.json")
    build_vocab_mapping(train, 384, 128, root / "vocab" / "mapping.safetensors", root / "vocab" / "stats.json")
    world = World(root, train, root / "target.json", root / "hs", root / "vocab" / "mapping.safetensors", shard_of,
                  len(shards), extract_fsyncs, len(opened), 0, root / "train_reference")
    with pytest.MonkeyPatch.context() as mp:
        counter = _CountFsync(mp)
        _train(world, world.train_dir)
        world.train_fsyncs = counter.calls
    return world


def _train(world: World, out: Path) -> dict:
    return run_training(world.hs / "index.json", world.mapping, world.target, out / "draft", out / "work", TRAINING,
                        metrics_out=out / "metrics.jsonl", summary_out=out / "summary.json")


def _extract(world: World, store: Path) -> dict:
    return extract_part(world.train, world.target, 0, ExtractionSettings(**EXTRACTION), store, store / "part-0.json")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------
# Children and the points they die at


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Countdown:
    """True on the k-th tick (0-based), from any thread."""

    def __init__(self, k: int):
        self.k, self.lock = k, threading.Lock()

    def __call__(self) -> bool:
        with self.lock:
            self.k -= 1
            return self.k == -1


class _FileProxy:
    """A file object that passes everything through; subclasses change ``write``."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        with contextlib.suppress(OSError):  # a full disk may refuse the final flush
            self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


class _HalfWriter(_FileProxy):
    """A file that writes half of its first chunk, then the process dies: a partial file on disk. (On a
    direct-I/O file that unaligned half is refused first, and the stream writes it through the page
    cache: the file is partial either way.)"""

    def write(self, data):
        self.f.write(bytes(data[: max(1, len(data) // 2)]))
        self.f.flush()
        _die()


def _arm(kind: str, k: int, events: Path | None, slow: bool) -> None:
    """In the child: log what extraction captures to ``events``; die at the k-th ``kind`` event."""
    tick = _Countdown(k)
    if kind == "fsync":
        real_fsync = os.fsync

        def fsync(fd):
            if tick():
                _die()
            return real_fsync(fd)

        os.fsync = fsync
    elif kind == "partial":
        def partial_open(path, mode="r", *args, **kwargs):
            f = builtins.open(path, mode, *args, **kwargs)
            return _HalfWriter(f) if "w" in mode and tick() else f

        stream.open = partial_open  # SafetensorsStream's open; nothing else there opens for writing
    real_capture = capture_module.capture_batches
    log = open(events, "a", buffering=1) if events else None  # noqa: SIM115 - lives as long as the child

    def capture(backend, batches):
        def logged():
            for batch in batches:
                if log:
                    log.write("".join(_key(ids) + "\n" for ids in batch))
                if slow:
                    time.sleep(0.01)
                yield batch

        for result in real_capture(backend, logged()):
            if kind == "capture" and tick():
                _die()
            yield result

    capture_module.capture_batches = capture


def _child(fn, *args) -> multiprocessing.Process:
    def main():
        torch.set_num_threads(1)
        fn(*args)

    proc = FORK.Process(target=main, daemon=True)
    proc.start()
    return proc


def _complete_shards(store: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in (store / "part-0").glob("shard-*") if p.is_dir()}


def _kill_when(proc, condition, timeout: float = 60.0) -> bool:
    """SIGKILL ``proc`` once ``condition()`` holds; False when it finished first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.is_alive():
            return False
        if condition():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
            return True
        time.sleep(0.001)
    proc.kill()
    raise AssertionError("the child never reached its kill point")


PARENT_SIDE = ("shards", "metrics", "timed")  # kill points the parent watches for; the rest the child arms


def _sooner(kind: str, k: float) -> float:
    return k / 3 if kind == "timed" else max(1, int(k) // 2)


def _run_killed(start, kind: str, k: float, poll=None):
    """Start a child armed for a child-side kind, or watched for a parent-side one; returns its exit code."""
    proc = start(kind, int(k), kind in PARENT_SIDE)
    if kind == "timed":
        began = time.monotonic()
        _kill_when(proc, lambda: time.monotonic() - began >= k)
    elif poll is not None and kind in ("shards", "metrics"):
        _kill_when(proc, lambda: poll() >= k)
    else:
        proc.join(120)
    return proc.exitcode


# ---------------------------------------------------------------------------------------------
# Extraction killed at 20 points


def _extract_child(world: World, store: Path, events: Path):
    def start(kind, k, slow):
        def run():
            _arm(kind, k, events, slow)
            _extract(world, store)
        return _child(run)
    return start


def _captured(world: World, events: Path) -> set[int]:
    if not events.exists():
        return set()
    return {world.shard_of[line] for line in events.read_text().split() if line in world.shard_of}


def _assert_visible_shards_complete(store: Path) -> None:
    """Every shard folder a reader can see passes its own checksums: nothing partial looks complete."""
    for shard_dir in sorted((store / "part-0").glob("shard-*")):
        manifest = load_shard_manifest(shard_dir)
        for name, digest in manifest["checksums"].items():
            assert file_matches(shard_dir / name, digest), shard_dir / name
    if (store / "part-0.json").exists():
        assert len(_complete_shards(store)) == len(read_json(store / "part-0.json")["shards"])


def _extraction_points(world: World, rng: random.Random) -> list[tuple[str, float]]:
    kinds = ["fsync"] * 6 + ["partial"] * 4 + ["capture"] * 4 + ["shards"] * 2 + ["timed"] * 4
    rng.shuffle(kinds)
    batches = sum(1 for _ in _all_batches(world))
    ranges = {"fsync": world.extract_fsyncs, "partial": world.extract_files, "capture": batches,
              "shards": world.num_shards}
    return [(kind, rng.uniform(0.05, 0.6) if kind == "timed" else rng.randrange(int(kind == "shards"), ranges[kind]))
            for kind in kinds]


def _all_batches(world: World):
    from draftsmith.extract.capture import plan_batches

    for shard in plan_part(world.train, 0, 1, ExtractionSettings(**EXTRACTION)):
        yield from plan_batches(shard, EXTRACTION["batch_tokens"])


def test_extraction_killed_at_20_seeded_points_resumes_byte_identical(world, tmp_path):
    reference = _tree(world.hs / "part-0") | {"part-0.json": (world.hs / "part-0.json").read_bytes()}
    rng = random.Random(SEED)
    points = _extraction_points(world, rng)
    survived, lost_max, report = 0, 0, []
    for trial, (kind, k) in enumerate(points):
        store = tmp_path / f"trial-{trial}"
        runs, complete = [(kind, k)], set()
        for run in range(3):
            if not runs:
                break
            run_kind, run_k = runs.pop(0)
            events = tmp_path / f"trial-{trial}.events-{run}"
            code = _run_killed(_extract_child(world, store, events), run_kind, run_k,
                               poll=lambda: len(_complete_shards(store)))
            for _ in range(4):  # finished before a parent-side kill point (a busy machine): kill sooner
                if code != 0 or run_kind not in PARENT_SIDE or run:
                    break
                shutil.rmtree(store)
                events.unlink(missing_ok=True)
                run_k = k = _sooner(run_kind, run_k)
                code = _run_killed(_extract_child(world, store, events), run_kind, run_k,
                                   poll=lambda: len(_complete_shards(store)))
            assert code == -signal.SIGKILL, f"trial {trial}: {run_kind}@{run_k} ended with {code}, not killed"
            _assert_visible_shards_complete(store)
            begun, before, complete = _captured(world, events), complete, _complete_shards(store)
            assert not (begun & before), f"trial {trial}: shards complete before the run were captured again"
            lost = begun - complete
            assert len(lost) <= PIPELINE_DEPTH, f"trial {trial}: the kill lost shards {sorted(lost)}"
            lost_max = max(lost_max, len(lost))
            remaining = world.num_shards - len(complete)
            if trial % 5 == 4 and run_kind == kind and remaining > 1:  # the resumed run dies too
                runs.append(("fsync", rng.randrange(0, 8 * remaining)))
        final_events = tmp_path / f"trial-{trial}.events-final"
        proc = _child(lambda: (_arm("none", -1, final_events, False), _extract(world, store)))
        proc.join(120)
        assert proc.exitcode == 0, f"trial {trial}: the rerun failed"
        # The rerun captures exactly the shards that were not complete, nothing finished before.
        assert _captured(world, final_events) == set(range(world.num_shards)) - complete, f"trial {trial}"
        assert not list((store / "part-0").glob(".shard-*"))
        got = _tree(store / "part-0") | {"part-0.json": (store / "part-0.json").read_bytes()}
        assert got == reference, f"trial {trial} ({kind}@{k}) differs from the uninterrupted run"
        merge([store / "part-0.json"], store / "index.json")
        assert (store / "index.json").read_bytes() == (world.hs / "index.json").read_bytes()
        survived += 1
        report.append(f"{kind}@{k if kind != 'timed' else round(k, 3)}:{len(complete)}/{world.num_shards}")
        shutil.rmtree(store)
    print(f"extraction: {survived}/{len(points)} kill points survived; a kill lost at most {lost_max} begun "
          "shard(s); " + ", ".join(report))
    assert survived == KILLS


# ---------------------------------------------------------------------------------------------
# Training killed at 20 points


def _metrics_steps(path: Path) -> list[int]:
    steps = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                steps.append(json.loads(line)["step"])
    return steps


def _checkpoint_files(work: Path) -> set[str]:
    return {p.name for p in next((work / "checkpoints").glob("step-*")).iterdir()}


def _checkpoint_step(work: Path, files: set[str]) -> int:
    """The step of the checkpoint a resumed run starts from, checking that it and any newer one are
    whole: the files of a complete checkpoint, each readable. (An older one may be half pruned:
    never resumed from, and removed by the next save.)"""
    root = work / "checkpoints"
    step = read_json(root / "latest.json")["step"] if (root / "latest.json").exists() else 0
    for ckpt in root.glob("step-*"):
        if int(ckpt.name.split("-")[1]) < step:
            continue
        found = sorted(p.name for p in ckpt.iterdir())
        assert set(found) == files, f"{ckpt} is visible but incomplete: {found}"
        for name in files:
            if name.endswith(".safetensors"):
                load_file(ckpt / name)
            elif name.endswith(".json"):
                read_json(ckpt / name)
    return step


def _comparable(out: Path) -> dict:
    """What must equal the uninterrupted run: the draft's bytes, the metrics and summary less timings."""
    metrics = [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"}
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = read_json(out / "summary.json")
    final = {k: v for k, v in summary["final"].items() if k != "tokens_per_s"}
    return {"draft": _tree(out / "draft") | {"training_summary.json": None}, "metrics": metrics,
            "summary": {"steps": summary["steps"], "tokens": summary["tokens"], "final": final}}


def test_training_killed_at_20_seeded_points_resumes_to_the_same_draft(world, tmp_path):
    reference = _comparable(world.train_dir)
    rng = random.Random(SEED + 1)
    kinds = ["fsync"] * 10 + ["metrics"] * 5 + ["timed"] * 5
    rng.shuffle(kinds)
    total = TRAINING.max_steps
    survived, retrained_max, report = 0, 0, []
    for trial, kind in enumerate(kinds):
        k = {"fsync": lambda: rng.randrange(0, world.train_fsyncs), "metrics": lambda: rng.randrange(1, total),
             "timed": lambda: rng.uniform(0.1, 0.8)}[kind]()
        out = tmp_path / f"trial-{trial}"

        def start(kind, k, slow):
            def run():
                _arm(kind, k, None, False)
                _train(world, out)
            return _child(run)

        code = _run_killed(start, kind, k, poll=lambda: len(_metrics_steps(out / "work" / "metrics.jsonl")))
        for _ in range(4):  # finished before a parent-side kill point (a busy machine): kill sooner
            if code != 0 or kind not in PARENT_SIDE:
                break
            shutil.rmtree(out)
            k = _sooner(kind, k)
            code = _run_killed(start, kind, k, poll=lambda: len(_metrics_steps(out / "work" / "metrics.jsonl")))
        assert code == -signal.SIGKILL, f"trial {trial}: {kind}@{k} ended with {code}, not killed"
        done = max(_metrics_steps(out / "work" / "metrics.jsonl"), default=0)
        checkpoint = _checkpoint_step(out / "work", _checkpoint_files(world.train_dir / "work"))
        delivered = (out / "work" / FINISHED).exists()  # killed after the draft was delivered: a rerun trains anew
        if (out / "draft" / "config.json").exists():  # a draft that looks complete is complete
            assert (out / "draft" / "model.safetensors").read_bytes() == \
                (world.train_dir / "draft" / "model.safetensors").read_bytes()

        proc = _child(lambda: _train(world, out))
        proc.join(120)
        assert proc.exitcode == 0, f"trial {trial}: the rerun failed"
        resumed = read_json(out / "summary.json")["resumed_from_step"]
        expected = 0 if delivered else checkpoint
        assert resumed == expected, f"trial {trial}: resumed from {resumed}, expected {expected}"
        retrained = 0 if delivered else done - resumed
        assert 0 <= retrained <= TRAINING.checkpoint_every, f"trial {trial}: {retrained} steps trained twice"
        assert _comparable(out) == reference, f"trial {trial} ({kind}@{k}) differs from the uninterrupted run"
        survived += 1
        retrained_max = max(retrained_max, retrained)
        report.append(f"{kind}@{k if kind != 'timed' else round(k, 3)}:step {done}")
        shutil.rmtree(out)
    print(f"training: {survived}/{len(kinds)} kill points survived; at most {retrained_max} step(s) retrained "
          f"(checkpoint_every={TRAINING.checkpoint_every}); " + ", ".join(report))
    assert survived == KILLS


# ---------------------------------------------------------------------------------------------
# Shards corrupted on disk after they were written


def _corruptions(world: World, rng: random.Random) -> list[tuple[int, str, str]]:
    """(shard, file, how): each kind of shard file flipped and truncated, plus flips in a
    safetensors header and at random places, in seeded shards."""
    files = ["tokens.safetensors", "layer-2.safetensors", "layer-8.safetensors", "manifest.json"]
    cases = [(name, how) for name in files for how in ("flip", "truncate")]
    cases += [("layer-4.safetensors", "flip-header"), ("tokens.safetensors", "flip-header"),
              ("layer-5.safetensors", "flip"), ("manifest.json", "flip")]
    return [(rng.randrange(world.num_shards), name, how) for name, how in cases]


def _corrupt(file: Path, how: str, rng: random.Random) -> None:
    data = bytearray(file.read_bytes())
    if how == "truncate":
        del data[rng.randrange(1, len(data)):]
    else:
        header = 8 + int.from_bytes(data[:8], "little") if file.suffix == ".safetensors" else len(data)
        at = rng.randrange(8, header) if how == "flip-header" else rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
    file.write_bytes(bytes(data))


def test_corrupted_shards_are_caught_before_training_and_regenerated_alone(world, tmp_path, monkeypatch):
    rng = random.Random(SEED + 2)
    reference = _tree(world.hs)
    wrappers, real = [], extract.make_backend

    class Counting:
        def __init__(self, inner):
            self.inner, self.name, self.samples = inner, inner.name, []

        def capture(self, batch):
            self.samples += [_key(ids) for ids in batch]
            return self.inner.capture(batch)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.inner.close()

    monkeypatch.setattr(extract, "make_backend", lambda *a, **k: wrappers.append(Counting(real(*a, **k))) or wrappers[-1])
    cases = _corruptions(world, rng)
    detected = 0
    for n, (shard, name, how) in enumerate(cases):
        store = tmp_path / f"case-{n}"
        shutil.copytree(world.hs, store)
        _corrupt(store / "part-0" / shard_dir_name(shard) / name, how, rng)
        others = {p: p.stat().st_mtime_ns for p in store.glob("part-0/shard-*/*")
                  if p.parent.name != shard_dir_name(shard)}

        with pytest.raises(ExtractionError) as error:
            verify_store(store / "index.json")
        assert f"part 0 shard {shard}: {name}" in str(error.value), (name, how, str(error.value))
        assert error.value.where == str(store / "part-0" / shard_dir_name(shard)) and "rerun" in error.value.fix
        assert not (store / "part-0.json").exists() and not (store / "index.json").exists()  # queued for a rerun

        wrappers.clear()
        _extract(world, store)
        merge([store / "part-0.json"], store / "index.json")
        assert sorted(world.shard_of[k] for k in wrappers[0].samples) == \
            sorted(world.shard_of[k] for k in world.shard_of if world.shard_of[k] == shard)
        assert {p: p.stat().st_mtime_ns for p in others} == others  # the intact shards were left alone
        assert _tree(store) == reference, (name, how)
        verify_store(store / "index.json")
        detected += 1
        shutil.rmtree(store)
    print(f"corruption: {detected}/{len(cases)} detected by checksum and regenerated alone")
    assert detected == len(cases)


def test_the_training_rule_checks_every_shard_before_training_reads_any(world, tmp_path, monkeypatch):
    """The training rule stops at a damaged shard, naming it, before training starts."""
    import runpy
    from types import SimpleNamespace

    import draftsmith.train.launch

    store = tmp_path / "hs"
    shutil.copytree(world.hs, store)
    _corrupt(store / "part-0" / shard_dir_name(3) / "layer-8.safetensors", "flip", random.Random(0))
    started = []
    monkeypatch.setattr(draftsmith.train.launch, "train_draft", lambda *a, **k: started.append(1))
    out = tmp_path / "results"
    rule = SimpleNamespace(
        input=SimpleNamespace(index=str(store / "index.json"), mapping=str(world.mapping), target=str(world.target)),
        output=SimpleNamespace(config=str(out / "draft" / "config.json"), metrics=str(out / "metrics.jsonl"),
                               weights=str(out / "draft" / "model.safetensors"), summary=str(out / "summary.json")),
        params=SimpleNamespace(work_dir=str(out / "state"),
                               config={"train": {"max_steps": 1, "devices": 1}, "device": "cpu"}),
        config={"train": {}},  # the workflow's config, which the untracked keys are read from
        resources=SimpleNamespace(gpu=0),
        log=[str(tmp_path / "train.log")])
    with pytest.raises(ExtractionError, match="part 0 shard 3: layer-8.safetensors fails its checksum"):
        runpy.run_path(str(Path(__file__).parents[1] / "workflow_scripts" / "train_draft.py"),
                       init_globals={"snakemake": rule})
    assert not started and [p.name for p in out.rglob("*")] == ["state.lock"]  # the trainer's lock alone


# ---------------------------------------------------------------------------------------------
# A disk that fills mid-write


def _footprint(root: Path) -> int:
    """Bytes a tmpfs charges for ``root``'s files: whole 4 KiB pages."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in root.rglob("*") if p.is_file())


@contextlib.contextmanager
def _small_disk(path: Path, size: int):
    """A tmpfs of ``size`` bytes at ``path``; yields a function that resizes it. Skips without root."""
    path.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root; the simulated ENOSPC variant covers this machine")
    try:
        yield lambda new: subprocess.run(["mount", "-o", f"remount,size={new}", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class _FullDisk:
    """Simulated ENOSPC: file writes through ``open`` (shard files) and ``os.fdopen`` (every atomic
    write, the dataset files) stop with ENOSPC once ``budget`` bytes were written, mid-chunk."""

    def __init__(self, monkeypatch, budget: int):
        self.left = budget
        disk = self

        class File(_FileProxy):
            def write(self, data):
                size = len(data) if isinstance(data, str) else memoryview(data).nbytes
                if size > disk.left:
                    self.f.write(data[: max(disk.left, 0)])
                    disk.left = 0
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                disk.left -= size
                return self.f.write(data)

        real_open, real_fdopen = builtins.open, os.fdopen
        monkeypatch.setattr(stream, "open", lambda p, mode="r", *a, **k: File(real_open(p, mode, *a, **k))
                            if "w" in mode else real_open(p, mode, *a, **k), raising=False)
        monkeypatch.setattr(os, "fdopen", lambda fd, mode="r", *a, **k: File(real_fdopen(fd, mode, *a, **k))
                            if "w" in mode else real_fdopen(fd, mode, *a, **k))


@pytest.mark.parametrize("disk", ["tmpfs", "enospc"])
def test_a_disk_that_fills_mid_extraction_leaves_only_complete_shards(world, tmp_path, monkeypatch, disk):
    monkeypatch.setattr(extract, "_check_disk", lambda *a: None)  # the disk fills after the up-front check
    store = tmp_path / "disk" / "hs"
    reference = _tree(world.hs / "part-0") | {"part-0.json": (world.hs / "part-0.json").read_bytes()}
    with contextlib.ExitStack() as stack:
        if disk == "tmpfs":
            grow = stack.enter_context(_small_disk(tmp_path / "disk", _footprint(world.hs / "part-0") // 2))
        else:
            fill = stack.enter_context(monkeypatch.context())
            _FullDisk(fill, sum(p.stat().st_size for p in (world.hs / "part-0").rglob("*") if p.is_file()) // 2)
        with pytest.raises(StorageError) as error:
            _extract(world, store)
        assert error.value.errno == errno.ENOSPC and "free disk space" in error.value.fix
        _assert_visible_shards_complete(store)
        assert not (store / "part-0.json").exists() and not list(store.glob("part-0/.shard-*"))
        complete = _complete_shards(store)
        assert 0 < len(complete) < world.num_shards
        kept = {p: p.stat().st_mtime_ns for p in store.glob("part-0/shard-*/*")}
        if disk == "tmpfs":
            grow(4 * _footprint(world.hs))
        else:
            stack.close()  # space freed
        _extract(world, store)
        assert {p: p.stat().st_mtime_ns for p in kept} == kept
        assert _tree(store / "part-0") | {"part-0.json": (store / "part-0.json").read_bytes()} == reference


def test_a_disk_that_fills_mid_training_keeps_the_last_whole_checkpoint(world, tmp_path):
    reference = _comparable(world.train_dir)
    checkpoint = _footprint(next((world.train_dir / "work" / "checkpoints").glob("step-*")))
    out = tmp_path / "disk"
    # room for two checkpoints and half of a third: writing the third one fills the disk
    with _small_disk(out, _footprint(world.train_dir / "work") + checkpoint // 2) as grow:
        with pytest.raises(StorageError) as error:
            _train(world, out)
        assert error.value.errno == errno.ENOSPC and "free disk space" in error.value.fix
        step = _checkpoint_step(out / "work", _checkpoint_files(world.train_dir / "work"))
        assert 0 < step < TRAINING.max_steps and not list((out / "work" / "checkpoints").glob(".step-*"))
        assert not (out / "draft" / "config.json").exists()
        grow(4 * _footprint(world.train_dir))
        assert _train(world, out)["resumed_from_step"] == step
        assert _comparable(out) == reference


@pytest.mark.parametrize("disk", ["tmpfs", "enospc"])
def test_a_disk_that_fills_while_preparing_the_dataset_leaves_no_file(world, tmp_path, monkeypatch, disk):
    from draftsmith.data import DataSettings, prepare_dataset

    rows = [{"messages": [{"role": "user", "content": f"Hello there, question {i}?"},
                          {"role": "assistant", "content": "I am fine, thank you. " * 8}]} for i in range(200)]
    source = tiny.write_jsonl(tmp_path / "chats.jsonl", rows)
    out = tmp_path / "disk" / "data"
    with contextlib.ExitStack() as stack:
        if disk == "tmpfs":
            stack.enter_context(_small_disk(tmp_path / "disk", 32 * 1024))
        else:
            _FullDisk(monkeypatch, 32 * 1024)
        with pytest.raises(StorageError) as error:
            prepare_dataset([source], world.root / "model", out, DataSettings(max_seq_len=128))
        assert error.value.errno == errno.ENOSPC and str(out / "train.jsonl") == error.value.where
        assert not list(out.iterdir())  # no train.jsonl, heldout.jsonl, stats.json, nor their temporary files


def test_an_atomic_write_that_fails_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    atomic_write_bytes(target, b"old")
    _FullDisk(monkeypatch, 10)
    with pytest.raises(StorageError, match="No space left") as error:
        atomic_write_bytes(target, b"x" * 100)
    assert error.value.where == str(target)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


# ---------------------------------------------------------------------------------------------
# Two parts writing at once


def test_two_parts_writing_into_one_store_at_once_lose_nothing(world, tmp_path):
    settings = ExtractionSettings(**{**EXTRACTION, "parts": 2})
    reference = tmp_path / "reference"
    for part in range(2):
        extract_part(world.train, world.target, part, settings, reference, reference / f"part-{part}.json")
    merge([reference / f"part-{p}.json" for p in range(2)], reference / "index.json")

    store, go = tmp_path / "store", FORK.Event()

    def part(p):
        go.wait(30)
        extract_part(world.train, world.target, p, settings, store, store / f"part-{p}.json")

    procs = [_child(part, p) for p in range(2)]
    go.set()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    merge([store / f"part-{p}.json" for p in range(2)], store / "index.json")
    assert _tree(store) == _tree(reference)
    assert HiddenStateIndex.load(store / "index.json").num_samples == 36
