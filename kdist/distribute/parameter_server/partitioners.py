"""Variable partitioners: how many shards a parameter-server variable is split into.

A partitioner is called once for each variable created under a
`ParameterServerStrategy` scope that has a `variable_partitioner`. It receives
the variable's full shape and dtype and returns the number of partitions on
each axis, e.g. `[4, 1]` for "split the rows of this matrix into 4 shards".
As in TensorFlow, only the first (outermost) axis may have more than one
partition, and the rows are then dealt out with the *div* strategy (see
`kdist.distribute.parameter_server.placement.div_partition`).

The three partitioners below reproduce
`tf.distribute.experimental.partitioners` exactly (same formulas, same
defaults); none of them asks for more shards than the partitioned axis has
entries. A rank-0 (scalar) variable has no axis to split: every partitioner
returns `[]` for it, and the strategy does not partition it.

A dtype may be given as a string (`"float32"`, `"bfloat16"`, `"string"`), a
NumPy dtype or scalar type, or a `torch.dtype` (`canonical_dtype_name`, from
`kdist.rpc.dtypes`, names it).
"""

import abc

from kdist.errors import InvalidArgumentError
from kdist.rpc.dtypes import canonical_dtype_name, numpy_dtype, torch_dtype
from kdist.validation import is_integer, require_positive_integer

DEFAULT_MIN_SHARD_BYTES = 256 << 10
"""256 KiB: TensorFlow's default; smaller shards cost more in per-request overhead than
they gain in parallelism."""

DEFAULT_BYTES_PER_STRING = 16
"""Estimated size of one string element, whose real size is unknown until it is filled."""


def dtype_num_bytes(dtype, bytes_per_string=DEFAULT_BYTES_PER_STRING):
    """Returns the size in bytes of one element of `dtype`.

    Args:
        dtype: any spelling `canonical_dtype_name` accepts.
        bytes_per_string: the size to assume for one string element.

    Returns:
        The element size in bytes (`bytes_per_string` for strings).

    Raises:
        kdist.errors.InvalidArgumentError: `dtype` is not a dtype.

    Example:

    >>> dtype_num_bytes("bfloat16")
    2
    >>> dtype_num_bytes("string", bytes_per_string=32)
    32
    """
    name = canonical_dtype_name(dtype)
    if name == "string":
        return bytes_per_string
    torch_type = torch_dtype(name)
    if torch_type is not None:
        return torch_type.itemsize
    return numpy_dtype(name).itemsize


def canonical_shape(shape):
    """Returns `shape` as a tuple of Python ints after checking every dimension.

    Args:
        shape: a sequence of non-negative integers (tuple, list, `torch.Size`).

    Returns:
        The shape as a tuple of `int`.

    Raises:
        kdist.errors.InvalidArgumentError: `shape` is not a sequence, or a
            dimension is negative, unknown (None) or not an integer.

    Example:

    >>> canonical_shape(torch.Size([100, 10]))
    (100, 10)
    """
    try:
        dims = tuple(shape)
    except TypeError:
        raise InvalidArgumentError(
            f"A shape must be a sequence of integers. Received: shape={shape!r}. "
            "Expected, e.g., (100, 10)."
        ) from None
    for dim in dims:
        if not is_integer(dim, minimum=0):
            raise InvalidArgumentError(
                "Every dimension of a variable's shape must be a known, non-negative "
                f"integer. Received: shape={dims!r}. Expected, e.g., (100, 10)."
            )
    return tuple(int(dim) for dim in dims)


def _check_axis(axis, shape):
    if not is_integer(axis):
        raise InvalidArgumentError(
            f"`axis` must be an integer. Received: axis={axis!r}. Expected: 0."
        )
    if not 0 <= axis < len(shape):
        raise InvalidArgumentError(
            f"Cannot partition a variable along an axis it does not have. Received: "
            f"axis={axis}, shape={shape}. Expected 0 <= axis < {len(shape)}."
        )


