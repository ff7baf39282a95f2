"""What the user sees of a variable that lives on parameter servers.

- `RemoteVariable`: one variable, or one shard of a partitioned variable, held
  by one parameter server.
- `ShardedVariable`: the container of a partitioned variable, like TensorFlow's
  `tf.distribute.ShardedVariable`. Its `variables` are the shards (named
  `"w/part_0"`, `"w/part_1"`, ...). Used densely (`numpy()`, `to_tensor()`,
  `np.asarray`, a torch op) it reads every shard and concatenates them along
  axis 0, which moves the whole variable; `embedding_lookup` moves only the
  rows asked for.

Neither holds values or other state, so both are as thread-safe as their reader
(a `VariableReader`, `kdist.distribute.parameter_server.variable_reader`);
every method makes at most one reader call.
"""

__all__ = ["RemoteVariable", "ShardReadError", "ShardedVariable", "VariableReader"]

import dataclasses

import numpy as np
import torch

from kdist.distribute.parameter_server.placement import VariablePlacement
from kdist.distribute.parameter_server.variable_reader import (
    ShardReadError,
    VariableReader,
    check_reader,
    checked_array,
    checked_results,
)
from kdist.errors import InvalidArgumentError
from kdist.rpc.dtypes import numpy_dtype
from kdist.validation import is_integer


def _ids_array(ids):
    if hasattr(ids, "detach"):  # a torch tensor, possibly on an accelerator
        ids = ids.detach().cpu().numpy()
    return np.asarray(ids)


def _gather_rows(reader, placement, reader_shards, ids):
    """Rows `ids` of `placement`, in one reader call, in the order of `ids`.

    `reader_shards[i]` is what the reader is asked about for `placement.shards[i]`.
    """
    ids = _ids_array(ids)
    groups = placement.shard_for_rows(ids)
    row_shape = tuple(placement.shape[1:])
    if not groups:
        return np.zeros(ids.shape + row_shape, dtype=numpy_dtype(placement.dtype))
    # Each distinct row travels once, however often it is asked for.
    requests, inverses = [], []
    for group in groups:
        unique_ids, inverse = np.unique(group.local_ids, return_inverse=True)
        requests.append((reader_shards[group.shard_index], unique_ids))
        inverses.append(inverse.reshape(-1))
    results = checked_results(reader.lookup(requests), len(requests), "lookup")
    output = None
    for (shard, unique_ids), inverse, group, rows in zip(requests, inverses, groups, results):
        rows = checked_array(rows, (len(unique_ids),) + row_shape, shard.name)
        if output is None:
            output = np.empty((ids.size,) + row_shape, dtype=rows.dtype)
        output[group.positions] = rows[inverse]
    return output.reshape(ids.shape + row_shape)


def _convert_for_torch(value):
    if isinstance(value, (ShardedVariable, RemoteVariable)):
        return value.to_tensor()
    if isinstance(value, (list, tuple)):
        return type(value)(_convert_for_torch(item) for item in value)
    if isinstance(value, dict):
        return {key: _convert_for_torch(item) for key, item in value.items()}
    return value


class _DenseValueMixin:
    """Dense conversions shared by both views: NumPy, torch, and torch ops."""

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype, copy=False)

    def to_tensor(self, device=None):
        """Reads the value and returns it as a torch tensor.

        Args:
            device: where to put the tensor; defaults to the CPU.

        Returns:
            A `torch.Tensor` with the variable's full shape.
        """
        tensor = torch.from_numpy(np.ascontiguousarray(self.numpy()))
        return tensor if device is None else tensor.to(device)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Used densely in a torch op, the value is read and converted, as TF does
        # when a ShardedVariable meets a Tensor op.
        return func(*_convert_for_torch(args), **_convert_for_torch(kwargs or {}))


