"""The extraction driver: its plan, what it stores, resume after a kill, parts, and its stops."""

import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

import tiny
from draftsmith.errors import ConfigError, ExtractionError
from draftsmith.extract import extract, shard_writer
from draftsmith.extract import safetensors_stream as stream
from draftsmith.extract.backends import CaptureBackend
from draftsmith.extract.capture import check_states, plan_batches
from draftsmith.extract.extract import extract_part, merge, plan_part
from draftsmith.extract.hf_backend import HfBackend
from draftsmith.extract.hidden_states import Fp8Rows, HiddenStateIndex, layer_file, quantize_fp8, read_shard
from draftsmith.extract.safetensors_stream import write_safetensors
from draftsmith.extract.settings import ExtractionSettings
from draftsmith.io import bytes_match
from draftsmith.targets.inspect import write_target_json

TESTS = Path(__file__).resolve().parent
SMALL = dict(device="cpu", batch_tokens=96, shard_tokens=120)  # many small shards and batches


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    model = tiny.build_llama(folder / "model")
    info = write_target_json(folder / "target.json", model)
    return folder / "target.json", info


def _rows(count, seed=0, max_len=40):
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        n = rng.randint(2, max_len)
        rows.append({"id": f"sample-{i}", "input_ids": [rng.randrange(1, 384) for _ in range(n)],
                     "loss_mask": [rng.randint(0, 1) for _ in range(n)], "source": {"row": i}})
    return rows


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    return tiny.write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", _rows(36))


def _run(train, target_json, root, settings, parts=None):
    """Extract every part into ``root`` and merge; returns the index."""
    manifests = []
    for part in range(settings.parts if parts is None else parts):
        manifest = root / f"part-{part}.json"
        extract_part(train, target_json, part, settings, root, manifest)
        manifests.append(manifest)
    return merge(manifests, root / "index.json")


def _tree(root):
    """Every file under ``root`` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class _Counting(CaptureBackend):
    """Wraps a backend and records which samples' tokens it was asked to capture."""

    name = "counting"

    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def capture(self, batch):
        self.batches.append(batch)
        return self.inner.capture(batch)


# --- the plan --------------------------------------------------------------------------------


def test_plan_splits_sorts_and_cuts_deterministically(train):
    settings = ExtractionSettings(parts=3, **SMALL)
    plans = [plan_part(train, p, 3, settings) for p in range(3)]
    assert plans == [plan_part(train, p, 3, settings) for p in range(3)]
    ids = [s["id"] for plan in plans for shard in plan for s in shard]
    assert sorted(ids) == sorted(r["id"] for r in _rows(36))  # every sample once
    tokens = [sum(len(s["input_ids"]) for shard in plan for s in shard) for plan in plans]
    assert max(tokens) - min(tokens) <= 40  # dealt by length: parts get about the same work
    for plan in plans:
        lengths = [len(s["input_ids"]) for shard in plan for s in shard]
        assert lengths == sorted(lengths, reverse=True)
        for shard in plan:
            assert sum(len(s["input_ids"]) for s in shard) <= 120 or len(shard) == 1
            for batch in plan_batches(shard, 96):
                assert len(batch) * max(len(s["input_ids"]) for s in batch) <= 96 or len(batch) == 1


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="extraction.dtype"):
        ExtractionSettings(dtype="int4")
    with pytest.raises(ConfigError, match="shard_tokens"):
        ExtractionSettings(shard_tokens=0)
    with pytest.raises(ConfigError, match="unknown extraction setting"):
        ExtractionSettings.from_config({"extraction": {"backend": "hf", "batch_size": 4}})
    assert ExtractionSettings.from_config({"extraction": {"parts": 2}, "device": "cpu"}).parts == 2


# --- what is stored ---------------------------------------------------------------------------