def _prod(dims):
    result = 1
    for dim in dims:
        result *= dim
    return result


class Partitioner(abc.ABC):
    """Base class of partitioners: decides how many shards a variable is split into.

    Called as `partitioner(shape, dtype, axis=0)`, it returns one integer per
    axis of `shape`: the number of partitions along that axis. Only the first
    axis may be partitioned by `ParameterServerStrategy`, so every other entry
    is 1. A subclass implements `num_shards(shape, dtype, axis)`; any callable
    with the same signature as `__call__` can also serve as a
    `variable_partitioner`.

    Example:

    >>> class EveryRowItsOwnShard(Partitioner):
    ...     def num_shards(self, shape, dtype, axis):
    ...         return shape[axis]
    >>> EveryRowItsOwnShard()((3, 2), "float32")
    [3, 1]
    """

    def __call__(self, shape, dtype, axis=0):
        """Returns the number of partitions along each axis of `shape`.

        Args:
            shape: the full shape of the variable, a sequence of non-negative
                integers.
            dtype: the variable's dtype (string, NumPy or torch dtype).
            axis: the axis to partition. Defaults to the first (outermost) axis.

        Returns:
            A list with one integer per axis of `shape`; `[]` for a scalar.
        """
        shape = canonical_shape(shape)
        if not shape:
            return []
        _check_axis(axis, shape)
        partitions = [1] * len(shape)
        partitions[axis] = self.num_shards(shape, dtype, axis)
        return partitions

    @abc.abstractmethod
    def num_shards(self, shape, dtype, axis):
        """The number of shards along `axis` of the (non-scalar, canonical) `shape`."""


class FixedShardsPartitioner(Partitioner):
    """Partitioner that asks for a fixed number of shards.

    The number of shards is `min(num_shards, shape[axis])`: a variable is never
    split into more shards than it has rows.

    Args:
        num_shards: the number of shards, a positive integer.

    Raises:
        kdist.errors.InvalidArgumentError: `num_shards` is not a positive integer.

    Example:

    >>> partitioner = FixedShardsPartitioner(num_shards=5)
    >>> partitioner((13, 4), "float32")    # rows 0-2, 3-5, 6-8, 9-10, 11-12
    [5, 1]
    >>> partitioner((3, 4), "float32")     # only 3 rows: 3 shards
    [3, 1]
    """

    def __init__(self, num_shards):
        require_positive_integer("num_shards", num_shards)
        self.fixed_num_shards = int(num_shards)

    def num_shards(self, shape, dtype, axis):
        return min(self.fixed_num_shards, shape[axis])

    def __repr__(self):
        return f"FixedShardsPartitioner(num_shards={self.fixed_num_shards})"


