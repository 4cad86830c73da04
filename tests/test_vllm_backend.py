"""The vLLM capture backend against Hugging Face ``output_hidden_states`` on tiny random-init targets.

Each target gets one vLLM engine, run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
seconds to start instead of half a minute), except one test that runs the default multiprocess
engine in bf16. Batches mix lengths (1..64 tokens) and the Llama engine runs at most 4 requests
per forward pass, so passes hold rows of several requests and the batch takes several passes: the
states must still be each sample's own, whatever else shares the pass.

On the CPU build the engines run float32 and match Hugging Face to 1e-4. On CUDA (``pytest -m
gpu``) they run bfloat16, as deployments do; there a layer's error against float32 Hugging Face
must stay within twice the error that bfloat16 Hugging Face itself makes, plus 0.01.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from draftsmith.extract.hidden_states import Fp8Rows, dequantize_fp8, quantize_fp8
from tiny import build_llama, build_llava
from tiny_vllm import (
    CAPTURE_DTYPE,
    ENGINE_ARGS,
    ON_CUDA,
    build_deepseek_v3_for_platform,
    build_idefics3,
    build_olmo2,
    build_qwen3_moe,
    vllm_test,
)

LENGTHS = (5, 33, 1, 17, 64, 9)
MAX_MODEL_LEN = 128


def random_batch(vocab_size: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)  # ids below vocab_size - 1: the multimodal targets' image token is the last id
    return [[rng.randrange(3, vocab_size - 1) for _ in range(n)] for n in lengths]


def hf_hidden_states(path, batch, dtype=torch.float32) -> list[tuple[torch.Tensor, ...]]:
    """Reference: transformers' own ``output_hidden_states``, one sample at a time (no padding)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return [tuple(h[0] for h in model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states)
                for ids in batch]


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def hf_reference(path, batch, layer_ids, dtype=CAPTURE_DTYPE):
    """Hugging Face's float32 states of ``batch`` and each layer's error bound for a capture in ``dtype``."""
    ref = hf_hidden_states(path, batch)
    if dtype == "float32":
        return ref, {lid: 1e-4 for lid in layer_ids}
    ref16 = hf_hidden_states(path, batch, getattr(torch, dtype))
    return ref, {lid: 2 * max(relative_error(r16[lid], r32[lid]) for r16, r32 in zip(ref16, ref)) + 0.01
                 for lid in layer_ids}


def assert_parity(got, path, batch, layer_ids, dtype=CAPTURE_DTYPE, reference=None):
    """Each sample's captured states against Hugging Face's float32 ones (see the module's docstring);
    ``reference``: ``hf_reference``'s, computed before the engine started."""
    ref, bound = reference or hf_reference(path, batch, layer_ids, dtype)
    for n, (sample, expected) in enumerate(zip(got, ref)):
        assert sorted(sample) == sorted(layer_ids)
        for lid in layer_ids:
            assert sample[lid].shape == expected[lid].shape, (n, lid)
            assert sample[lid].dtype == getattr(torch, dtype)
            err = relative_error(sample[lid], expected[lid])
            assert err < bound[lid], f"sample {n} layer {lid}: relative error {err:.2e} >= {bound[lid]:.2e}"


def _engine(path, layer_ids, dtype=CAPTURE_DTYPE, **kwargs):
    from draftsmith.extract.vllm_backend import VllmBackend

    return VllmBackend(str(path), layer_ids, dtype=dtype, max_model_len=MAX_MODEL_LEN, **ENGINE_ARGS, **kwargs)


