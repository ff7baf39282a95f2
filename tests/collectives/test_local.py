"""Tests for kdist.collectives.local: device copies and in-process reductions."""

import pytest
import torch

import kdist
from kdist.collectives.local import (
    CrossDeviceOps,
    ReductionToOneDevice,
    copy_to_device,
    divide,
    reduce_tensors,
    weighted_sum,
)
from kdist.errors import InvalidArgumentError
from kdist.types import ReduceOp

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ----- copy_to_device ---------------------------------------------------------------------
def test_copy_to_device_returns_tensors_already_there_unchanged():
    a, b = torch.ones(2), torch.zeros(3, dtype=torch.int64)
    result = copy_to_device([a, b], "cpu")
    assert result[0] is a and result[1] is b


def test_copy_to_device_coalesces_per_dtype_and_keeps_order_and_shapes():
    # The meta device needs no accelerator, yet forces the real copy path.
    tensors = [
        torch.ones(2, 3),
        torch.arange(4),
        torch.zeros(5),
        torch.ones(2, 2).t(),  # non-contiguous
        torch.tensor(7.0),
    ]
    moved = copy_to_device(tensors, "meta")
    assert [t.device.type for t in moved] == ["meta"] * 5
    assert [tuple(t.shape) for t in moved] == [(2, 3), (4,), (5,), (2, 2), ()]
    assert [t.dtype for t in moved] == [t.dtype for t in tensors]


def test_copy_to_device_moves_sparse_gradients_beside_dense_ones():
    # Row gradients of a table are sparse COO: they cannot join a flat buffer.
    rows = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 3), (4, 3))
    moved = copy_to_device([torch.ones(3), rows, torch.zeros(2), rows], "meta")
    assert [t.device.type for t in moved] == ["meta"] * 4
    assert [t.layout for t in moved] == [torch.strided, torch.sparse_coo, torch.strided, torch.sparse_coo]
    assert [tuple(t.shape) for t in moved] == [(3,), (4, 3), (2,), (4, 3)]


def test_weighted_sum_adds_sparse_row_gradients():
    rows = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 3), (4, 3))
    (total,) = weighted_sum([[rows], [rows]], [1.0, 1.0], "cpu")
    assert torch.equal(total.to_dense(), 2 * rows.to_dense())


def test_copy_to_device_accepts_a_tuple_and_returns_a_new_list():
    a = torch.ones(1)
    result = copy_to_device((a,), torch.device("cpu"))
    assert isinstance(result, list) and result == [a]


@gpu
@needs_cuda
def test_copy_to_device_round_trips_values_through_cuda():
    tensors = [torch.arange(6.0).reshape(2, 3), torch.arange(4), torch.tensor([1.5, 2.5])]
    on_gpu = copy_to_device(tensors, "cuda:0")
    assert all(t.device.type == "cuda" for t in on_gpu)
    back = copy_to_device(on_gpu, "cpu")
    for original, returned in zip(tensors, back):
        assert torch.equal(original, returned)


# ----- weighted_sum -----------------------------------------------------------------------
def test_weighted_sum_with_quarter_weights_is_exact():
    first = [torch.tensor([4.0, 8.0]), torch.tensor(2.0)]
    second = [torch.tensor([0.0, 4.0]), torch.tensor(6.0)]
    result = weighted_sum([first, second], [0.25, 0.75], "cpu")
    assert torch.equal(result[0], torch.tensor([1.0, 5.0]))
    assert torch.equal(result[1], torch.tensor(5.0))


def test_weighted_sum_with_unit_weights_leaves_inputs_untouched():
    first = [torch.tensor([1.0, 2.0])]
    second = [torch.tensor([10.0, 20.0])]
    result = weighted_sum([first, second], [1.0, 1.0], "cpu")
    assert torch.equal(result[0], torch.tensor([11.0, 22.0]))
    assert torch.equal(first[0], torch.tensor([1.0, 2.0]))
    assert torch.equal(second[0], torch.tensor([10.0, 20.0]))
    assert result[0] is not first[0]


