"""The HF capture backend: the states it hooks out equal transformers' own hidden states, for plain
and wrapped targets, whatever the padding and batching, and it runs no more of the model than needed."""

import random

import pytest
import torch
from transformers import LlamaForCausalLM, LlavaForConditionalGeneration

from draftsmith.errors import ExtractionError
from draftsmith.extract.hf_backend import HfBackend
from draftsmith.extract.hidden_states import Fp8Rows, quantize_fp8
from draftsmith.targets.inspect import inspect_target

# Float32 on CPU; padded rows attend over more (masked) keys, so their sums run in another order.
NOISE = dict(rtol=1e-5, atol=1e-4)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def llama_info(llama_dir):
    return inspect_target(llama_dir)


def _load(path, info, layer_ids=None):
    return HfBackend.load(path, layers_path=info["layers_path"], final_layer_id=info["final_layer_id"],
                          capture_layer_ids=layer_ids or info["captured_layer_ids"],
                          lm_head_path=info["lm_head_path"], device="cpu")


@pytest.fixture(scope="module")
def backend(llama_dir, llama_info):
    with _load(llama_dir, llama_info) as b:
        yield b


def _sequences(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 384) for _ in range(n)] for n in lengths]


def _pad(batch):
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(batch):
        ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
    return ids, mask


def test_states_equal_output_hidden_states_of_a_plain_forward(backend, llama_info):
    batch = _sequences([23, 7, 40, 1, 16])
    captured = backend.capture(batch)
    ids, mask = _pad(batch)
    with torch.inference_mode():
        reference = backend.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert llama_info["captured_layer_ids"] == [2, 4, 5, 8]
    for row, (seq, states) in enumerate(zip(batch, captured)):
        assert sorted(states) == [2, 4, 5, 8]
        for layer_id, tensor in states.items():
            assert tensor.device.type == "cpu" and tensor.dtype == torch.float32
            assert tensor.shape == (len(seq), 64)  # unpadded
            # Same batch, same computation: bit for bit (id 8 = post-norm state the lm_head consumes).
            assert torch.equal(tensor, reference[layer_id][row, :len(seq)]), (row, layer_id)


def test_padding_and_batching_change_nothing(backend):
    batch = _sequences([31, 5, 18, 31, 2, 12], seed=1)
    together = backend.capture(batch)
    for seq, states in zip(batch, together):
        alone = backend.capture([seq])[0]
        ids = torch.tensor([seq])
        with torch.inference_mode():
            plain = backend.model(input_ids=ids, output_hidden_states=True).hidden_states
        for layer_id in states:
            torch.testing.assert_close(states[layer_id], alone[layer_id], **NOISE)
            assert torch.equal(alone[layer_id], plain[layer_id][0])  # a batch of one has no padding
    # Rows that need no padding are exact in any batch.
    assert all(torch.equal(together[0][i], backend.capture([batch[0]])[0][i]) for i in together[0])


def test_capture_stream_matches_capture(backend):
    batches = [_sequences([9, 4], seed=s) for s in range(3)]
    streamed = list(backend.capture_stream(batches))
    for batch, result in zip(batches, streamed):
        for got, want in zip(result, backend.capture(batch)):
            assert all(torch.equal(got[i], want[i]) for i in want)


def _count_runs(model, names):
    """How often each module's forward ran to its end."""
    calls = {name: 0 for name in names}
    handles = []
    for name in names:
        def hook(module, args, output, name=name):
            calls[name] += 1
        handles.append(model.get_submodule(name).register_forward_hook(hook))
    return calls, handles


def test_lm_head_never_runs_and_hidden_states_are_not_requested(backend, monkeypatch):
    names = ["lm_head", "model.norm", "model.layers.7"]
    calls, handles = _count_runs(backend.model, names)
    seen_kwargs = []
    forward = backend.model.forward

    def spy(*args, **kwargs):
        seen_kwargs.append(kwargs)
        return forward(*args, **kwargs)

    monkeypatch.setattr(backend.model, "forward", spy)
    try:
        backend.capture(_sequences([6, 3]))
    finally:
        for h in handles:
            h.remove()
    assert calls == {"lm_head": 0, "model.norm": 1, "model.layers.7": 1}
    assert not any(k.get("output_hidden_states") for k in seen_kwargs)


def test_forward_stops_after_the_last_needed_layer(llama_dir, llama_info):
    with _load(llama_dir, llama_info, layer_ids=[0, 3]) as aux_only:
        names = ["model.layers.2", "model.layers.3", "model.layers.4", "model.norm", "lm_head"]
        calls, handles = _count_runs(aux_only.model, names)
        states = aux_only.capture(_sequences([5, 9]))
        for h in handles:
            h.remove()
        # Id 3 is layer 3's input, taken before layer 3 runs, so the forward ends right there.
        assert calls == {"model.layers.2": 1, "model.layers.3": 0, "model.layers.4": 0, "model.norm": 0,
                         "lm_head": 0}
        assert sorted(states[0]) == [0, 3]