class TestOneLlamaEngine:
    """One Llama capture engine for these tests, closed before any later test starts its own: in one
    process vLLM keeps one parallel state, whose expert-parallel group exists only if the engine that
    made it served a MoE target (vLLM 0.33), so a MoE engine beside a live dense one fails to load."""

    @pytest.fixture(scope="class")
    @staticmethod
    def llama(tmp_path_factory, in_process_engine):
        path = build_llama(tmp_path_factory.mktemp("vllm-llama") / "target", num_layers=4)
        layer_ids = [0, 1, 2, 4]
        backend = _engine(path, layer_ids, layers_path="model.layers", max_num_seqs=4)
        yield path, layer_ids, backend
        backend.close()

    @vllm_test
    def test_llama_matches_hf_in_any_batch(self, llama):
        path, layer_ids, backend = llama
        assert backend.info["layers_path"] == "model.layers"
        batch = random_batch(384)
        got = backend.capture(batch)
        assert_parity(got, path, batch, layer_ids)
        # The same samples in another order, beside other samples and a repeat of one of them: the same
        # states (bit-identical on the CPU; on CUDA other batch shapes may pick other kernel tilings).
        others = random_batch(384, lengths=(40, 2, 11), seed=1)
        mixed = backend.capture(others + batch[::-1] + batch[:1])[len(others):]
        assert torch.equal(mixed[-1][0], mixed[-2][0])
        for a, b in zip(got, mixed[:-1][::-1]):
            for lid in layer_ids:
                if ON_CUDA:
                    assert relative_error(b[lid], a[lid]) < 0.01
                else:
                    assert torch.equal(a[lid], b[lid])


    @vllm_test
    def test_llama_rejects_samples_longer_than_the_engine_takes(self, llama):
        from draftsmith.errors import ExtractionError

        _, _, backend = llama
        with pytest.raises(ExtractionError, match="max_model_len"):
            backend.capture([[5] * MAX_MODEL_LEN])
        assert backend.capture([]) == []
        assert backend.capture([[5, 6, 7]])[0][4].shape == (3, 64)  # the engine still works afterwards


    @vllm_test
    def test_llama_stream_matches_capture_and_leaves_no_pass_behind(self, llama):
        """The stream's feeder runs batches ahead of the mapping: the same states as batch-by-batch
        capture, and an abandoned stream leaves no pass file in the spool."""
        import os

        _, layer_ids, backend = llama
        batches = [random_batch(384, seed=s) for s in (2, 3, 4)]
        streamed = list(backend.capture_stream(batches))
        for batch, got in zip(batches, streamed, strict=True):
            for a, b in zip(got, backend.capture(batch), strict=True):
                for lid in layer_ids:
                    assert torch.equal(a[lid], b[lid]) if not ON_CUDA else relative_error(a[lid], b[lid]) < 0.01
        stream = backend.capture_stream(batches)
        next(stream)  # the feeder runs ahead: the next batches' passes reach the spool; close() waits for them
        stream.close()
        assert os.listdir(backend.spool) == []
        assert backend.capture([[5, 6, 7]])[0][4].shape == (3, 64)  # the engine still works afterwards


    @vllm_test
    def test_llama_fp8_capture_is_the_stores_quantiser_of_its_states(self, llama):
        """For an fp8 store the worker quantises each pass on its device, and the spool carries values
        and scales: each sample's are the store's quantiser of the states a full-precision capture of
        the same batch gives (bit for bit on the CPU; on CUDA two engines need not pick the same
        kernels, so there within e4m3's rounding)."""
        path, layer_ids, full = llama
        batch = random_batch(384)
        expected = full.capture(batch)
        backend = _engine(path, layer_ids, layers_path="model.layers", max_num_seqs=4, fp8=True)
        try:
            got = backend.capture(batch)
            assert os.listdir(backend.spool) == []
        finally:
            backend.close()
        for sample, reference in zip(got, expected, strict=True):
            for lid in layer_ids:
                rows = sample[lid]
                assert isinstance(rows, Fp8Rows) and rows.shape == reference[lid].shape
                values, scales = quantize_fp8(reference[lid])
                if ON_CUDA:
                    assert relative_error(dequantize_fp8(rows.values, rows.scales), reference[lid]) < 2 ** -4
                else:
                    assert torch.equal(rows.values.view(torch.uint8), values.view(torch.uint8))
                    assert torch.equal(rows.scales, scales)


@vllm_test
def test_idefics3_wrapper_matches_hf(tmp_path_factory, in_process_engine):
    """A multimodal wrapper (vLLM: model.text_model.layers) captured text-only."""
    path = build_idefics3(tmp_path_factory.mktemp("vllm-idefics3") / "target", num_layers=4)
    layer_ids = [0, 1, 2, 4]
    backend = _engine(path, layer_ids)
    try:
        assert backend.info["layers_path"] == "model.text_model.layers"
        batch = random_batch(384)
        assert_parity(backend.capture(batch), path, batch, layer_ids)
    finally:
        backend.close()


def _llava_importable() -> bool:
    """vLLM's llava module imports its Pixtral encoder (mistral_common) and transformers' Pixtral image
    processor (torchvision)."""
    try:
        import mistral_common  # noqa: F401
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - a CUDA-built torchvision beside CPU torch raises RuntimeError
        return False
    return True