def test_weighted_sum_is_the_batch_size_weighted_mean():
    # Replicas with 3 and 1 samples: the mean gradient weighs them 3/4 and 1/4.
    grads = [[torch.tensor(2.0)], [torch.tensor(6.0)]]
    (result,) = weighted_sum(grads, [3 / 4, 1 / 4], "cpu")
    assert result.item() == 3.0


def test_weighted_sum_needs_one_weight_per_contributor():
    with pytest.raises(InvalidArgumentError, match="3 weights for 2 contributors"):
        weighted_sum([[torch.ones(1)], [torch.ones(1)]], [0.2, 0.3, 0.5], "cpu")


# ----- reduce_tensors / divide ------------------------------------------------------------
def test_reduce_tensors_sum_and_mean():
    tensors = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([5.0, 1.0])]
    assert torch.equal(reduce_tensors(ReduceOp.SUM, tensors, "cpu"), torch.tensor([9.0, 9.0]))
    assert torch.equal(reduce_tensors("mean", tensors, "cpu"), torch.tensor([3.0, 3.0]))
    # The inputs are not accumulated into.
    assert torch.equal(tensors[0], torch.tensor([1.0, 2.0]))


def test_reduce_tensors_integer_mean_truncates_and_keeps_dtype():
    result = reduce_tensors("mean", [torch.tensor([7, -7]), torch.tensor([8, -8])], "cpu")
    assert result.dtype == torch.int64
    # Truncation toward zero: 15 / 2 -> 7 and -15 / 2 -> -7 (floor would give -8).
    assert result.tolist() == [7, -7]


def test_reduce_tensors_rejects_different_shapes():
    with pytest.raises(InvalidArgumentError, match=r"\[\(4,\), \(2,\)\]"):
        reduce_tensors("sum", [torch.zeros(4), torch.zeros(2)], "cpu")


def test_reduce_tensors_rejects_unknown_op():
    with pytest.raises(InvalidArgumentError, match="reduce_op='max'"):
        reduce_tensors("max", [torch.zeros(2), torch.zeros(2)], "cpu")


def test_divide_keeps_integer_dtype_and_divides_floats_exactly():
    assert divide(torch.tensor(7), 2).item() == 3
    assert divide(torch.tensor(7), 2).dtype == torch.int64
    assert divide(torch.tensor(7.0), 2).item() == 3.5


# ----- CrossDeviceOps ---------------------------------------------------------------------
def test_reduction_to_one_device_returns_one_independent_copy_per_destination():
    ops = ReductionToOneDevice()
    copies = ops.reduce("sum", [torch.tensor([1.0]), torch.tensor([2.0])], ["cpu", "cpu"])
    assert [c.tolist() for c in copies] == [[3.0], [3.0]]
    copies[0].add_(100.0)  # an in-place op on one replica's copy ...
    assert copies[1].tolist() == [3.0]  # ... must not reach the other replica's


def test_broadcast_gives_the_tensor_itself_to_the_first_destination_only():
    tensor = torch.tensor([5.0])
    copies = ReductionToOneDevice().broadcast(tensor, ["cpu", "cpu", "cpu"])
    assert copies[0] is tensor
    assert copies[1] is not tensor and copies[2] is not copies[1]
    assert all(torch.equal(c, tensor) for c in copies)


def test_reduction_to_an_explicit_device():
    ops = ReductionToOneDevice(reduce_to_device="cpu")
    (result,) = ops.reduce("mean", [torch.tensor(2.0), torch.tensor(4.0)], ["cpu"])
    assert result.item() == 3.0


def test_cross_device_ops_is_abstract():
    with pytest.raises(TypeError):
        CrossDeviceOps()


def test_strategy_uses_the_cross_device_ops_it_was_given():
    calls = []

    class Recording(CrossDeviceOps):
        def reduce_to_device(self, reduce_op, tensors, device):
            calls.append((reduce_op, len(tensors)))
            return reduce_tensors(reduce_op, tensors, device)

    strategy = kdist.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=Recording())
    values = kdist.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    assert strategy.reduce("sum", values, axis=None).item() == 3.0
    assert calls == [(ReduceOp.SUM, 2)]