def test_wrapped_multimodal_target_gives_its_inner_llamas_states(llava_dir):
    info = inspect_target(llava_dir)
    assert info["layers_path"] == "model.language_model.layers"
    with _load(llava_dir, info) as wrapped:
        # The same text weights as a plain Llama: the wrapper's language model and head.
        llava = wrapped.model
        assert isinstance(llava, LlavaForConditionalGeneration)
        llama = LlamaForCausalLM(llava.config.text_config).eval()
        llama.model.load_state_dict(llava.model.language_model.state_dict())
        llama.lm_head.load_state_dict(llava.lm_head.state_dict())
        plain = HfBackend(llama, layers_path="model.layers", capture_layer_ids=info["captured_layer_ids"],
                          final_layer_id=info["final_layer_id"], lm_head_path="lm_head")
        batch = _sequences([14, 3, 27], seed=2)
        for got, want in zip(wrapped.capture(batch), plain.capture(batch)):
            assert sorted(got) == sorted(want) == [2, 4, 5, 8]
            assert all(torch.equal(got[i], want[i]) for i in want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_fp8_rows_are_quantised_where_the_target_runs_as_the_store_quantises(llama_dir, llama_info, device):
    """With fp8 the backend quantises on the target's device and hands over host rows of e4m3 values
    and scales (on CUDA copied to pinned memory beside the next batch): bit for bit the store's
    quantiser, on the CPU, of the states the same backend captures in full precision."""
    model = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16).to(device)
    batches = [_sequences([23, 7, 40, 1], seed=s) for s in range(3)]

    def capture(fp8):
        with HfBackend(model, layers_path="model.layers", capture_layer_ids=llama_info["captured_layer_ids"],
                       final_layer_id=8, lm_head_path="lm_head", fp8=fp8) as backend:
            return list(backend.capture_stream(batches))

    full, quantized = capture(False), capture(True)
    for batch, full_batch, fp8_batch in zip(batches, full, quantized, strict=True):
        for seq, want, got in zip(batch, full_batch, fp8_batch, strict=True):
            assert sorted(got) == sorted(want) == [2, 4, 5, 8]
            for layer_id, states in want.items():
                rows = got[layer_id]
                assert isinstance(rows, Fp8Rows) and rows.shape == (len(seq), 64)
                assert rows.values.device.type == rows.scales.device.type == "cpu"
                values, scales = quantize_fp8(states.cpu())
                assert torch.equal(rows.values.view(torch.uint8), values.view(torch.uint8)), (seq, layer_id)
                assert torch.equal(rows.scales.view(torch.int32), scales.view(torch.int32)), (seq, layer_id)


def test_fp8_quantising_out_of_memory_names_the_batch_setting(backend, monkeypatch):
    """Quantising takes a float32 copy of a layer's whole padded batch: where that does not fit, the
    answer is the forward pass's (what, the batch, lower extraction.batch_tokens), not a raw traceback."""
    import draftsmith.extract.hf_backend as hf_backend

    def no_room(states):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")

    monkeypatch.setattr(hf_backend, "quantize_fp8", no_room)
    monkeypatch.setattr(backend, "fp8", True)
    with pytest.raises(ExtractionError, match="quantising the batch's states to fp8 ran out of memory") as error:
        backend.capture(_sequences([5, 9]))
    assert "2 sequences" in error.value.where and "extraction.batch_tokens" in error.value.fix


def test_model_dtype_is_honoured(llama_dir, llama_info):
    backend = HfBackend.load(llama_dir, layers_path="model.layers", final_layer_id=8, capture_layer_ids=[2, 8],
                             lm_head_path="lm_head", dtype="bfloat16", device="cpu")
    states = backend.capture(_sequences([4]))[0]
    assert {t.dtype for t in states.values()} == {torch.bfloat16}


def test_a_wrong_layer_path_is_an_actionable_error(llama_dir, llama_info):
    model = LlamaForCausalLM.from_pretrained(llama_dir)
    with pytest.raises(ExtractionError, match="no module 'model.decoder.layers'"):
        HfBackend(model, layers_path="model.decoder.layers", capture_layer_ids=[2, 8], final_layer_id=8)
    with pytest.raises(ExtractionError, match="target.json says 12"):
        HfBackend(model, layers_path="model.layers", capture_layer_ids=[2, 12], final_layer_id=12)