@vllm_test
def test_llava_wrapper_matches_hf(tmp_path_factory, in_process_engine):
    """Llava (vLLM: language_model.model.layers); the preflight's HF path is tried first, then found."""
    if not _llava_importable():
        pytest.skip("vLLM's llava module needs mistral_common and a torchvision that loads beside this torch; "
                    "this environment lacks one of them (Idefics3 covers the multimodal wrapper)")
    path = build_llava(tmp_path_factory.mktemp("vllm-llava") / "target", num_layers=4)
    layer_ids = [0, 1, 2, 4]
    backend = _engine(path, layer_ids, layers_path="model.language_model.layers")
    try:
        assert backend.info["layers_path"] == "language_model.model.layers"
        batch = random_batch(384)
        assert_parity(backend.capture(batch), path, batch, layer_ids)
    finally:
        backend.close()


@vllm_test
@pytest.mark.parametrize("builder", [build_qwen3_moe, build_deepseek_v3_for_platform], ids=["qwen3-moe", "deepseek-v3-mla"])
def test_moe_targets_match_hf(builder, tmp_path_factory, in_process_engine):
    path = builder(tmp_path_factory.mktemp("vllm-moe") / "target")
    layer_ids = [1, 2, 4]
    backend = _engine(path, layer_ids)
    try:
        batch = random_batch(384)
        assert_parity(backend.capture(batch), path, batch, layer_ids)
    finally:
        backend.close()


@vllm_test
def test_a_target_vllm_runs_through_its_transformers_backend_matches_hf(tmp_path_factory, in_process_engine):
    """vLLM runs families it has no model file for (OLMo 2, Phi, GPT-NeoX, StarCoder 2, ...) through
    transformers' own modules, whose decoder layers take a batch of one ([1, tokens, hidden])."""
    path = build_olmo2(tmp_path_factory.mktemp("vllm-olmo2") / "target")
    layer_ids = [1, 2, 4]
    batch = random_batch(384)
    # before the engine: vLLM's backend wraps transformers' OLMo 2 classes for its own compilation
    reference = hf_reference(path, batch, layer_ids)
    backend = _engine(path, layer_ids)
    try:
        assert_parity(backend.capture(batch), path, batch, layer_ids, reference=reference)
    finally:
        backend.close()


@vllm_test
def test_multiprocess_engine_bf16(tmp_path):
    """vLLM's default layout (engine core and worker in their own processes) in bf16: states come back
    through the spool folder, and their error against float32 HF is the error bf16 HF itself makes."""
    from draftsmith.extract.vllm_backend import VllmBackend

    path = build_llama(tmp_path / "target", num_layers=4)
    layer_ids = [1, 2, 4]
    env = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        backend = VllmBackend(str(path), layer_ids, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, **ENGINE_ARGS)
        try:
            batch = random_batch(384)
            got = backend.capture(batch)
            spool = backend.spool
            assert os.listdir(spool) == []  # every pass file was mapped and removed
        finally:
            backend.close()
        assert not os.path.exists(spool)
    finally:
        for k, v in env.items():
            if v is not None:
                os.environ[k] = v
            else:
                os.environ.pop(k, None)
    assert_parity(got, path, batch, layer_ids, dtype="bfloat16")


def _cuda_devices() -> int:
    return torch.cuda.device_count() if ON_CUDA else 0


def _build_llama(path):
    return build_llama(path, num_layers=4)


def _build_idefics3(path):
    return build_idefics3(path, num_layers=4, vision_heads=2)


@vllm_test
@pytest.mark.skipif(_cuda_devices() < 2, reason="tensor parallelism 2 needs two CUDA devices")
@pytest.mark.parametrize("builder", [_build_llama, build_deepseek_v3_for_platform, _build_idefics3],
                         ids=["llama", "deepseek-v3-mla", "idefics3"])
