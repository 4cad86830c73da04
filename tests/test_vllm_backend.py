"""The vLLM capture backend against Hugging Face ``output_hidden_states`` on tiny random-init targets.

Each target gets one vLLM engine (module-scoped), run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: seconds to start instead of half a minute), except one test
that runs the default multiprocess engine in bf16. Batches mix lengths (1..64 tokens) and the
Llama engine's token budget (32) is below the longest prompts, so one forward pass holds rows of
several requests and long prompts are prefilled in chunks: the states must still be each sample's
own, identical whatever else shares the batch.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys

import pytest
import torch

from tiny import build_llama, build_llava
from tiny_vllm import build_deepseek_v3, build_idefics3, build_qwen3_moe

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def vllm_test(fn):
    """Marks a test that starts vLLM (``-m "not vllm"`` deselects them); skipped without vLLM."""
    for mark in (pytest.mark.vllm, pytest.mark.slow,
                 pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")):
        fn = mark(fn)
    return fn


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


def assert_parity(got, ref, layer_ids, tol):
    for n, (sample, expected) in enumerate(zip(got, ref)):
        assert sorted(sample) == sorted(layer_ids)
        for lid in layer_ids:
            assert sample[lid].shape == expected[lid].shape, (n, lid)
            err = relative_error(sample[lid], expected[lid])
            assert err < tol, f"sample {n} layer {lid}: relative error {err:.2e} >= {tol}"




def _engine(path, layer_ids, **kwargs):
    from draftsmith.targets.vllm_backend import VllmBackend

    return VllmBackend(str(path), layer_ids, dtype="float32", max_model_len=MAX_MODEL_LEN, **kwargs)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, in_process_engine):
    path = build_llama(tmp_path_factory.mktemp("vllm-llama") / "target", num_layers=4)
    layer_ids = [0, 1, 2, 4]
    # A 32-token budget: several requests share each forward, prompts of 33 and 64 tokens are chunked.
    backend = _engine(path, layer_ids, layers_path="model.layers", max_num_batched_tokens=32, max_num_seqs=4)
    yield path, layer_ids, backend
    backend.close()


@vllm_test
def test_llama_matches_hf_in_any_batch(llama):
    path, layer_ids, backend = llama
    assert backend.info["layers_path"] == "model.layers"
    batch = random_batch(384)
    got = backend.capture(batch)
    assert_parity(got, hf_hidden_states(path, batch), layer_ids, tol=1e-4)
    # The same samples in another order and beside other samples: bit-identical states.
    others = random_batch(384, lengths=(40, 2, 11), seed=1)
    mixed = backend.capture(others + batch[::-1])[len(others):][::-1]
    for a, b in zip(got, mixed):
        for lid in layer_ids:
            assert torch.equal(a[lid], b[lid])


@vllm_test
def test_llama_rejects_samples_longer_than_the_engine_takes(llama):
    from draftsmith.errors import ExtractionError

    _, _, backend = llama
    with pytest.raises(ExtractionError, match="max_model_len"):
        backend.capture([[5] * MAX_MODEL_LEN])
    assert backend.capture([]) == []
    assert backend.capture([[5, 6, 7]])[0][4].shape == (3, 64)  # the engine still works afterwards


@vllm_test
def test_idefics3_wrapper_matches_hf(tmp_path_factory, in_process_engine):
    """A multimodal wrapper (vLLM: model.text_model.layers) captured text-only."""
    path = build_idefics3(tmp_path_factory.mktemp("vllm-idefics3") / "target", num_layers=4)
    layer_ids = [0, 1, 2, 4]
    backend = _engine(path, layer_ids)
    try:
        assert backend.info["layers_path"] == "model.text_model.layers"
        batch = random_batch(384)
        assert_parity(backend.capture(batch), hf_hidden_states(path, batch), layer_ids, tol=1e-4)
    finally:
        backend.close()


def _torchvision_importable() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - a CUDA-built torchvision beside CPU torch raises RuntimeError
        return False
    return True


@vllm_test
def test_llava_wrapper_matches_hf(tmp_path_factory, in_process_engine):
    """Llava (vLLM: language_model.model.layers); the preflight's HF path is tried first, then found."""
    if not _torchvision_importable():
        pytest.skip("vLLM's llava module imports transformers' Pixtral image processor, which needs "
                    "torchvision; this environment has none that loads beside CPU torch")
    path = build_llava(tmp_path_factory.mktemp("vllm-llava") / "target", num_layers=4)
    layer_ids = [0, 1, 2, 4]
    backend = _engine(path, layer_ids, layers_path="model.language_model.layers")
    try:
        assert backend.info["layers_path"] == "language_model.model.layers"
        batch = random_batch(384)
        assert_parity(backend.capture(batch), hf_hidden_states(path, batch), layer_ids, tol=1e-4)
    finally:
        backend.close()


@vllm_test
@pytest.mark.parametrize("builder", [build_qwen3_moe, build_deepseek_v3], ids=["qwen3-moe", "deepseek-v3-mla"])
def test_moe_targets_match_hf(builder, tmp_path_factory, in_process_engine):
    path = builder(tmp_path_factory.mktemp("vllm-moe") / "target")
    layer_ids = [1, 2, 4]
    backend = _engine(path, layer_ids)
    try:
        batch = random_batch(384)
        assert_parity(backend.capture(batch), hf_hidden_states(path, batch), layer_ids, tol=1e-4)
    finally:
        backend.close()


@vllm_test
def test_multiprocess_engine_bf16(tmp_path):
    """vLLM's default layout (engine core and worker in their own processes) in bf16: states come back
    through collective_rpc, and their error against float32 HF is the error bf16 HF itself makes."""
    from draftsmith.targets.vllm_backend import VllmBackend

    path = build_llama(tmp_path / "target", num_layers=4)
    layer_ids = [1, 2, 4]
    env = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        backend = VllmBackend(str(path), layer_ids, dtype="bfloat16", max_model_len=MAX_MODEL_LEN)
        try:
            batch = random_batch(384)
            got = backend.capture(batch)
        finally:
            backend.close()
    finally:
        for k, v in env.items():
            if v is not None:
                os.environ[k] = v
            else:
                os.environ.pop(k, None)
    ref32 = hf_hidden_states(path, batch)
    ref16 = hf_hidden_states(path, batch, torch.bfloat16)
    for lid in layer_ids:
        hf_err = max(relative_error(r16[lid], r32[lid]) for r16, r32 in zip(ref16, ref32))
        for n, (sample, r32) in enumerate(zip(got, ref32)):
            assert sample[lid].dtype == torch.bfloat16
            err = relative_error(sample[lid], r32[lid])
            assert err < 2 * hf_err + 0.01, f"sample {n} layer {lid}: {err:.2e} vs bf16 HF's own {hf_err:.2e}"


def test_module_imports_without_vllm():
    code = ("import sys; import draftsmith.targets.vllm_backend, draftsmith.targets.vllm_worker; "
            "assert 'vllm' not in sys.modules, 'vllm was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