def test_stored_states_are_the_targets_states(train, target, tmp_path):
    target_json, info = target
    settings = ExtractionSettings(dtype="float32", **SMALL)
    index = _run(train, target_json, tmp_path / "hs", settings)
    rows = {r["id"]: r for r in _rows(36)}
    assert index.num_samples == 36 and len(index.shards) > 5
    backend = HfBackend.load(info["model_path"], layers_path=info["layers_path"], final_layer_id=8,
                             capture_layer_ids=info["captured_layer_ids"], lm_head_path="lm_head", device="cpu")
    for shard in index.shards:
        data = read_shard(index, shard)
        for i, sample_id in enumerate(data.sample_ids):
            a, b = data.offsets[i].item(), data.offsets[i + 1].item()
            assert data.input_ids[a:b].tolist() == rows[sample_id]["input_ids"]
            assert data.loss_mask[a:b].tolist() == [bool(m) for m in rows[sample_id]["loss_mask"]]
            alone = backend.capture([rows[sample_id]["input_ids"]])[0]
            for layer_id in [2, 4, 5, 8]:
                torch.testing.assert_close(data.states[layer_id][a:b], alone[layer_id], rtol=1e-5, atol=1e-4)


def test_auto_captures_in_bfloat16_where_the_cpu_multiplies_it(train, target, tmp_path, monkeypatch):
    """target.dtype auto on the CPU: the HF backend's forwards in bfloat16 on a CPU with bfloat16 matrix
    instructions, float32 on one without, and a store made one way is never taken for the other."""
    from draftsmith.engines.cpu_bfloat16 import CPU_BFLOAT16_ENV

    def bfloat16_values(index) -> bool:  # a float32 store holds bfloat16's values only if computed in it
        states = read_shard(index, index.shards[0]).states[5]
        return torch.equal(states, states.bfloat16().float())

    target_json, _ = target
    settings = ExtractionSettings(dtype="float32", **SMALL)
    monkeypatch.setenv(CPU_BFLOAT16_ENV, "1")
    root = tmp_path / "hs"
    assert bfloat16_values(_run(train, target_json, root, settings))
    monkeypatch.setenv(CPU_BFLOAT16_ENV, "0")
    assert not bfloat16_values(_run(train, target_json, root, settings))  # another machine's auto: captured anew
    _run(train, target_json, tmp_path / "fresh", settings)
    assert _tree(root) == _tree(tmp_path / "fresh")


def test_parts_merge_into_one_index_covering_every_sample_once(train, target, tmp_path):
    target_json, _ = target
    index = _run(train, target_json, tmp_path / "hs", ExtractionSettings(parts=2, **SMALL))
    assert sorted({s.part for s in index.shards}) == [0, 1]
    ids = [i for shard in index.shards for i in read_shard(index, shard, layer_ids=[8]).sample_ids]
    assert sorted(ids) == sorted(r["id"] for r in _rows(36))
    assert index.num_tokens == sum(len(r["input_ids"]) for r in _rows(36))
    assert index.layer_ids == [2, 4, 5, 8] and index.dtype == "bfloat16"
    with pytest.raises(ExtractionError, match="expected 0..1"):
        merge([tmp_path / "hs" / "part-1.json"] * 2, tmp_path / "hs" / "index2.json")


def test_fp8_is_made_in_the_capture_as_the_store_quantises(train, target, tmp_path, monkeypatch):
    """With fp8 storage the backend quantises on the target's device and the writer never does; each
    layer file holds, bit for bit, the store's quantiser applied to the states a float32 extraction
    of the same samples (same target, same device) stores."""
    target_json, _ = target
    full = _run(train, target_json, tmp_path / "float32", ExtractionSettings(dtype="float32", **SMALL))

    def refuse(states):
        raise AssertionError("the shard writer quantised captured states")

    monkeypatch.setattr(shard_writer, "quantize_fp8", refuse)
    index = _run(train, target_json, tmp_path / "fp8", ExtractionSettings(dtype="fp8", **SMALL))
    assert len(index.shards) == len(full.shards) > 5
    for shard, reference in zip(index.shards, full.shards, strict=True):
        states = read_shard(full, reference).states
        for layer_id in index.layer_ids:
            stored = load_file(index.root / shard.path / layer_file(layer_id))
            values, scales = quantize_fp8(states[layer_id])
            assert torch.equal(stored["hidden_states"].view(torch.uint8), values.view(torch.uint8))
            assert torch.equal(stored["scales"].view(torch.int32), scales.view(torch.int32))
    data = read_shard(index, index.shards[0])
    assert data.states[8].dtype == torch.bfloat16 and torch.isfinite(data.states[8].float()).all()