def test_tensor_parallel_2_matches_hf(builder, tmp_path):
    """Two ranks, each with half of every attention and MLP (and of the experts' weights): rank 0's
    residual stream, after the all-reduce, is what the capture keeps; it must be HF's."""
    from draftsmith.extract.vllm_backend import VllmBackend

    path = builder(tmp_path / "target")
    layer_ids = [1, 2, 4]
    multiprocessing = os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # TP ranks run in processes
    try:
        backend = VllmBackend(str(path), layer_ids, tensor_parallel_size=2, dtype=CAPTURE_DTYPE,
                              max_model_len=MAX_MODEL_LEN, **ENGINE_ARGS)
        try:
            assert backend.info["rank"] == 0
            batch = random_batch(384)
            got = backend.capture(batch)
        finally:
            backend.close()
    finally:
        if multiprocessing is not None:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing
    assert_parity(got, path, batch, layer_ids)


def test_module_imports_without_vllm():
    code = ("import sys; import draftsmith.extract.vllm_backend, draftsmith.extract.vllm_worker; "
            "assert 'vllm' not in sys.modules, 'vllm was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prompt_runs_are_the_rows_counting_up_from_position_zero():
    from draftsmith.extract.vllm_worker import prompt_runs

    # two whole prompts, a decode row of another request (position 9), a third prompt, padding
    positions = [0, 1, 2, 0, 1, 9, 0, 1, 2, 3, 7]
    tokens = [5, 6, 7, 8, 9, 42, 1, 2, 3, 4, 0]
    assert prompt_runs(positions, tokens) == [(0, 3, (5, 6, 7)), (3, 5, (8, 9)), (6, 10, (1, 2, 3, 4))]
    assert prompt_runs([], []) == []
    assert prompt_runs([3, 4, 5], [1, 2, 3]) == []  # a later chunk of some request: no whole prompt


class _EngineSteps:
    """A VllmBackend whose engine steps are recorded instead of run: ``_run`` notes each batch it
    runs (for 20 ms; raising at ``fail_at``), ``_states`` maps it at once (raising for ``bad_states``),
    ``_abandon`` notes the clean-up and whether the engine was still running a batch then."""

    def __init__(self, fail_at: int | None = None, bad_states: list | None = None):
        from draftsmith.extract.vllm_backend import VllmBackend

        self.started, self.abandoned, self.abandoned_while_running = [], 0, 0
        self.fail_at, self.bad_states, self.running = fail_at, bad_states, False
        self.backend = backend = VllmBackend.__new__(VllmBackend)
        backend.llm = object()
        backend._run = self._run
        backend._states = self._states
        backend._abandon = self._abandon

    def _run(self, batch):
        import time

        if len(self.started) == self.fail_at:
            raise RuntimeError(f"batch {batch} failed")
        self.running = True
        time.sleep(0.02)
        self.started.append(batch)
        self.running = False
        return batch

    def _states(self, ran):
        if ran == self.bad_states:
            raise ValueError(f"the passes of {ran} are damaged")
        return ran

    def _abandon(self):
        self.abandoned += 1
        self.abandoned_while_running += self.running

    def wait_for(self, count: int, seconds: float = 5.0) -> int:
        import time

        deadline = time.monotonic() + seconds
        while len(self.started) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(self.started)


def test_the_stream_runs_the_next_batches_while_the_caller_holds_one():
    """The engine is fed from a thread of its own: while the caller works on a batch's states the
    next batches run, at most RUN_AHEAD computed ones queued beside the one the feeder holds; a
    stream read to its end leaves nothing to clean up, one closed early is joined and cleaned up."""
    from draftsmith.extract.vllm_backend import RUN_AHEAD

    steps = _EngineSteps()
    stream = steps.backend.capture_stream([[n] for n in range(8)])
    assert next(stream) == [0]
    ahead = 1 + RUN_AHEAD + 1  # the one held here, those queued, the one the feeder waits to queue
    assert steps.wait_for(ahead) == ahead  # they ran while this batch was held
    assert steps.wait_for(ahead + 1, seconds=0.3) == ahead  # and no further
    assert next(stream) == [1]
    stream.close()
    assert steps.abandoned == 1 and steps.abandoned_while_running == 0 and len(steps.started) <= ahead + 1
    assert not steps.backend._feeder.running()

    steps = _EngineSteps()
    assert list(steps.backend.capture_stream([[n] for n in range(5)])) == [[n] for n in range(5)]
    assert steps.abandoned == 0
    assert steps.backend.capture([7]) == [7] and steps.abandoned == 0


def test_an_engine_failure_reaches_the_caller_after_the_batches_before_it():
    """A batch the engine fails comes to the caller in its place; a batch whose passes cannot be
    mapped stops the stream while the engine runs the next: either way the feeder ends before the
    spool is cleaned up, once."""
    steps = _EngineSteps(fail_at=2)
    stream = steps.backend.capture_stream([[n] for n in range(5)])
    assert [next(stream), next(stream)] == [[0], [1]]
    with pytest.raises(RuntimeError, match=r"batch \[2\] failed"):
        next(stream)
    assert steps.abandoned == 1 and not steps.backend._feeder.running()

    steps = _EngineSteps(bad_states=[1])
    with pytest.raises(ValueError, match="damaged"):
        list(steps.backend.capture_stream([[n] for n in range(5)]))
    assert steps.abandoned == 1 and steps.abandoned_while_running == 0 and not steps.backend._feeder.running()
    with pytest.raises(ValueError, match="damaged"):
        steps.backend.capture([1])
    assert steps.abandoned == 2


def test_read_pass_waits_for_the_file_and_reports_a_failed_write(tmp_path):
    """A pass file appears (renamed from its partial name) while the driver waits; a failed write
    leaves its reason beside the name instead; a pass that never comes stops the wait."""
    import threading

    from draftsmith.extract.vllm_worker import read_pass

    states = torch.arange(2 * 3 * 4, dtype=torch.bfloat16).view(2, 3, 4)
    info = {"file": str(tmp_path / "pass-0.raw"), "layers": 2, "rows": 3, "hidden": 4, "dtype": "bfloat16"}

    def write_later():
        partial = tmp_path / "pass-0.raw.part"
        partial.write_bytes(states.reshape(-1).view(torch.uint8).numpy().tobytes())
        partial.rename(info["file"])

    timer = threading.Timer(0.2, write_later)
    timer.start()
    assert torch.equal(read_pass(info, timeout=30), states)
    timer.join()
    assert not (tmp_path / "pass-0.raw").exists()  # removed once mapped

    (tmp_path / "pass-1.raw.error").write_text("writing captured states to /dev/shm/x: OSError: No space left")
    with pytest.raises(OSError, match="No space left"):
        read_pass({**info, "file": str(tmp_path / "pass-1.raw")}, timeout=30)
    with pytest.raises(TimeoutError, match="pass-2.raw did not appear"):
        read_pass({**info, "file": str(tmp_path / "pass-2.raw")}, timeout=0.05)


def test_an_fp8_pass_file_holds_the_scales_then_the_values(tmp_path):
    """The layout the worker writes and the driver maps: float32 scales [layers, rows] first, then
    the e4m3 values [layers, rows, hidden]; the driver slices rows of both at once."""
    from draftsmith.extract.vllm_worker import read_pass

    values, scales = quantize_fp8(torch.randn(2, 3, 5))
    path = tmp_path / "pass-0.raw"
    path.write_bytes(scales.numpy().tobytes() + values.view(torch.uint8).numpy().tobytes())
    got = read_pass({"file": str(path), "layers": 2, "rows": 3, "hidden": 5, "dtype": "float8_e4m3fn"}, timeout=5)
    assert torch.equal(got.values.view(torch.uint8), values.view(torch.uint8)) and torch.equal(got.scales, scales)
    sample = got[:, 1:3][1]  # as the backend cuts a prompt's rows, then a layer
    assert torch.equal(sample.values.view(torch.uint8), values[1, 1:3].view(torch.uint8))
    assert torch.equal(sample.scales, scales[1, 1:3])


def test_a_failed_spool_write_is_reported_beside_the_pass_and_the_writer_lives_on(tmp_path):
    """The worker's spool thread, as vLLM runs it: a pass it cannot write leaves its reason beside
    the pass's name (nothing partial), hands its buffer back, and the next pass is still written."""
    import queue
    import threading

    from draftsmith.extract.vllm_worker import CaptureWorkerExtension, _Pass, read_pass

    worker = CaptureWorkerExtension()
    worker._ds_spool, worker._ds_writer_error = str(tmp_path), None
    worker._ds_queue, worker._ds_free = queue.Queue(), queue.Queue()
    threading.Thread(target=worker._ds_write_passes, daemon=True).start()
    states = torch.arange(2 * 3 * 4, dtype=torch.bfloat16).view(2, 3, 4)
    info = {"layers": 2, "rows": 3, "hidden": 4, "dtype": "bfloat16"}
    unwritable = str(tmp_path / "no-such-folder" / "pass-0.raw")
    for path in (unwritable, str(tmp_path / "pass-1.raw")):
        worker._ds_queue.put(_Pass(path, states, None, torch.empty(1)))
    worker._ds_queue.join()  # every pass marked done: a reset or collect cannot hang
    assert worker._ds_free.qsize() == 2
    assert "FileNotFoundError" in worker._ds_writer_error
    assert torch.equal(read_pass({**info, "file": str(tmp_path / "pass-1.raw")}, timeout=5), states)
    (tmp_path / "pass-2.raw.part").mkdir()  # the partial file cannot be opened: the write fails here
    worker._ds_queue.put(_Pass(str(tmp_path / "pass-2.raw"), states, None, torch.empty(1)))
    worker._ds_queue.join()
    with pytest.raises(OSError, match="writing captured states"):
        read_pass({**info, "file": str(tmp_path / "pass-2.raw")}, timeout=5)
    assert not (tmp_path / "pass-2.raw").exists() and not (tmp_path / "pass-2.raw.error.part").exists()


def test_supported_vllm_releases_are_a_stated_range():
    from draftsmith.targets.vllm_compat import (
        NEWEST_VLLM,
        OLDEST_VLLM,
        TESTED_VLLM,
        release_series,
        support_range_problem,
    )

    assert release_series("0.32.0+cpu") == "0.32" and release_series("0.24.0") == "0.24"
    assert (OLDEST_VLLM, NEWEST_VLLM) == ("0.24", "0.33") and {"0.24", "0.32", "0.33"} <= set(TESTED_VLLM)
    for version in ("0.24.0", "0.28.1", "0.32.0+cpu", "0.33.0"):
        assert support_range_problem(version) is None
    for version in ("0.23.9", "0.34.0", "1.0.0", "nightly"):
        problem = support_range_problem(version)
        assert problem is not None and version in problem
    assert "tested" in support_range_problem("0.10.2")


def test_a_cpu_engines_kv_cache_is_sized_to_its_target(tmp_path, monkeypatch):
    """Room for the larger of max_model_len and CPU_KV_TOKENS tokens: each layer's keys and values
    of every KV head, or for MLA one latent and its rotary part; none where that would pass
    CPU_KV_SHARE of the machine's memory (vLLM's own rule applies)."""
    from draftsmith.targets import vllm_compat
    from tiny_vllm import build_deepseek_v3

    llama = build_llama(tmp_path / "llama", num_layers=4)  # 1 KV head of 32
    engine = {"model": str(llama), "dtype": "float32", "max_model_len": 128}
    assert vllm_compat.cpu_kv_cache_bytes(engine) == 4 * (2 * 1 * 32) * 4 * vllm_compat.CPU_KV_TOKENS
    long = {**engine, "dtype": "bfloat16", "max_model_len": 4 * vllm_compat.CPU_KV_TOKENS}
    assert vllm_compat.cpu_kv_cache_bytes(long) == 4 * (2 * 1 * 32) * 2 * 4 * vllm_compat.CPU_KV_TOKENS
    mla = build_deepseek_v3(tmp_path / "mla")
    assert vllm_compat.cpu_kv_cache_bytes({**engine, "model": str(mla)}) == 4 * (512 + 64) * 4 * vllm_compat.CPU_KV_TOKENS
    monkeypatch.setattr("draftsmith.placement.host_memory_bytes", lambda: 2**20)
    assert vllm_compat.cpu_kv_cache_bytes(engine) is None


@vllm_test
@pytest.mark.skipif(ON_CUDA, reason="the CPU build's KV cache")
def test_a_cpu_engine_without_vllm_cpu_kvcache_space_gets_the_sized_cache(tmp_path, in_process_engine, monkeypatch):
    """Without VLLM_CPU_KVCACHE_SPACE the CPU build would take 90% of the machine's memory for its KV
    cache; the capture engine asks for the sized one, and vLLM allocates that."""
    from draftsmith.targets.vllm_compat import cpu_kv_cache_bytes

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    path = build_llama(tmp_path / "target", num_layers=4)
    backend = _engine(path, [1, 4])
    try:
        asked = cpu_kv_cache_bytes({"model": str(path), "dtype": CAPTURE_DTYPE, "max_model_len": MAX_MODEL_LEN})
        assert backend.llm.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == asked
    finally:
        backend.close()
