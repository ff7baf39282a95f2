"""Tests for kdist.collectives.compression and compressed buckets (no processes)."""

import pytest
import torch

import kdist
from kdist.collectives.buckets import ReductionBuffers
from kdist.collectives.compression import Compression
from kdist.errors import InvalidArgumentError


def test_wire_dtypes_narrow_only_wider_floating_dtypes():
    assert Compression.none.wire_dtype_for(torch.float32) is torch.float32
    assert Compression.bf16.wire_dtype_for(torch.float32) is torch.bfloat16
    assert Compression.bf16.wire_dtype_for(torch.float64) is torch.bfloat16
    assert Compression.fp16.wire_dtype_for(torch.float32) is torch.float16
    # Already narrow, or not floating: unchanged.
    assert Compression.fp16.wire_dtype_for(torch.bfloat16) is torch.bfloat16
    assert Compression.bf16.wire_dtype_for(torch.int64) is torch.int64


def test_public_namespace_and_repr():
    assert kdist.Compression is Compression
    assert repr(Compression.bf16) == "kdist.Compression.bf16"
    assert kdist.CommunicationOptions().compression is Compression.none
    assert kdist.CommunicationOptions(compression=Compression.fp16).compression is Compression.fp16


@pytest.mark.parametrize("bad", ["bf16", None, torch.bfloat16, 16])
def test_anything_but_a_choice_is_refused_naming_the_argument(bad):
    with pytest.raises(InvalidArgumentError, match="Received: compression="):
        kdist.CommunicationOptions(compression=bad)


@pytest.mark.parametrize(
    "field, bad", [("overlap_with_backward", 1), ("overlap_with_backward", "yes"), ("first_bucket_bytes", 100)]
)
def test_overlap_fields_are_validated(field, bad):
    with pytest.raises(InvalidArgumentError, match=field):
        kdist.CommunicationOptions(**{field: bad})


def test_compressed_buffers_hold_the_wire_dtype_and_cast_sums_back():
    like = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.int64), torch.zeros(2, dtype=torch.float64)]
    buffers = ReductionBuffers(like, 2**20, "cpu", compression=Compression.bf16)
    assert buffers.compressed
    assert [flat.dtype for flat in buffers.flats] == [torch.bfloat16, torch.int64]
    # Half the bytes of the float32 buckets: 14 bfloat16 values.
    assert buffers.flats[0].numel() * buffers.flats[0].element_size() == 28
    tensors = [torch.full((3, 4), 1.0 / 3), torch.arange(5), torch.tensor([2.5, -1.0], dtype=torch.float64)]
    buffers.fill_weighted([tensors, tensors], [0.25, 0.75])
    buffers.decompress()
    assert [o.dtype for o in buffers.outputs] == [torch.float32, torch.int64, torch.float64]
    torch.testing.assert_close(buffers.outputs[0], tensors[0], atol=2e-3, rtol=0)
    assert not torch.equal(buffers.outputs[0], tensors[0])  # it went through bfloat16
    assert torch.equal(buffers.outputs[1], tensors[1])
    torch.testing.assert_close(buffers.outputs[2], tensors[2])


def test_uncompressed_buffers_read_their_sums_in_the_views():
    like = [torch.zeros(3)]
    buffers = ReductionBuffers(like, 2**20, "cpu", compression=Compression.none)
    assert not buffers.compressed and buffers.outputs is buffers.views


def test_ordered_buckets_follow_the_order_with_a_small_first_bucket():
    # float32 tensors of 100, 100, 200, 300 and 10 elements (400 .. 1200 bytes).
    like = [torch.zeros(100), torch.zeros(100), torch.zeros(200), torch.zeros(300), torch.zeros(10)]
    order = [4, 3, 2, 1, 0]
    buffers = ReductionBuffers(like, 2000, "cpu", order=order, first_bucket_bytes=1024)
    # First bucket capped at 1024 bytes: [4] (40) + [3] (1200) exceeds it.
    assert buffers.bucket_positions == [[4], [3, 2], [1, 0]]
    assert buffers.bucket_of == [2, 2, 1, 1, 0]


def test_ordered_buckets_cut_where_the_dtype_changes():
    like = [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2)]
    buffers = ReductionBuffers(like, 2**20, "cpu", order=[2, 1, 0])
    assert buffers.bucket_positions == [[2], [1], [0]]
