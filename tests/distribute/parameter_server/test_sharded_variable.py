"""ShardedVariable and RemoteVariable over an in-memory reader."""

import numpy as np
import pytest
import torch

from kdist.distribute.parameter_server.partitioners import FixedShardsPartitioner
from kdist.distribute.parameter_server.placement import RoundRobinPlacer
from kdist.distribute.parameter_server.sharded_variable import (
    RemoteVariable,
    ShardedVariable,
    ShardReadError,
    VariableReader,
)
from kdist.errors import InvalidArgumentError


class InMemoryReader:
    """Holds shard values by name and records every call."""

    def __init__(self):
        self.values = {}
        self.read_calls = []
        self.lookup_calls = []

    def store(self, placement, full_value):
        for shard in placement.shards:
            self.values[shard.name] = np.array(full_value[shard.row_start : shard.row_stop])

    def read(self, shards):
        self.read_calls.append([shard.name for shard in shards])
        return [self.values[shard.name].copy() for shard in shards]

    def lookup(self, requests):
        self.lookup_calls.append([(shard.name, ids.tolist()) for shard, ids in requests])
        return [self.values[shard.name][ids] for shard, ids in requests]


def make_sharded(shape=(13, 4), num_shards=5, num_ps=3, dtype="float32", name="e"):
    placement = RoundRobinPlacer(num_ps).place(name, shape, dtype, FixedShardsPartitioner(num_shards))
    full = np.arange(np.prod(shape), dtype=dtype).reshape(shape)
    reader = InMemoryReader()
    reader.store(placement, full)
    return ShardedVariable(placement, reader), reader, full


def test_fake_reader_satisfies_the_protocol():
    assert isinstance(InMemoryReader(), VariableReader)
    assert not isinstance(object(), VariableReader)


def test_seed_example_two_shards():
    variable, _, _ = make_sharded(shape=(100, 10), num_shards=2, num_ps=2, name="w")
    assert len(variable.variables) == 2
    assert [v.name for v in variable.variables] == ["w/part_0", "w/part_1"]
    assert [v.shape for v in variable.variables] == [(50, 10), (50, 10)]
    assert [v.device for v in variable.variables] == [
        "/job:ps/replica:0/task:0/device:CPU:0",
        "/job:ps/replica:0/task:1/device:CPU:0",
    ]
    assert variable.shape == (100, 10) and variable.dtype == "float32" and variable.name == "w"


def test_shard_views_describe_their_rows():
    variable, reader, full = make_sharded()
    views = variable.variables
    assert [(v.row_start, v.row_stop) for v in views] == [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]
    assert [v.ps_index for v in views] == [0, 1, 2, 0, 1]
    np.testing.assert_array_equal(views[3].numpy(), full[9:11])
    assert reader.read_calls == [["e/part_3"]]
    assert list(iter(variable))[0].name == "e/part_0"


def test_dense_use_concatenates_shards_in_one_read():
    variable, reader, full = make_sharded()
    np.testing.assert_array_equal(variable.numpy(), full)
    assert reader.read_calls == [[f"e/part_{i}" for i in range(5)]]
    np.testing.assert_array_equal(np.asarray(variable), full)
    tensor = variable.to_tensor()
    assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32
    torch.testing.assert_close(tensor, torch.from_numpy(full))
    assert np.asarray(variable, dtype=np.float64).dtype == np.float64


def test_torch_ops_convert_to_the_full_tensor():
    variable, reader, full = make_sharded(shape=(4, 3), num_shards=2)
    x = torch.ones(2, 4)
    torch.testing.assert_close(torch.matmul(x, variable), x @ torch.from_numpy(full))
    assert torch.cat([variable, variable]).shape == (8, 3)
    # The seed's `x * self.w`, both ways round.
    y = torch.full((4, 3), 2.0)
    torch.testing.assert_close(y * variable, 2 * torch.from_numpy(full))
    torch.testing.assert_close(variable * y, 2 * torch.from_numpy(full))
    assert all(len(call) == 2 for call in reader.read_calls)


def test_embedding_lookup_asks_only_for_owned_rows_in_one_call():
    variable, reader, full = make_sharded()
    ids = np.array([[12, 0, 4], [1, 12, 10]])
    rows = variable.embedding_lookup(ids)
    assert rows.shape == (2, 3, 4)
    np.testing.assert_array_equal(rows, full[ids])
    assert reader.read_calls == []
    # One call; shards 2 (rows 6-8) is not asked; repeated id 12 travels once.
    assert reader.lookup_calls == [[("e/part_0", [0, 1]), ("e/part_1", [1]),
                                    ("e/part_3", [1]), ("e/part_4", [1])]]


@pytest.mark.parametrize("ids", [np.array(7), np.array([3]), np.arange(13)[::-1], np.zeros((2, 0, 3), int)])
def test_embedding_lookup_shapes(ids):
    variable, reader, full = make_sharded()
    rows = variable.embedding_lookup(ids)
    assert rows.shape == ids.shape + (4,)
    np.testing.assert_array_equal(rows, full[ids])
    assert len(reader.lookup_calls) == (1 if ids.size else 0)