@pytest.mark.parametrize("io", ["direct", "page cache", "direct refused at the first write"])
def test_writer_bytes_equal_safetensors_save(tmp_path, monkeypatch, io):
    """The file is safetensors' own bytes whichever way it reaches the disk: direct I/O through the
    aligned staging buffer (a tensor larger than the buffer, a last block that is not whole), the
    page cache, or a file system that takes O_DIRECT at open and refuses its writes."""
    if io == "page cache":
        monkeypatch.delattr(os, "O_DIRECT")
    elif not _takes_direct_io(tmp_path):
        pytest.skip("this file system refuses O_DIRECT at open")
    if io == "direct refused at the first write":
        real_open = stream._open_for_writing

        def refusing_open(path, direct_if_it_pays):
            file = real_open(path, direct_if_it_pays)

            def write(data):  # refused for as long as the descriptor asks for direct I/O
                if fcntl.fcntl(file.fileno(), fcntl.F_GETFL) & os.O_DIRECT:
                    raise OSError(errno.EINVAL, "direct I/O refused")
                return file.write(data)

            return _WriteOverride(file, write)

        monkeypatch.setattr(stream, "_open_for_writing", refusing_open)
    values, scales = quantize_fp8(torch.randn(5, 8))
    cases = [
        {"input_ids": torch.arange(7), "loss_mask": torch.ones(7, dtype=torch.uint8), "offsets": torch.tensor([0, 7])},
        {"hidden_states": values, "scales": scales},
        {"hidden_states": torch.randn(3, 8).bfloat16()},
        {"hidden_states": torch.randn(3, 8).half()},
        {"hidden_states": torch.zeros(0, 8)},
        {"hidden_states": torch.randn(2049, 2051).bfloat16()},  # 8.4 MB: past the 8 MiB staging buffer
    ]
    for tensors in cases:
        digest = write_safetensors(tmp_path / "x.safetensors", tensors)
        data = (tmp_path / "x.safetensors").read_bytes()
        assert data == save_safetensors(tensors)
        assert digest == "xxh3_128:" + xxhash.xxh3_128(data).hexdigest()
        assert bytes_match(data, digest) and not bytes_match(data[:-1] + b"!", digest)
        assert bytes_match(data, hashlib.sha256(data).hexdigest())  # stores written with SHA-256 still read


