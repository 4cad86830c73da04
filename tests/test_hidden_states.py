"""The shard store: what goes in comes back, fp8 within its tolerance, nothing half-written visible."""

import pytest
import torch

from draftsmith.errors import ExtractionError
from draftsmith.extract.hidden_states import (
    FP8_MAX,
    Fp8Rows,
    HiddenStateIndex,
    bytes_per_token,
    dequantize_fp8,
    merge_parts,
    quantize_fp8,
    read_shard,
)
from draftsmith.extract.shard_writer import PartStore


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


def _awkward_bf16_rows() -> torch.Tensor:
    """bf16 states a quantiser could get wrong: ordinary rows beside outliers, all-zero and tiny rows
    (the scale's floor), subnormal values, magnitudes near bf16's limits."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(1024, 256, generator=g)
    rows[1, 7] = 3e4  # one outlier token in an ordinary row
    rows[2] = 0.0  # all zero: the floor scale
    rows[3] = -0.0
    rows[4] *= 1e-13  # below the floor: scaled by it, not by the row's own largest value
    rows[5] *= 1e-39  # bf16 subnormals
    rows[6] = torch.logspace(-38, 4, 256) * torch.randn(256, generator=g).sign()  # every magnitude in one row
    rows[7] = (torch.rand(256, generator=g) * 2 - 1) * 3e38  # near bf16's largest
    rows[8] = 0.0
    rows[8, 100] = -2.5  # a single value: it maps to -FP8_MAX
    rows[9] = 2.0 ** torch.arange(-128, 128, dtype=torch.float32)  # every power of two, subnormal to largest
    rows[10:] *= torch.exp(torch.empty(1014, 1).uniform_(-60, 60, generator=g))  # per-token magnitudes
    return rows.bfloat16()


def _store_definition_of_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The store's fp8 as its definition writes it out (per-token scale, then e4m3), on the CPU."""
    scales = states.abs().amax(-1).float().clamp(min=1e-12) / FP8_MAX
    return (states.float() * scales.reciprocal()[:, None]).to(torch.float8_e4m3fn), scales