class RemoteVariable(_DenseValueMixin):
    """A view of one variable, or of one shard, held by a parameter server.

    Args:
        placement: the variable's `VariablePlacement`.
        reader: a `VariableReader`.
        shard_index: which shard this view shows; 0, the only shard, for an
            unpartitioned variable.

    Raises:
        kdist.errors.InvalidArgumentError: `reader` is not a `VariableReader`
            or `shard_index` is out of range.

    Example:

    >>> reader = ...        # the strategy's VariableReader
    >>> placement = RoundRobinPlacer(num_ps=2).place("bias", (4,), "float32")
    >>> bias = RemoteVariable(placement, reader)
    >>> bias.device
    '/job:ps/replica:0/task:0/device:CPU:0'
    """

    def __init__(self, placement, reader, shard_index=0):
        if not isinstance(placement, VariablePlacement):
            raise InvalidArgumentError(
                "A RemoteVariable views a placed variable. Received: "
                f"placement={placement!r}. Expected a VariablePlacement."
            )
        if not 0 <= shard_index < placement.num_shards:
            raise InvalidArgumentError(
                f"Variable {placement.name!r} has no such shard. Received: "
                f"shard_index={shard_index}. Expected 0 <= shard_index < {placement.num_shards}."
            )
        self._placement = placement
        self._shard = placement.shards[shard_index]
        self._reader = check_reader(reader)

    @property
    def shard(self):
        """The `ShardPlacement` this view shows."""
        return self._shard

    @property
    def name(self):
        """Its TensorFlow-style name (`"w/part_0"` for a shard).

        Not the key the parameter server stores it under: see `server_key`.
        """
        return self._shard.name

    @property
    def server_key(self):
        """The key its parameter server stores it under, e.g. `"v3/part_0"`; None if the reader does not say.

        The strategy's router keys variables by creation order, not by name
        (see `kdist.distribute.parameter_server.route.server_keys`), so this,
        not `name`, is what a `kdist.ps.VariableClient` of that server
        (`device`, `ps_index`) pulls. Read-only.
        """
        server_key = getattr(self._reader, "server_key", None)
        return None if server_key is None else server_key(self._shard)

    @property
    def shape(self):
        """Its own shape (a shard's rows only)."""
        return self._shard.shape

    @property
    def dtype(self):
        """Its canonical dtype name, e.g. `"float32"`."""
        return self._placement.dtype

    @property
    def device(self):
        """The device string of its parameter server."""
        return self._shard.device

    @property
    def ps_index(self):
        """The task index of its parameter server."""
        return self._shard.ps_index

    @property
    def row_start(self):
        """The first row of the full variable it holds."""
        return self._shard.row_start

    @property
    def row_stop(self):
        """One past the last row of the full variable it holds."""
        return self._shard.row_stop

    def numpy(self):
        """Reads its value with one reader call.

        Returns:
            A NumPy array of shape `self.shape`.

        Raises:
            ShardReadError: the reader answered with the wrong shape.
        """
        (value,) = checked_results(self._reader.read([self._shard]), 1, "read")
        return checked_array(value, self._shard.shape, self._shard.name)

    def embedding_lookup(self, ids):
        """Reads only the rows `ids` (relative to this view's first row).

        Args:
            ids: integer ids of any shape, each in `[0, shape[0])`.

        Returns:
            A NumPy array of shape `ids.shape + shape[1:]`.

        Raises:
            kdist.errors.InvalidArgumentError: an id is out of range or not an integer.
        """
        # Seen on its own, the shard is a whole variable whose rows start at 0.
        local = dataclasses.replace(self._shard, row_start=0, row_stop=self._shard.num_rows)
        view = VariablePlacement(self.name, self.shape, self.dtype, (local,))
        return _gather_rows(self._reader, view, (self._shard,), ids)

    def __repr__(self):
        return (
            f"<RemoteVariable name={self.name!r} shape={self.shape} dtype={self.dtype} "
            f"device={self.device!r}>"
        )


