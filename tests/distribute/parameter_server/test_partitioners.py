"""Partitioners: TensorFlow's formulas, checked on hand-computed cases."""

import math

import numpy as np
import pytest
import torch

from kdist.distribute.parameter_server.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    canonical_dtype_name,
    canonical_shape,
    dtype_num_bytes,
)
from kdist.errors import InvalidArgumentError


def test_fixed_shards_partitioner_splits_the_first_axis_only():
    assert FixedShardsPartitioner(2)((100, 10), "float32") == [2, 1]
    assert FixedShardsPartitioner(5)((13,), "float32") == [5]
    assert FixedShardsPartitioner(3)((7, 2, 2), "int8") == [3, 1, 1]


def test_fixed_shards_partitioner_never_exceeds_the_rows():
    assert FixedShardsPartitioner(8)((3, 4), "float32") == [3, 1]


def test_scalars_are_not_partitioned():
    for partitioner in (FixedShardsPartitioner(4), MinSizePartitioner(4, 4), MaxSizePartitioner(4)):
        assert partitioner((), "float32") == []


def test_partitioners_are_partitioner_instances():
    for partitioner in (FixedShardsPartitioner(4), MinSizePartitioner(), MaxSizePartitioner(4)):
        assert isinstance(partitioner, Partitioner)
    with pytest.raises(TypeError):  # abstract: a subclass says how many shards
        Partitioner()


@pytest.mark.parametrize(
    "min_shard_bytes, max_shards, shape, dtype, expected",
    [
        (4, 2, (6, 1), "float32", [2, 1]),  # TF's docstring
        (4, 10, (6, 1), "float32", [6, 1]),  # TF's docstring
        (256 << 10, 100, (1024, 1024), "float32", [16, 1]),  # 4 MiB / 256 KiB
        (256 << 10, 8, (1024, 1024), "float32", [8, 1]),  # capped by max_shards
        (256 << 10, 1, (1024, 1024), "float32", [1, 1]),  # the default max_shards
        (100, 10, (10, 3), "float32", [2, 1]),  # 120 bytes / 100 -> ceil 1.2 = 2
        (100, 10, (10, 3), "float64", [3, 1]),  # 240 / 100 -> ceil 2.4 = 3
        (1000, 10, (10, 3), "float32", [1, 1]),  # smaller than one shard
        (1, 50, (5, 2), "int64", [5, 1]),  # capped by the rows
        (16, 10, (8,), "string", [8]),  # 8 strings x 16 bytes = 128 / 16
        (1, 10, (0, 4), "float32", [1, 1]),  # no bytes: one partition
    ],
)
def test_min_size_partitioner_matches_tf_formula(min_shard_bytes, max_shards, shape, dtype, expected):
    partitioner = MinSizePartitioner(min_shard_bytes=min_shard_bytes, max_shards=max_shards)
    assert partitioner(shape, dtype) == expected
    # TensorFlow's formula, written out independently.
    total_bytes = math.prod(shape) * dtype_num_bytes(dtype)
    tf_value = max(1, min(shape[0], max_shards, int(math.ceil(total_bytes / min_shard_bytes))))
    assert expected[0] == tf_value


def test_min_size_partitioner_bytes_per_string():
    partitioner = MinSizePartitioner(min_shard_bytes=64, max_shards=100, bytes_per_string=32)
    assert partitioner((10,), "string") == [5]  # 320 / 64


