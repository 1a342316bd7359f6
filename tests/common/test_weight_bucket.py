"""common.weight_bucket: SGLang's flattened-bucket layout (byte-exact round trips, alignment, the bucket
size bound), its dtype names and receive-buffer checks, the finiteness check, and a one-member group."""

from __future__ import annotations

import pytest
import torch

from common.weight_bucket import (
    BucketMeta,
    all_finite,
    dtype_name,
    empty_bucket,
    flatten,
    master_store,
    nbytes,
    new_group,
    parse_dtype,
    plan_buckets,
    unflatten,
)

MIXED = [("embed", torch.bfloat16, (7, 3)), ("norm", torch.float32, (5,)), ("scale", torch.float16, ()),
         ("head", torch.float64, (2, 2)), ("empty", torch.float32, (0, 4)), ("bias", torch.bfloat16, (3,))]


def _tensors(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {name: torch.randn(shape, generator=gen, dtype=torch.float64).to(dt) for name, dt, shape in entries}
    out["embed"][0, 0] = float("nan")  # NaN bits must survive too: compared as bytes, not values
    out["norm"][1] = float("-inf")
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_flatten_unflatten_round_trip_is_byte_exact_with_mixed_dtypes() -> None:
    tensors = _tensors(MIXED)
    buckets = plan_buckets(MIXED, bucket_bytes=1 << 20)
    seen = []
    for meta in buckets:
        buf = flatten([tensors[n] for n in meta.names])
        assert buf.dtype == torch.uint8 and buf.numel() == meta.nbytes
        recv = empty_bucket(meta.dtypes, meta.shapes)
        assert recv.numel() == buf.numel()
        recv.copy_(buf)  # what the broadcast does
        for name, got in unflatten(recv, meta.names, meta.dtypes, meta.shapes):
            want = tensors[name]
            assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), name
            assert _bytes(got) == _bytes(want), name
            seen.append(name)
    assert seen == [n for n, _, _ in MIXED]  # every tensor once, in order


def test_flatten_concatenates_bytes_in_order() -> None:
    a = torch.tensor([1.0, 2.0], dtype=torch.float32)
    b = torch.tensor([3.0], dtype=torch.bfloat16)
    buf = flatten([a, b])
    assert _bytes(buf) == _bytes(a) + _bytes(b)
    assert flatten([a.reshape(2, 1).t()]).numel() == 8  # a non-contiguous view flattens to its own bytes


def test_flatten_into_a_given_buffer() -> None:
    a = torch.tensor([1.0, 2.0], dtype=torch.float32)
    b = torch.tensor([3.0], dtype=torch.bfloat16)
    out = torch.full((10,), 7, dtype=torch.uint8)
    assert flatten([a, b], out=out) is out and _bytes(out) == _bytes(a) + _bytes(b)
    with pytest.raises(ValueError, match="out holds"):
        flatten([a, b], out=torch.empty(11, dtype=torch.uint8))


def test_plan_buckets_bounds_each_bucket_and_keeps_order() -> None:
    entries = [(f"w{i}", torch.float32, (10,)) for i in range(7)]  # 40 bytes each
    buckets = plan_buckets(entries, bucket_bytes=100)
    assert [b.names for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4", "w5"], ["w6"]]
    assert all(b.nbytes <= 100 for b in buckets)
    assert [b.nbytes for b in buckets] == [80, 80, 80, 40]


def test_a_tensor_larger_than_the_bound_is_a_bucket_of_its_own() -> None:
    entries = [("small", torch.float32, (2,)), ("big", torch.float32, (100,)), ("tail", torch.float32, (1,))]
    buckets = plan_buckets(entries, bucket_bytes=64)
    assert [b.names for b in buckets] == [["small"], ["big"], ["tail"]]
    assert buckets[1].nbytes == 400


def test_plan_buckets_never_misaligns_a_tensor() -> None:
    # 3 bf16 values end at byte 6: a float32 there would be misaligned, so it opens a new bucket.
    entries = [("odd", torch.bfloat16, (3,)), ("f32", torch.float32, (2,)), ("bf", torch.bfloat16, (1,))]
    buckets = plan_buckets(entries, bucket_bytes=1 << 20)
    assert [b.names for b in buckets] == [["odd"], ["f32", "bf"]]
    for meta in buckets:
        empty_bucket(meta.dtypes, meta.shapes)  # SGLang's receiver accepts each


def test_bucket_meta_body_is_sglangs_names_dtypes_shapes() -> None:
    meta = BucketMeta()
    meta.add("x", torch.bfloat16, torch.Size([2, 3]))
    assert meta.body() == {"names": ["x"], "dtypes": ["bfloat16"], "shapes": [[2, 3]]}
    assert meta.nbytes == 12 == nbytes(torch.bfloat16, (2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dtype_names_round_trip(dtype: torch.dtype) -> None:
    assert parse_dtype(dtype_name(dtype)) is dtype
    assert getattr(torch, dtype_name(dtype)) is dtype  # how SGLang resolves it


@pytest.mark.parametrize("name", ["int64", "bool", "uint8", "Tensor", "float32 ", "torch.float32", "", "no_such"])
def test_parse_dtype_refuses_what_is_not_a_float_dtype(name: str) -> None:
    with pytest.raises(ValueError, match="not a floating-point torch dtype"):
        parse_dtype(name)


@pytest.mark.parametrize("dtypes, shapes, match", [
    (["bfloat16", "float32"], [[1], [1]], "unaligned tensor: byte offset 2"),
    (["float32"], [[-1, 4]], "negative dimension"),
    (["float32"], [[0]], "empty tensor bucket"),
    (["int32"], [[4]], "not a floating-point"),
])
def test_empty_bucket_refuses_what_sglang_refuses(dtypes: list[str], shapes: list[list[int]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        empty_bucket(dtypes, shapes)


def test_unflatten_refuses_a_bucket_of_the_wrong_size() -> None:
    buf = torch.zeros(12, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bucket holds 12 bytes, its tensors 8"):
        unflatten(buf, ["a"], ["float32"], [[2]])
    with pytest.raises(ValueError):  # names and shapes must pair up
        unflatten(buf, ["a", "b"], ["float32"], [[3]])


def test_all_finite() -> None:
    assert all_finite(torch.ones(10, dtype=torch.bfloat16))
    assert not all_finite(torch.tensor([1.0, float("nan")]))
    assert not all_finite(torch.tensor([float("inf"), 1.0], dtype=torch.float16))
    # Finite values whose sum overflows float32: checked element by element, still finite.
    assert all_finite(torch.tensor([3e38, 3e38], dtype=torch.float32))
    assert not all_finite(torch.tensor([3e38, 3e38, float("-inf")], dtype=torch.float32))
    assert all_finite(torch.tensor([1, 2], dtype=torch.int64))  # not floating point: nothing to check
    assert all_finite(torch.empty(0))


def test_a_one_member_group_broadcasts_over_a_real_store() -> None:
    store = master_store("127.0.0.1", 0, 1, timeout_s=30)
    assert store.port > 0
    group = new_group("gloo", "127.0.0.1", store.port, 0, 1, group_name="weight_bucket_test", timeout_s=30, store=store)
    try:
        buf = flatten([torch.arange(4, dtype=torch.float32)])
        group.broadcast(buf)  # rank 0 is the source: its buffer stays as it was
        assert unflatten(buf, ["x"], ["float32"], [[4]])[0][1].tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        group.close()
    assert group.pg is None and group.store is None
    with pytest.raises(ValueError, match="gloo | nccl"):
        new_group("mpi", "127.0.0.1", store.port, 0, 1)