def test_embedding_lookup_accepts_torch_ids_and_lists():
    variable, _, full = make_sharded()
    np.testing.assert_array_equal(variable.embedding_lookup(torch.tensor([2, 11])), full[[2, 11]])
    np.testing.assert_array_equal(variable.embedding_lookup([[5]]), full[[[5]]])


def test_embedding_lookup_rejects_out_of_range_ids():
    variable, reader, _ = make_sharded()
    with pytest.raises(InvalidArgumentError, match="id=13"):
        variable.embedding_lookup([1, 13])
    assert reader.lookup_calls == []


def test_getitem_reads_only_the_rows_it_needs():
    variable, reader, full = make_sharded()
    np.testing.assert_array_equal(variable[4], full[4])
    np.testing.assert_array_equal(variable[-1, 2], full[-1, 2])
    np.testing.assert_array_equal(variable[2:8:3], full[2:8:3])
    np.testing.assert_array_equal(variable[::-2, 1:], full[::-2, 1:])
    assert reader.read_calls == []
    assert reader.lookup_calls[0] == [("e/part_1", [1])]
    with pytest.raises(IndexError):
        variable[13]
    np.testing.assert_array_equal(variable[..., 0], full[..., 0])  # dense fallback


def test_remote_variable_for_an_unpartitioned_variable():
    placer = RoundRobinPlacer(num_ps=2)
    placer.place("first", (), "float32")
    placement = placer.place("bias", (5, 2), "float32")
    reader = InMemoryReader()
    full = np.arange(10, dtype=np.float32).reshape(5, 2)
    reader.store(placement, full)
    bias = RemoteVariable(placement, reader)
    assert bias.name == "bias" and bias.shape == (5, 2) and bias.dtype == "float32"
    assert bias.device == "/job:ps/replica:0/task:1/device:CPU:0" and bias.ps_index == 1
    np.testing.assert_array_equal(bias.numpy(), full)
    np.testing.assert_array_equal(bias.embedding_lookup([[4, 4, 0]]), full[[[4, 4, 0]]])
    assert reader.lookup_calls == [[("bias", [0, 4])]]
    torch.testing.assert_close(bias.to_tensor() + 1, torch.from_numpy(full) + 1)
    assert "bias" in repr(bias) and "task:1" in repr(bias)


def test_remote_scalar():
    placement = RoundRobinPlacer(num_ps=1).place("step", (), "int64")
    reader = InMemoryReader()
    reader.values["step"] = np.array(7, dtype=np.int64)
    step = RemoteVariable(placement, reader)
    assert step.numpy() == 7 and step.shape == ()
    with pytest.raises(InvalidArgumentError, match="scalar"):
        step.embedding_lookup([0])


def test_repr_lists_shards():
    variable, _, _ = make_sharded(shape=(4, 2), num_shards=2, num_ps=2)
    text = repr(variable)
    assert "ShardedVariable" in text and "e/part_0@ps0[0:2]" in text and "e/part_1@ps1[2:4]" in text


def test_no_len():
    variable, _, _ = make_sharded()
    assert not hasattr(variable, "__len__")


class WrongCountReader(InMemoryReader):
    def read(self, shards):
        return super().read(shards)[:-1]

    def lookup(self, requests):
        return super().lookup(requests)[:-1]


class WrongShapeReader(InMemoryReader):
    def read(self, shards):
        return [value[:1] for value in super().read(shards)]

    def lookup(self, requests):
        return [value[:0] for value in super().lookup(requests)]


@pytest.mark.parametrize("reader_class", [WrongCountReader, WrongShapeReader])
def test_bad_reader_answers_are_typed_errors(reader_class):
    placement = RoundRobinPlacer(2).place("e", (6, 2), "float32", FixedShardsPartitioner(2))
    reader = reader_class()
    reader.store(placement, np.zeros((6, 2), np.float32))
    variable = ShardedVariable(placement, reader)
    with pytest.raises(ShardReadError):
        variable.numpy()
    with pytest.raises(ShardReadError):
        variable.embedding_lookup([0, 5])


def test_constructor_validation():
    placement = RoundRobinPlacer(2).place("e", (6, 2), "float32")
    with pytest.raises(InvalidArgumentError, match="reader"):
        ShardedVariable(placement, reader=object())
    with pytest.raises(InvalidArgumentError, match="placement"):
        ShardedVariable("e", InMemoryReader())
    with pytest.raises(InvalidArgumentError, match="rank"):
        ShardedVariable(RoundRobinPlacer(1).place("s", (), "float32"), InMemoryReader())
    with pytest.raises(InvalidArgumentError, match="shard_index"):
        RemoteVariable(placement, InMemoryReader(), shard_index=1)


def test_bfloat16_empty_lookup_has_the_right_dtype():
    placement = RoundRobinPlacer(1).place("e", (3, 2), torch.bfloat16, FixedShardsPartitioner(3))
    variable = ShardedVariable(placement, InMemoryReader())
    assert variable.embedding_lookup(np.zeros(0, np.int64)).dtype.name == "bfloat16"