class MinSizePartitioner(Partitioner):
    """Partitioner that gives every shard at least `min_shard_bytes`.

    It makes as many shards as possible (the smallest shards) while each shard
    holds at least `min_shard_bytes`, with at most `max_shards` shards and at
    most one row per shard:

        num_shards = max(1, min(shape[axis], max_shards,
                                ceil(total_bytes / min_shard_bytes)))

    where `total_bytes = num_elements * element_bytes`. This is TensorFlow's
    formula (`min_max_variable_partitioner`); note that it rounds *up*, so the
    last shards may hold somewhat less than `min_shard_bytes`.

    Args:
        min_shard_bytes: the minimum size of a shard in bytes. Defaults to 256 KiB.
        max_shards: the maximum number of shards. Defaults to 1; the usual
            value is the number of parameter servers.
        bytes_per_string: the size assumed for one element of a string variable.

    Raises:
        kdist.errors.InvalidArgumentError: an argument is not a positive integer.

    Example:

    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), "float32")
    [2, 1]
    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), "float32")
    [6, 1]
    >>> # 1024 x 1024 float32 = 4 MiB = 16 x 256 KiB
    >>> MinSizePartitioner(max_shards=100)((1024, 1024), "float32")
    [16, 1]
    """

    def __init__(
        self,
        min_shard_bytes=DEFAULT_MIN_SHARD_BYTES,
        max_shards=1,
        bytes_per_string=DEFAULT_BYTES_PER_STRING,
    ):
        require_positive_integer("min_shard_bytes", min_shard_bytes)
        require_positive_integer("max_shards", max_shards)
        require_positive_integer("bytes_per_string", bytes_per_string)
        self.min_shard_bytes = int(min_shard_bytes)
        self.max_shards = int(max_shards)
        self.bytes_per_string = int(bytes_per_string)

    def num_shards(self, shape, dtype, axis):
        total_bytes = _prod(shape) * dtype_num_bytes(dtype, self.bytes_per_string)
        wanted = -(-total_bytes // self.min_shard_bytes)  # ceil, exact for big ints
        return max(1, min(shape[axis], self.max_shards, wanted))

    def __repr__(self):
        return (
            f"MinSizePartitioner(min_shard_bytes={self.min_shard_bytes}, "
            f"max_shards={self.max_shards}, bytes_per_string={self.bytes_per_string})"
        )


class MaxSizePartitioner(Partitioner):
    """Partitioner that keeps every shard at most `max_shard_bytes`.

    It makes as few shards as possible (the largest shards) such that each
    holds at most `max_shard_bytes`. A shard holds at least one row, so a
    single row bigger than `max_shard_bytes` gets a shard of its own (the limit
    is then exceeded). `max_shards`, when given, takes precedence over
    `max_shard_bytes`:

        rows_per_shard = max(1, floor(max_shard_bytes / bytes_per_row))
        num_shards = ceil(shape[axis] / rows_per_shard)
        num_shards = min(num_shards, max_shards)   # when max_shards is set

    This is TensorFlow's formula (`variable_axis_size_partitioner`), computed
    with exact integers. A variable with no rows or no bytes per row is not
    partitioned (TensorFlow divides by zero there).

    Args:
        max_shard_bytes: the maximum size of a shard in bytes. A common choice
            is a little below the transport's message limit.
        max_shards: the maximum number of shards, or None (the default) for
            no limit. Unlike TensorFlow, 0 is rejected rather than read as None.
        bytes_per_string: the size assumed for one element of a string variable.

    Raises:
        kdist.errors.InvalidArgumentError: an argument is not a positive integer.

    Example:

    >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), "float32")
    [6, 1]
    >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), "float32")
    [2, 1]
    >>> MaxSizePartitioner(max_shard_bytes=1024)((6, 1), "float32")
    [1, 1]
    """

    def __init__(self, max_shard_bytes, max_shards=None, bytes_per_string=DEFAULT_BYTES_PER_STRING):
        require_positive_integer("max_shard_bytes", max_shard_bytes)
        require_positive_integer("max_shards", max_shards, allow_none=True)
        require_positive_integer("bytes_per_string", bytes_per_string)
        self.max_shard_bytes = int(max_shard_bytes)
        self.max_shards = None if max_shards is None else int(max_shards)
        self.bytes_per_string = int(bytes_per_string)

    def num_shards(self, shape, dtype, axis):
        num_rows = shape[axis]
        row_elements = _prod(shape[:axis] + shape[axis + 1 :])
        bytes_per_row = row_elements * dtype_num_bytes(dtype, self.bytes_per_string)
        if num_rows == 0 or bytes_per_row == 0:
            return 1
        rows_per_shard = max(1, self.max_shard_bytes // bytes_per_row)
        num_shards = -(-num_rows // rows_per_shard)
        if self.max_shards is not None:
            num_shards = min(num_shards, self.max_shards)
        return num_shards

    def __repr__(self):
        return (
            f"MaxSizePartitioner(max_shard_bytes={self.max_shard_bytes}, "
            f"max_shards={self.max_shards}, bytes_per_string={self.bytes_per_string})"
        )