def _bits(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return values.cpu().view(torch.uint8), scales.cpu().view(torch.int32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_the_quantiser_makes_the_same_bytes_on_every_device(device):
    """A capture quantises on the target's device; the store must hold what the CPU makes of the
    same states, bit for bit: values and scales, rows of any kind, a batch of any shape."""
    states = _awkward_bf16_rows()
    values, scales = _store_definition_of_fp8(states)
    assert (scales[[2, 3]] == quantize_fp8(torch.zeros(1, 1))[1]).all() and values[8, 100].float() == -FP8_MAX
    expected = _bits(values, scales)
    for shape in ((1024, 256), (8, 128, 256)):  # rows, and a padded batch [batch, length, hidden]
        got = _bits(*quantize_fp8(states.to(device).view(shape)))
        assert torch.equal(got[0].view(1024, 256), expected[0]) and torch.equal(got[1].view(1024), expected[1])


@pytest.mark.parametrize("dtype, captured", [("bfloat16", "states"), ("fp8", "states"), ("fp8", "fp8 rows")])
def test_a_shard_appended_batch_by_batch_equals_one_written_whole(tmp_path, dtype, captured):
    """Batches appended one by one give the bytes of the shard written whole; for fp8, rows the
    capture already quantised (``Fp8Rows``) give the bytes the writer's own quantising gives, even
    when their memory is reused once appended (a vLLM pass file's mapping is let go then)."""
    ids = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    states = {1: torch.randn(9, 16) * 50, 7: torch.randn(9, 16)}
    whole = _store(tmp_path / "whole", dtype, states, ids)
    store = PartStore(tmp_path / "parts", 0, fingerprint="f", dtype=dtype, hidden_size=16, layer_ids=[1, 7])
    writer = store.open_shard(0, 9)
    for rows in (slice(0, 3), slice(3, 5), slice(5, 9)):  # as a part's batches come back
        batch = {i: t[rows] for i, t in states.items()}
        if captured == "states":
            writer.append(batch)
            continue
        fp8 = {i: Fp8Rows(*quantize_fp8(t)) for i, t in batch.items()}
        writer.append(fp8)
        for appended in fp8.values():
            appended.scales.fill_(-1.0)
            appended.values.zero_()
    info = writer.commit(["s0", "s1", "s2"], ids, [[1] * len(x) for x in ids])
    assert info.checksums == whole.shards[0].checksums
    for name in info.checksums:
        assert (store.dir / "shard-00000" / name).read_bytes() == \
            (tmp_path / "whole" / "part-0" / "shard-00000" / name).read_bytes()


def test_a_full_precision_store_refuses_fp8_rows(tmp_path):
    store = PartStore(tmp_path, 0, fingerprint="f", dtype="bfloat16", hidden_size=8, layer_ids=[1])
    with pytest.raises(ExtractionError, match="fp8 rows for a bfloat16 store"):
        store.open_shard(0, 3).append({1: Fp8Rows(*quantize_fp8(torch.randn(3, 8)))})
    assert not list(tmp_path.glob("part-0/.shard-*"))


def test_an_unfinished_shard_is_refused_and_leaves_nothing(tmp_path):
    store = PartStore(tmp_path, 0, fingerprint="f", dtype="bfloat16", hidden_size=8, layer_ids=[1, 3])
    writer = store.open_shard(0, 5)
    writer.append({1: torch.randn(3, 8), 3: torch.randn(3, 8)})
    with pytest.raises(ExtractionError, match="3 rows of states for 5 tokens"):
        writer.commit(["a", "b"], [[1, 2, 3], [4, 5]], [[1, 1, 1], [1, 1]])
    with pytest.raises(ExtractionError, match="do not fit the shard"):
        store.open_shard(1, 2).append({1: torch.randn(3, 8), 3: torch.randn(3, 8)})
    with pytest.raises(ExtractionError, match=r"rows per layer \{1: 2, 3: 1\}"):
        store.open_shard(2, 4).append({1: torch.randn(2, 8), 3: torch.randn(1, 8)})
    assert not list(tmp_path.glob("part-0/shard-*")) and not list(tmp_path.glob("part-0/.shard-*"))


def test_parts_whose_target_ran_in_different_dtypes_are_not_merged(tmp_path):
    """target.dtype auto resolves per node: parts captured in bfloat16 on one kind of CPU and in
    float32 on another would make one store of both; the merge refuses and says how to make them agree."""
    states = {1: torch.randn(3, 8), 2: torch.randn(3, 8)}
    for part, model_dtype in enumerate(["bfloat16", "float32"]):
        store = PartStore(tmp_path, part, fingerprint="f", dtype="float32", hidden_size=8, layer_ids=[1, 2],
                          model_dtype=model_dtype)
        info = store.write_shard(0, [f"p{part}"], [[5, 6, 7]], [[1, 1, 1]], states)
        store.finish([info], tmp_path / f"part-{part}.json")
    manifests = [tmp_path / "part-0.json", tmp_path / "part-1.json"]
    with pytest.raises(ExtractionError, match="part 0's states were computed in bfloat16, part 1's in float32") as e:
        merge_parts(manifests, tmp_path / "index.json")
    assert "target.dtype" in e.value.fix and not (tmp_path / "index.json").exists()
    merge_parts(manifests[:1], tmp_path / "index.json")
    assert (tmp_path / "index.json").is_file()
    # a part written before the dtype was recorded merges with either
    store = PartStore(tmp_path, 2, fingerprint="f", dtype="float32", hidden_size=8, layer_ids=[1, 2])
    store.finish([store.write_shard(0, ["p2"], [[5, 6, 7]], [[1, 1, 1]], states)], tmp_path / "part-2.json")
    assert merge_parts([manifests[1], tmp_path / "part-2.json"], tmp_path / "index.json").num_samples == 2
