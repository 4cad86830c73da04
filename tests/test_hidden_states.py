"""The shard store: what goes in comes back, fp8 within its tolerance, nothing half-written visible."""

import torch

from draftsmith.hidden_states import (
    HiddenStateIndex, PartStore, bytes_per_token, dequantize_fp8, merge_parts, quantize_fp8, read_shard,
)


def _store(root, dtype, states, ids):
    store = PartStore(root, 0, fingerprint="f", dtype=dtype, hidden_size=states[1].shape[1], layer_ids=list(states))
    info = store.write_shard(0, [f"s{i}" for i in range(len(ids))], ids, [[1] * len(x) for x in ids], states)
    store.finish([info], root / "part-0.json")
    return merge_parts([root / "part-0.json"], root / "index.json")


def test_round_trip_and_offsets(tmp_path):
    ids = [[5, 6, 7], [8, 9]]
    states = {1: torch.randn(5, 16), 4: torch.randn(5, 16)}
    index = _store(tmp_path, "float32", states, ids)
    data = read_shard(HiddenStateIndex.load(tmp_path / "index.json"), index.shards[0])
    assert data.offsets.tolist() == [0, 3, 5] and data.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert torch.equal(data.states[1], states[1]) and torch.equal(data.states[4], states[4])
    assert index.aux_layer_ids == [1] and index.final_layer_id == 4
    assert not list(tmp_path.glob("part-0/.shard-*"))  # no temporary folder left behind


def test_fp8_states_come_back_within_e4m3_tolerance(tmp_path):
    # Per-token scales: rows of very different magnitude (as hidden states have) keep their precision.
    ref = torch.randn(64, 32) * torch.logspace(-2, 3, 64)[:, None]
    index = _store(tmp_path, "fp8", {1: ref, 2: ref.clone()}, [list(range(64))])
    back = read_shard(index, index.shards[0]).states[1].float()
    amax = ref.abs().amax(dim=1, keepdim=True)
    # e4m3: 3 mantissa bits (relative error <= 2^-4 after rounding); values far below the row's max
    # land in the subnormal range, whose spacing is amax / 448 * 2^-9.
    assert ((back - ref).abs() <= ref.abs() / 16 + amax / 448 * 2 ** -9 + 1e-12).all()
    assert ((back - ref).norm(dim=1) / ref.norm(dim=1)).max() < 0.05


def test_fp8_halves_the_bytes_of_bf16():
    assert bytes_per_token(7168, 4, "fp8") < 0.51 * bytes_per_token(7168, 4, "bfloat16")


def test_quantize_handles_an_all_zero_row():
    values, scales = quantize_fp8(torch.zeros(2, 8))
    assert torch.equal(dequantize_fp8(values, scales).float(), torch.zeros(2, 8))
