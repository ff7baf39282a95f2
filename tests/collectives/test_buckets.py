"""Tests for kdist.collectives.buckets: layouts, bucket positions and bucket filling (no processes)."""

import torch

from kdist.collectives import process
from kdist.collectives.buckets import ReductionBuffers, _bucket_positions, _layout


def test_layout_is_shapes_and_dtypes_in_order():
    tensors = [torch.zeros(2, 3), torch.zeros(5, dtype=torch.int64), torch.zeros(())]
    assert _layout(tensors) == (((2, 3), torch.float32), ((5,), torch.int64), ((), torch.float32))


def test_bucket_positions_group_per_dtype_in_first_seen_order():
    layout = _layout([torch.zeros(4, dtype=torch.int64), torch.zeros(3), torch.zeros(2, dtype=torch.int64), torch.zeros(1)])
    assert list(_bucket_positions(layout, 2**20)) == [[0, 2], [1, 3]]


def test_bucket_positions_cut_at_the_byte_cap_and_keep_oversized_tensors_whole():
    # float32: 100, 100, 200 and 1000 elements = 400, 400, 800 and 4000 bytes; cap 1024.
    layout = _layout([torch.zeros(100), torch.zeros(100), torch.zeros(200), torch.zeros(1000), torch.zeros(1)])
    assert list(_bucket_positions(layout, 1024)) == [[0, 1], [2], [3], [4]]


def test_bucket_positions_exact_fit_stays_in_one_bucket():
    layout = _layout([torch.zeros(128), torch.zeros(128)])  # 512 + 512 bytes
    assert list(_bucket_positions(layout, 1024)) == [[0, 1]]


def test_bucket_positions_of_an_empty_layout_is_empty():
    assert list(_bucket_positions((), 1024)) == []


def test_reduction_buffers_views_share_the_flat_buckets():
    like = [torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64), torch.zeros(5)]
    buffers = ReductionBuffers(like, 1024, "cpu")
    assert [flat.dtype for flat in buffers.flats] == [torch.float32, torch.float64]
    assert [flat.numel() for flat in buffers.flats] == [11, 4]
    assert [tuple(v.shape) for v in buffers.views] == [(2, 3), (4,), (5,)]
    buffers.views[2].fill_(7.0)
    assert torch.equal(buffers.flats[0][6:], torch.full((5,), 7.0))
    assert buffers.matches([torch.ones(2, 3), torch.ones(4, dtype=torch.float64), torch.ones(5)])
    assert not buffers.matches([torch.ones(3, 2), torch.ones(4, dtype=torch.float64), torch.ones(5)])


def test_fill_copies_tensors_into_their_views():
    tensors = [torch.arange(6.0).reshape(2, 3), torch.arange(3, dtype=torch.int64), torch.tensor([9.0])]
    buffers = ReductionBuffers(tensors, 16, "cpu")
    buffers.fill(tensors)
    for view, tensor in zip(buffers.views, tensors):
        assert torch.equal(view, tensor)
    assert len(buffers.flats) == 3  # 24 bytes exceed the 16-byte cap: the floats split


def test_fill_weighted_matches_the_weighted_sum_on_both_fill_paths():
    small = [torch.randn(3, 4), torch.randn(5)]  # one concatenation and one scaling per bucket
    large = [torch.randn(2**19), torch.randn(2**19)]  # one multiplication per tensor (2 MiB each)
    for tensors in (small, large):
        others = [torch.randn_like(t) for t in tensors]
        buffers = ReductionBuffers(tensors, 2**30, "cpu")
        views = buffers.fill_weighted([tensors, others], [0.25, 0.75])
        for view, a, b in zip(views, tensors, others):
            torch.testing.assert_close(view, 0.25 * a + 0.75 * b)


def test_process_still_exports_the_bucketing_names():
    assert process.ReductionBuffers is ReductionBuffers
    assert process._bucket_positions is _bucket_positions
    assert process._layout is _layout