@pytest.mark.parametrize(
    "max_shard_bytes, max_shards, shape, dtype, expected",
    [
        (4, None, (6, 1), "float32", [6, 1]),  # TF's docstring
        (4, 2, (6, 1), "float32", [2, 1]),  # TF's docstring
        (1024, None, (6, 1), "float32", [1, 1]),  # TF's docstring
        (100, None, (10, 3), "float32", [2, 1]),  # 12 B/row -> 8 rows/shard -> ceil(10/8)
        (24, None, (10, 3), "float32", [5, 1]),  # 2 rows/shard
        (23, None, (10, 3), "float32", [10, 1]),  # 1 row/shard
        (5, None, (10, 3), "float32", [10, 1]),  # a row is bigger than a shard: 1 row each
        (5, 4, (10, 3), "float32", [4, 1]),  # max_shards takes precedence
        ((64 << 20) - 1, None, (1 << 20, 64), "float32", [5, 1]),  # 256 MiB in < 64 MiB shards
        (100, None, (13, 2), "string", [5, 1]),  # 32 B/row -> 3 rows/shard -> ceil(13/3)
        (100, None, (0, 4), "float32", [1, 1]),  # no rows
        (100, None, (4, 0), "float32", [1, 1]),  # no bytes per row
    ],
)
def test_max_size_partitioner_matches_tf_formula(max_shard_bytes, max_shards, shape, dtype, expected):
    partitioner = MaxSizePartitioner(max_shard_bytes=max_shard_bytes, max_shards=max_shards)
    assert partitioner(shape, dtype) == expected
    if shape[0] and math.prod(shape):
        bytes_per_slice = (math.prod(shape) / shape[0]) * dtype_num_bytes(dtype)
        slices_per_shard = max(1, math.floor(max_shard_bytes / bytes_per_slice))
        tf_value = int(math.ceil(shape[0] / slices_per_shard))
        if max_shards:
            tf_value = min(max_shards, tf_value)
        assert expected[0] == tf_value


def test_partitioners_accept_other_axes():
    assert FixedShardsPartitioner(3)((2, 9), "float32", axis=1) == [1, 3]
    assert MaxSizePartitioner(8)((2, 9), "float32", axis=1) == [1, 9]
    assert MinSizePartitioner(8, 100)((2, 9), "float32", axis=1) == [1, 9]
    with pytest.raises(InvalidArgumentError, match="axis=2"):
        FixedShardsPartitioner(3)((2, 9), "float32", axis=2)


@pytest.mark.parametrize(
    "factory, argument_name",
    [
        (lambda: FixedShardsPartitioner(0), "num_shards"),
        (lambda: FixedShardsPartitioner(2.0), "num_shards"),
        (lambda: FixedShardsPartitioner(True), "num_shards"),
        (lambda: MinSizePartitioner(min_shard_bytes=0), "min_shard_bytes"),
        (lambda: MinSizePartitioner(max_shards=0), "max_shards"),
        (lambda: MinSizePartitioner(bytes_per_string=-1), "bytes_per_string"),
        (lambda: MaxSizePartitioner(max_shard_bytes=0), "max_shard_bytes"),
        (lambda: MaxSizePartitioner(8, max_shards=0), "max_shards"),
        (lambda: MaxSizePartitioner(8, bytes_per_string=0), "bytes_per_string"),
    ],
)
def test_invalid_arguments_name_the_argument(factory, argument_name):
    with pytest.raises(InvalidArgumentError, match=f"Received: {argument_name}="):
        factory()


def test_invalid_arguments_are_value_errors():
    with pytest.raises(ValueError):
        FixedShardsPartitioner(-1)


@pytest.mark.parametrize("shape", [(-1, 4), (None, 4), (2.5,), 7])
def test_invalid_shapes_are_rejected(shape):
    with pytest.raises(InvalidArgumentError, match="shape"):
        FixedShardsPartitioner(2)(shape, "float32")


def test_dtype_spellings():
    assert canonical_dtype_name("float32") == "float32"
    assert canonical_dtype_name(np.float16) == "float16"
    assert canonical_dtype_name(np.dtype("int64")) == "int64"
    assert canonical_dtype_name(torch.bfloat16) == "bfloat16"
    assert canonical_dtype_name("bfloat16") == "bfloat16"
    assert canonical_dtype_name(torch.float64) == "float64"
    assert canonical_dtype_name("string") == "string"
    assert canonical_dtype_name(np.str_) == "string"
    assert dtype_num_bytes(torch.bfloat16) == 2
    assert dtype_num_bytes("int8") == 1
    assert dtype_num_bytes("string", bytes_per_string=7) == 7
    with pytest.raises(InvalidArgumentError, match="dtype"):
        canonical_dtype_name("not_a_dtype")


def test_torch_and_numpy_dtypes_partition_alike():
    partitioner = MinSizePartitioner(min_shard_bytes=64, max_shards=100)
    assert partitioner((32, 2), torch.float16) == partitioner((32, 2), np.float16) == [2, 1]


def test_canonical_shape():
    assert canonical_shape(torch.Size([100, 10])) == (100, 10)
    assert canonical_shape([np.int64(3)]) == (3,)
    assert canonical_shape(()) == ()