def test_streams_on_tmpfs_write_through_the_page_cache():
    """tmpfs has no disk to bypass: direct I/O there would only add the staging copy."""
    import tempfile

    if stream.file_system_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    assert not stream.direct_io_pays("/dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        tensors = {"hidden_states": torch.randn(3, 8).bfloat16()}
        probe = stream.SafetensorsStream(Path(folder) / "x.safetensors", [("hidden_states", torch.bfloat16, (3, 8))])
        probe.write(tensors["hidden_states"])
        probe.close()
        assert not probe.direct and (Path(folder) / "x.safetensors").read_bytes() == save_safetensors(tensors)


def test_streams_read_soon_are_left_in_the_page_cache(tmp_path):
    """A file read back soon (the online window) goes through the page cache, and its pages are
    still cached after its writebacks and the sync; where the disk takes direct I/O, the same bytes
    written for a store read later bypass the cache. Both are safetensors' own bytes."""
    tensor = torch.randn(2048, 2048).bfloat16()  # 8 MiB in 8 appends, writeback started after each
    direct_taken = _takes_direct_io(tmp_path)
    for read_soon in (True, False) if direct_taken else (True,):
        path = tmp_path / f"read-soon-{read_soon}.safetensors"
        writer = stream.SafetensorsStream(path, [("hidden_states", torch.bfloat16, tuple(tensor.shape))],
                                          read_soon=read_soon)
        for rows in tensor.split(256):
            writer.write(rows)
            writer.start_writeback()
        writer.close()
        assert writer.direct is not read_soon
        cached = _cached_fraction(path)  # before anything reads it
        assert cached > 0.99 if read_soon else cached < 0.01, (read_soon, cached)
        assert path.read_bytes() == save_safetensors({"hidden_states": tensor})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_writeback_of_pages_left_cached_starts(tmp_path):
    """The writeback that leaves the pages cached is Linux's sync_file_range, bound through ctypes:
    it is found, and it accepts a written file (0, not -1)."""
    call = stream._sync_file_range()
    assert call is not None
    with open(tmp_path / "x", "wb") as file:
        file.write(os.urandom(1 << 20))
        assert call(file.fileno(), 0, 0, stream._SYNC_FILE_RANGE_WRITE) == 0


@pytest.mark.parametrize("read_soon", [True, False])
def test_window_shards_are_left_in_the_page_cache(tmp_path, read_soon):
    """A store made for the online window (``read_soon``) leaves every file of a committed shard in
    the page cache, its tokens too; extraction's store bypasses it where the disk takes direct I/O."""
    if not read_soon and not _takes_direct_io(tmp_path):
        pytest.skip("this file system refuses O_DIRECT at open")
    store = shard_writer.PartStore(tmp_path / "window", 0, fingerprint="f", dtype="bfloat16", hidden_size=1024,
                                   layer_ids=[1, 3], read_soon=read_soon)
    ids = [list(range(1, 1025)), list(range(1, 1025))]
    store.write_shard(0, ["a", "b"], ids, [[1] * 1024] * 2, {1: torch.randn(2048, 1024), 3: torch.randn(2048, 1024)})
    files = sorted((store.dir / "shard-00000").glob("*.safetensors"))
    assert len(files) == 3  # two layers and the tokens
    cached = {f.name: _cached_fraction(f) for f in files}
    assert all(c > 0.99 if read_soon else c < 0.01 for c in cached.values()), cached


def _cached_fraction(path) -> float:
    """The share of the file's pages in the page cache: ``mincore`` on a mapping that touches none."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    start = ctypes.c_char.from_buffer(mapped)
    try:
        assert libc.mincore(ctypes.addressof(start), size, vector) == 0, os.strerror(ctypes.get_errno())
    finally:
        del start  # the mapping closes only once no buffer points into it
        mapped.close()
    return sum(v & 1 for v in vector) / pages


def _takes_direct_io(folder) -> bool:
    probe = stream.SafetensorsStream(folder / "probe.safetensors", [("x", torch.uint8, (1,))])
    probe.write(torch.zeros(1, dtype=torch.uint8))
    probe.close()
    return probe.direct


class _WriteOverride:
    """A file object whose write is replaced; everything else is the file's."""

    def __init__(self, file, write) -> None:
        self.file, self.write = file, write

    def __getattr__(self, name):
        return getattr(self.file, name)


# --- resume -----------------------------------------------------------------------------------


def test_a_finished_part_loads_no_model(train, target, tmp_path, monkeypatch):
    target_json, _ = target
    settings = ExtractionSettings(**SMALL)
    _run(train, target_json, tmp_path / "hs", settings)
    before = _tree(tmp_path / "hs")

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded although every shard is complete")

    monkeypatch.setattr(extract, "make_backend", refuse)
    _run(train, target_json, tmp_path / "hs", settings)
    assert _tree(tmp_path / "hs") == before


def test_a_corrupted_shard_is_detected_and_redone_alone(train, target, tmp_path, monkeypatch):
    target_json, _ = target
    settings = ExtractionSettings(**SMALL)
    root = tmp_path / "hs"
    _run(train, target_json, root, settings)
    before = _tree(root)
    victim = root / "part-0" / "shard-00003" / "layer-4.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    untouched = {p: p.stat().st_mtime_ns for p in root.glob("part-0/shard-*/*") if "shard-00003" not in str(p)}

    wrappers = []
    real = extract.make_backend

    def counting(*args, **kwargs):
        wrappers.append(_Counting(real(*args, **kwargs)))
        return wrappers[-1]

    monkeypatch.setattr(extract, "make_backend", counting)
    _run(train, target_json, root, settings)
    shard3 = plan_part(train, 0, 1, settings)[3]
    assert [ids for batch in wrappers[0].batches for ids in batch] == [s["input_ids"] for s in shard3]
    assert {p: p.stat().st_mtime_ns for p in untouched} == untouched
    assert _tree(root) == before


def test_changed_inputs_never_mix_with_old_shards(train, target, tmp_path):
    target_json, _ = target
    settings = ExtractionSettings(**SMALL)
    root = tmp_path / "hs"
    _run(train, target_json, root, settings)
    rows = _rows(36)
    rows[5]["input_ids"][0] = (rows[5]["input_ids"][0] + 1) % 384
    changed = tiny.write_jsonl(tmp_path / "changed.jsonl", rows)
    index = _run(changed, target_json, root, settings)
    fresh = _run(changed, target_json, tmp_path / "fresh", settings)
    assert _tree(root) == _tree(tmp_path / "fresh")
    assert index.num_tokens == fresh.num_tokens


KILL_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
import draftsmith.extract.shard_writer as hs
import draftsmith.extract.capture as ex
import draftsmith.extract.hf_backend
from transformers import LlamaForCausalLM
from draftsmith.extract.extract import extract_part
from draftsmith.extract.settings import ExtractionSettings

# Slow the run down so the test can kill it mid-write and mid-compute.
append = hs.ShardWriter.append
def slow_append(self, states):
    append(self, states)
    time.sleep(0.03)
hs.ShardWriter.append = slow_append
capture = ex.capture_batches
def slow_capture(backend, batches):
    for result in capture(backend, batches):
        time.sleep(0.03)
        yield result
ex.capture_batches = slow_capture

sys.stdin.readline()  # imports done; wait for the go
extract_part({train!r}, {target!r}, 0, ExtractionSettings(**{settings!r}), {root!r}, {manifest!r})
"""


def _start(train, target_json, root, settings):
    """A child that imports everything, then waits for ``_go`` (so the next child warms up meanwhile)."""
    script = KILL_SCRIPT.format(tests=str(TESTS), train=str(train), target=str(target_json), settings=settings,
                                root=str(root), manifest=str(root / "part-0.json"))
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _go(proc):
    proc.stdin.write(b"go\n")
    proc.stdin.flush()


def _complete(root):
    return len(list(root.glob("part-0/shard-*")))


def _kill_when(proc, condition, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    proc.kill()
    raise AssertionError("the extraction never reached the point to kill it at")


def test_killed_at_any_moment_a_rerun_finishes_byte_identical(train, target, tmp_path):
    target_json, _ = target
    settings = dict(SMALL, shard_tokens=60, batch_tokens=64)
    root = tmp_path / "killed"
    procs = [_start(train, target_json, root, settings) for _ in range(2)]

    reference = tmp_path / "reference"
    extract_part(train, target_json, 0, ExtractionSettings(**settings), reference, reference / "part-0.json")
    merge([reference / "part-0.json"], reference / "index.json")
    total = _complete(reference)
    assert total >= 10

    kills = [
        lambda: _complete(root) >= 2,  # between shards: the next one is being computed
        lambda: any(root.glob("part-0/.shard-*.tmp-*")) and _complete(root) >= 4,  # mid-write of a shard
    ]
    progress = []
    for i, condition in enumerate(kills):
        proc = procs.pop(0)
        _go(proc)
        if i < len(kills) - 1:
            procs.append(_start(train, target_json, root, settings))
        assert _kill_when(proc, condition), proc.stderr.read().decode()[-2000:]
        progress.append(_complete(root))
        assert not (root / "part-0.json").exists()
    assert any(root.glob("part-0/.shard-*.tmp-*"))  # the second kill left a half-written shard
    assert progress == sorted(progress) and progress[-1] < total

    _go(procs[0])
    assert procs[0].wait(timeout=120) == 0, procs[0].stderr.read().decode()[-2000:]
    merge([root / "part-0.json"], root / "index.json")
    assert not list(root.glob("part-0/.shard-*"))  # the half-written shard was cleared
    assert _tree(root) == _tree(reference)


def _holding(proc, lock: Path) -> Path:
    """``lock`` once ``proc`` holds it (its pid written in it)."""
    deadline = time.monotonic() + 90
    while not (lock.is_file() and lock.read_text().startswith(f"{proc.pid}@")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.01)
    return lock


def test_a_part_has_one_writer_and_its_lock_dies_with_it(train, target, tmp_path):
    """An orphaned job and its rerun on one part: the second writer stops at once, naming the
    first; once the first is killed (-9, no clean-up), a new writer takes the part and finishes."""
    target_json, _ = target
    settings = dict(SMALL, shard_tokens=60, batch_tokens=64)
    root = tmp_path / "hs"
    first = _start(train, target_json, root, settings)
    _go(first)
    lock = _holding(first, root / "part-0.lock")
    try:
        with pytest.raises(ExtractionError) as e:
            extract_part(train, target_json, 0, ExtractionSettings(**settings), root, root / "part-0.json")
        assert f"another process (pid {first.pid} on" in e.value.what and "extraction part 0" in e.value.what
        assert str(lock) in e.value.where and f"kill {first.pid}" in e.value.fix
        assert first.poll() is None  # the first writer goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    extract_part(train, target_json, 0, ExtractionSettings(**settings), root, root / "part-0.json")
    assert (root / "part-0.json").is_file() and lock.read_text() == ""  # held while writing only


def test_a_writer_that_outlives_its_snakemake_leaves_the_manifest_to_the_rerun(train, target, tmp_path):
    """The first writer goes on after the rerun's job was refused (and failed): it must not then
    write the part's manifest, which Snakemake would take for that job's output; its shards stay,
    and the next rerun finishes the part from them."""
    target_json, _ = target
    settings = dict(SMALL, shard_tokens=60, batch_tokens=64)
    root = tmp_path / "hs"
    first = _start(train, target_json, root, settings)
    _go(first)
    _holding(first, root / "part-0.lock")
    with pytest.raises(ExtractionError, match="another process"):
        extract_part(train, target_json, 0, ExtractionSettings(**settings), root, root / "part-0.json")
    assert first.wait(timeout=120) != 0
    assert "leaves the rule's outputs to that job's rerun" in first.stderr.read().decode()
    assert not (root / "part-0.json").exists()
    written = _complete(root)
    assert written >= 10  # the first writer's shards, all of them
    extract_part(train, target_json, 0, ExtractionSettings(**settings), root, root / "part-0.json")
    assert (root / "part-0.json").is_file() and _complete(root) == written
    assert not (root / "part-0.lock.superseded").exists()


# --- stops ------------------------------------------------------------------------------------


def test_not_enough_disk_space_stops_before_the_model_loads(train, target, tmp_path, monkeypatch):
    target_json, _ = target
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 1000, 1000))

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the disk check")

    monkeypatch.setattr(extract, "make_backend", refuse)
    settings = ExtractionSettings(min_free_bytes=0, **SMALL)
    with pytest.raises(ExtractionError) as error:
        extract_part(train, target_json, 0, settings, tmp_path / "hs", tmp_path / "hs" / "part-0.json")
    message = str(error.value)
    assert "not enough disk space" in message and "1000 B free" in message
    assert str(tmp_path / "hs" / "part-0") in message and "fp8 would need" in message


class _Faulty(CaptureBackend):
    """Random states, except NaN, Inf or zeros for one sample; for an fp8 store quantised, as the
    real backends hand them over."""

    name = "faulty"

    def __init__(self, poison, fault, fp8=False):
        self.poison, self.fault, self.fp8 = poison, fault, fp8

    def capture(self, batch):
        out = []
        for ids in batch:
            states = {i: torch.randn(len(ids), 64) for i in [2, 4, 5, 8]}
            if ids == self.poison:
                states[5] = torch.zeros(len(ids), 64) if self.fault == "zero" else states[5]
                if self.fault in ("nan", "inf"):
                    states[5][len(ids) - 1, 3] = float(self.fault)
                if self.fault == "huge":  # finite as captured, infinite once stored as float16
                    states[5][len(ids) - 1, 3] = 1e5
            out.append({i: Fp8Rows(*quantize_fp8(t)) for i, t in states.items()} if self.fp8 else states)
            if ids == self.poison and self.fault == "scales":  # a scale short
                out[-1][5] = Fp8Rows(out[-1][5].values, out[-1][5].scales[:-1])
        return out


@pytest.mark.parametrize("fault, storage, words", [
    ("nan", "bfloat16", "NaN or Inf"), ("inf", "bfloat16", "NaN or Inf"), ("zero", "bfloat16", "all zero"),
    ("huge", "float16", "NaN or Inf, or values beyond float16's range"),
    ("nan", "fp8", "NaN or Inf"), ("inf", "fp8", "NaN or Inf"), ("zero", "fp8", "all zero"),
])
def test_numerical_guard_names_the_sample_and_layer(train, target, tmp_path, monkeypatch, fault, storage, words):
    target_json, _ = target
    poison = _rows(36)[11]
    monkeypatch.setattr(extract, "make_backend", lambda *a, **k: _Faulty(poison["input_ids"], fault, storage == "fp8"))
    with pytest.raises(ExtractionError, match=f"sample 'sample-11': layer 5 states (hold|are) {words}"):
        extract_part(train, target_json, 0, ExtractionSettings(**{**SMALL, "dtype": storage}), tmp_path / "hs",
                     tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()
    # the check runs beside the batch's write: the shard it stops is not committed, nor left half-written
    shards = [d for d in (tmp_path / "hs").rglob("*") if d.is_dir() and "shard" in d.name]
    assert shards and all(not d.name.startswith(".") for d in shards)
    assert not any("sample-11" in json.loads((d / "manifest.json").read_text())["sample_ids"] for d in shards)


def test_fp8_rows_without_a_scale_per_token_are_refused_before_the_store(train, target, tmp_path, monkeypatch):
    target_json, _ = target
    poison = _rows(36)[11]
    monkeypatch.setattr(extract, "make_backend", lambda *a, **k: _Faulty(poison["input_ids"], "scales", fp8=True))
    with pytest.raises(ExtractionError, match=r"faulty backend returned layer 5 fp8 rows for sample 'sample-11'.*"
                                              r"scales of shape \(\d+,\)"):
        extract_part(train, target_json, 0, ExtractionSettings(**{**SMALL, "dtype": "fp8"}), tmp_path / "hs",
                     tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()


def test_the_guard_checks_rows_quantised_in_the_capture():
    """Rows already in fp8 are checked by their scales: the first token holding NaN or Inf is named,
    all-zero states stop, and states merely tiny (their scales at the floor as well) pass."""
    def check(states):
        check_states(["s"], [{5: Fp8Rows(*quantize_fp8(states))}], where="part 0 shard 0", storage="fp8")

    states = torch.randn(6, 64)
    check(states)
    check(torch.full((6, 64), 1e-15))
    for value in (float("nan"), float("inf"), -float("inf")):
        bad = states.clone()
        bad[4, 9] = value
        with pytest.raises(ExtractionError, match="layer 5 states hold NaN or Inf.*first at token 4"):
            check(bad)
    with pytest.raises(ExtractionError, match="layer 5 states are all zero"):
        check(torch.zeros(6, 64))


def test_index_loads(train, target, tmp_path):
    target_json, _ = target
    _run(train, target_json, tmp_path / "hs", ExtractionSettings(**SMALL))
    index = HiddenStateIndex.load(tmp_path / "hs" / "index.json")
    raw = json.loads((tmp_path / "hs" / "index.json").read_text())
    assert raw["num_samples"] == 36 and index.final_layer_id == 8


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_extraction_rule_runs_through_vllm_under_snakemake(tmp_path):
    """The rule as a user runs it: vLLM's engine process starts from the rule's script (spawn runs
    it again as __mp_main__), the default context holds the longest sample plus the sampled token,
    and the rule's log keeps the driver's lines after the engine starts, down to which side set
    the extraction's pace."""
    from workflow_helpers import snakemake, tiny_workflow, write_config

    workdir, config = tiny_workflow(tmp_path)
    config["extraction"] = {"backend": "vllm", "shard_tokens": 512}
    config["engine_env"] = {"VLLM_CPU_KVCACHE_SPACE": 1, "VLLM_ENABLE_V1_MULTIPROCESSING": 1}
    snakemake(workdir, "results/t/hidden_states/part-0.json", configfile=write_config(workdir, config))
    log = (workdir / "logs/t/extract_hidden_states/part-0.log").read_text()
    rows = (workdir / "results/t/data/train.jsonl").read_text().splitlines()
    tokens = sum(len(json.loads(row)["input_ids"]) for row in rows)
    assert "vllm backend ready" in log and f"{tokens} tokens in" in log
    assert "the store was busy" in log and "the capture waited" in log