class ShardedVariable(_DenseValueMixin):
    """The container of a variable split along axis 0 across parameter servers.

    Like TensorFlow's `ShardedVariable`: `variables` are the shards; dense use
    (`numpy()`, `to_tensor()`, `np.asarray(v)`, a torch op such as
    `torch.matmul(x, v)`) reads and concatenates all of them; `embedding_lookup`
    reads only the rows it needs from each shard, in one reader call.

    Args:
        placement: the variable's `VariablePlacement` (usually partitioned; one
            shard is allowed).
        reader: a `VariableReader`.

    Raises:
        kdist.errors.InvalidArgumentError: `placement` is not a
            `VariablePlacement` of rank 1 or more, or `reader` is not a
            `VariableReader`.

    Example:

    >>> reader = ...        # the strategy's VariableReader
    >>> placer = RoundRobinPlacer(num_ps=2)
    >>> placement = placer.place("w", (100, 10), "float32", FixedShardsPartitioner(2))
    >>> w = ShardedVariable(placement, reader)
    >>> [v.name for v in w.variables]
    ['w/part_0', 'w/part_1']
    >>> w.embedding_lookup([[3, 97]]).shape    # rows 3 and 97 only
    (1, 2, 10)
    """

    def __init__(self, placement, reader):
        if not isinstance(placement, VariablePlacement) or not placement.shape:
            raise InvalidArgumentError(
                "A ShardedVariable needs the placement of a variable with rows. Received: "
                f"placement={placement!r}. Expected a VariablePlacement of rank >= 1."
            )
        self._placement = placement
        self._reader = check_reader(reader)
        self._variables = [
            RemoteVariable(placement, reader, index) for index in range(placement.num_shards)
        ]

    @property
    def placement(self):
        """The variable's `VariablePlacement`."""
        return self._placement

    @property
    def variables(self):
        """The shards, as a list of `RemoteVariable`, in row order."""
        return list(self._variables)

    @property
    def name(self):
        """The name of the whole variable (shards are `"<name>/part_<i>"`)."""
        return self._placement.name

    @property
    def shape(self):
        """The full shape: all shards together along axis 0."""
        return self._placement.shape

    @property
    def dtype(self):
        """The canonical dtype name of every shard, e.g. `"float32"`."""
        return self._placement.dtype

    def __iter__(self):
        """Iterates over the shards, as TensorFlow's `ShardedVariable` does."""
        return iter(self.variables)

    def numpy(self):
        """Reads every shard in one reader call and concatenates them along axis 0.

        Returns:
            A NumPy array of the full shape.

        Raises:
            ShardReadError: the reader answered with the wrong number or shape.
        """
        shards = self._placement.shards
        values = checked_results(self._reader.read(list(shards)), len(shards), "read")
        values = [checked_array(value, shard.shape, shard.name) for shard, value in zip(shards, values)]
        return np.concatenate(values, axis=0)

    def embedding_lookup(self, ids):
        """Reads the rows `ids` of the full variable, each from the shard that owns it.

        One reader call carries one request per shard that owns at least one of
        the ids, and each request holds only that shard's (distinct) rows.

        Args:
            ids: integer row ids of any shape (list, NumPy array or torch
                tensor), each in `[0, shape[0])`; ids may repeat.

        Returns:
            A NumPy array of shape `ids.shape + shape[1:]`, rows in the order of `ids`.

        Raises:
            kdist.errors.InvalidArgumentError: an id is out of range or not an integer.
            ShardReadError: the reader answered with the wrong number or shape.
        """
        return _gather_rows(self._reader, self._placement, self._placement.shards, ids)

    def __getitem__(self, key):
        """Indexes like a NumPy array; integer and slice keys on axis 0 read only those rows."""
        first, rest = (key[0], key[1:]) if isinstance(key, tuple) and key else (key, ())
        num_rows = self.shape[0]
        if is_integer(first):
            row = int(first) + num_rows if first < 0 else int(first)
            if not 0 <= row < num_rows:
                raise IndexError(
                    f"Row {first} is out of range for {self.name!r} with {num_rows} rows."
                )
            return self.embedding_lookup(np.array(row))[rest]
        if isinstance(first, slice):
            return self.embedding_lookup(np.arange(num_rows)[first])[(slice(None),) + rest]
        return self.numpy()[key]

    def __repr__(self):
        shards = ", ".join(
            f"{shard.name}@ps{shard.ps_index}[{shard.row_start}:{shard.row_stop}]"
            for shard in self._placement.shards
        )
        return (
            f"<ShardedVariable name={self.name!r} shape={self.shape} dtype={self.dtype} "
            f"shards=[{shards}]>"
        )
