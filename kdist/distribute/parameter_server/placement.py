"""Where parameter-server variables live: round-robin placement and div sharding.

Glossary:

- *ps* (parameter server): a task of the `ps` job that holds variables. Its
  index is its task index in the cluster spec.
- *shard*: one piece of a partitioned variable, a contiguous range of its rows
  (axis 0) held on one ps, named `"<variable>/part_<i>"` as in TensorFlow.
- *div strategy*: rows are dealt out contiguously and as evenly as possible;
  when they do not divide evenly, each of the first shards gets one extra row
  (`kdist.distribute.parameter_server.rows`, the one place that says which
  rows a shard owns).
- *slot*: one turn of the round-robin. Every unpartitioned variable and every
  shard takes the next slot, and slot `k` is ps `k % num_ps`.

A placement is pure data: it says where values are and never holds them; the
strategy wraps it in a `ShardedVariable` or `RemoteVariable`.
"""

import dataclasses
import threading

import numpy as np

from kdist.distribute.parameter_server.partitioners import canonical_shape
from kdist.distribute.parameter_server.rows import RowGroup, RowRange, div_partition, group_rows
from kdist.errors import InvalidArgumentError
from kdist.rpc.dtypes import canonical_dtype_name
from kdist.validation import is_integer

__all__ = [
    "PS_DEVICE_TEMPLATE", "RoundRobinPlacer", "RowGroup", "RowRange", "ShardPlacement", "VariablePlacement",
    "device_string", "div_partition",
]

PS_DEVICE_TEMPLATE = "/job:ps/replica:0/task:{}/device:CPU:0"
"""TensorFlow's device string of a parameter server; variables always live on its CPU."""


def device_string(ps_index):
    """Returns the TensorFlow device string of parameter server `ps_index`.

    Args:
        ps_index: the task index of the parameter server.

    Returns:
        `"/job:ps/replica:0/task:<ps_index>/device:CPU:0"`.

    Example:

    >>> device_string(2)
    '/job:ps/replica:0/task:2/device:CPU:0'
    """
    return PS_DEVICE_TEMPLATE.format(int(ps_index))


@dataclasses.dataclass(frozen=True)
class ShardPlacement:
    """Where one shard (or the whole of an unpartitioned variable) lives.

    Attributes:
        name: its TensorFlow-style name: `"w/part_0"` for a shard, the
            variable's own name when it is not partitioned. It is *not* the key
            the parameter server stores it under: the strategy's router keys
            shards by creation order (`"v3"`, `"v3/part_0"`; see
            `RemoteVariable.server_key`), so a `VariableClient` asked for
            `name` answers NOT_FOUND.
        ps_index: the task index of the parameter server holding it.
        row_start: the first row of the full variable it holds.
        row_stop: one past its last row. `row_start == row_stop == 0` for a
            scalar, which has no rows.
        shape: its own shape: `(row_stop - row_start,) + row shape`.
    """

    name: str
    ps_index: int
    row_start: int
    row_stop: int
    shape: tuple[int, ...]

    @property
    def device(self):
        """The TensorFlow device string of its parameter server."""
        return device_string(self.ps_index)

    @property
    def rows(self):
        """The `RowRange` of the full variable's rows it holds."""
        return RowRange(self.row_start, self.row_stop)

    @property
    def num_rows(self):
        """The number of rows it holds."""
        return self.row_stop - self.row_start


@dataclasses.dataclass(frozen=True)
class VariablePlacement:
    """Where every shard of one variable lives.

    An unpartitioned variable has exactly one shard, named like the variable
    (see `ShardPlacement.name` for the server's key), covering all its rows.

    Attributes:
        name: the variable's name.
        shape: the full shape of the variable.
        dtype: its canonical dtype name, e.g. `"float32"`.
        shards: one `ShardPlacement` per shard, in row order.

    Raises:
        kdist.errors.InvalidArgumentError: the shards do not tile the rows of
            `shape` in order, or a shard's shape disagrees with its rows.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    shards: tuple[ShardPlacement, ...]

    def __post_init__(self):
        if not self.shards:
            raise InvalidArgumentError(
                f"A variable needs at least one shard. Received: shards=() for "
                f"variable {self.name!r}. Expected one ShardPlacement per shard."
            )
        num_rows = self.shape[0] if self.shape else 0
        expected_start = 0
        for shard in self.shards:
            expected_shape = (shard.num_rows,) + tuple(self.shape[1:]) if self.shape else ()
            if shard.row_start != expected_start or tuple(shard.shape) != expected_shape:
                raise InvalidArgumentError(
                    f"The shards of variable {self.name!r} do not tile its rows. Received: "
                    f"shard {shard.name!r} rows [{shard.row_start}, {shard.row_stop}) "
                    f"shape {tuple(shard.shape)}. Expected rows starting at "
                    f"{expected_start} and shape {expected_shape}."
                )
            expected_start = shard.row_stop
        if expected_start != num_rows:
            raise InvalidArgumentError(
                f"The shards of variable {self.name!r} do not cover its rows. Received: "
                f"shards ending at row {expected_start}. Expected {num_rows} rows."
            )

    @property
    def is_partitioned(self):
        """True when the variable is split into more than one shard."""
        return len(self.shards) > 1

    @property
    def num_shards(self):
        """The number of shards (1 when not partitioned)."""
        return len(self.shards)

    @property
    def row_ranges(self):
        """The `RowRange` of every shard, in shard order."""
        return tuple(shard.rows for shard in self.shards)

    def shard_part(self, position, array):
        """The part of `array` (the whole variable's value or gradient) that shard `position` holds."""
        return array if not self.is_partitioned else self.shards[position].rows.take(array)

    @property
    def device(self):
        """The device string of the first shard's parameter server."""
        return self.shards[0].device

    @property
    def ps_index(self):
        """The parameter server of the first shard."""
        return self.shards[0].ps_index

    def shard_for_rows(self, ids):
        """Groups global row ids by the shard that owns them.

        Args:
            ids: integer row ids of any shape (NumPy array, list or CPU torch
                tensor), each in `[0, shape[0])`. Ids may repeat.

        Returns:
            A list of `RowGroup`, one for each shard that owns at least one id,
            in shard order. `positions` index the flattened ids, so
            `result.reshape(-1, *row_shape)[group.positions] = rows` puts each
            looked-up row back in place.

        Raises:
            kdist.errors.InvalidArgumentError: the variable is a scalar, the ids
                are not integers, or an id is out of range.

        Example:

        >>> from kdist.distribute.parameter_server.partitioners import FixedShardsPartitioner
        >>> placement = RoundRobinPlacer(num_ps=5).place(
        ...     "w", (13, 4), "float32", FixedShardsPartitioner(5))
        >>> [(g.shard_index, g.local_ids.tolist(), g.positions.tolist())
        ...  for g in placement.shard_for_rows([12, 0, 4, 1])]
        [(0, [0, 1], [1, 3]), (1, [1], [2]), (4, [1], [0])]
        """
        if not self.shape:
            raise InvalidArgumentError(
                f"A scalar has no rows to look up. Received: variable {self.name!r} "
                "with shape (). Expected a variable of rank 1 or more."
            )
        flat_ids = _as_flat_ids(ids)
        num_rows = self.shape[0]
        if flat_ids.size and (flat_ids.min() < 0 or flat_ids.max() >= num_rows):
            bad = flat_ids[(flat_ids < 0) | (flat_ids >= num_rows)][0]
            raise InvalidArgumentError(
                f"Row id out of range for variable {self.name!r}. Received: id={int(bad)}. "
                f"Expected ids in [0, {num_rows})."
            )
        return group_rows(flat_ids, self.row_ranges)


def _as_flat_ids(ids):
    if hasattr(ids, "detach"):  # a torch tensor, possibly on an accelerator
        ids = ids.detach().cpu().numpy()
    ids = np.asarray(ids)
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if ids.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"Row ids must be integers. Received: ids of dtype {ids.dtype}. "
            "Expected an integer array, e.g. int64."
        )
    return ids.reshape(-1).astype(np.int64, copy=False)


class RoundRobinPlacer:
    """Assigns variables and shards to parameter servers in creation order.

    Each unpartitioned variable and each shard of a partitioned one takes the
    next parameter server in turn (slot `k` goes to ps `k % num_ps`), so with 3
    ps four scalars land on ps 0, 1, 2, 0. The shards of one variable take
    consecutive slots even when several threads place variables at once.

    Variables placed with `colocate_with` follow TensorFlow's
    `colocate_vars_with`: they go to the target's (first shard's) parameter
    server, are never partitioned, and do not take a slot, so the variables
    after them are placed as if they did not exist.

    Thread-safe: `place` may be called from several threads.
    Args:
        num_ps: the number of parameter servers, a positive integer.

    Raises:
        kdist.errors.InvalidArgumentError: `num_ps` is not a positive integer.

    Example:

    >>> from kdist.distribute.parameter_server.partitioners import FixedShardsPartitioner
    >>> placer = RoundRobinPlacer(num_ps=3)
    >>> [placer.place(f"v{i}", (), "float32").ps_index for i in range(2, 6)]
    [0, 1, 2, 0]
    >>> sharded = placer.place("w", (100, 10), "float32", FixedShardsPartitioner(2))
    >>> [(shard.name, shard.ps_index) for shard in sharded.shards]
    [('w/part_0', 1), ('w/part_1', 2)]
    """

    def __init__(self, num_ps):
        if not is_integer(num_ps, minimum=1):
            raise InvalidArgumentError(
                "A parameter-server cluster needs at least one ps task. Received: "
                f"num_ps={num_ps!r}. Expected a positive integer."
            )
        self.num_ps = int(num_ps)
        self._lock = threading.Lock()
        self._num_slots_taken = 0

    @property
    def num_slots_taken(self):
        """How many round-robin slots have been handed out so far."""
        with self._lock:
            return self._num_slots_taken

    def place(self, name, shape, dtype, partitioner=None, colocate_with=None):
        """Decides where a new variable (or its shards) will live.

        Args:
            name: the variable's name; shards are named `"<name>/part_<i>"`.
            shape: the full shape of the variable.
            dtype: its dtype (string, NumPy or torch dtype).
            partitioner: an optional callable `(shape, dtype) -> list[int]`
                such as a `Partitioner`; not called for scalars or variables
                with no rows. A result of 1 leaves the variable whole.
            colocate_with: an optional `VariablePlacement`; the new variable
                then goes to that variable's first parameter server, whole, and
                takes no round-robin slot.

        Returns:
            A `VariablePlacement`.

        Raises:
            kdist.errors.InvalidArgumentError: the name, shape or dtype is
                invalid, `colocate_with` is not a placement on this cluster, or
                the partitioner returned something other than one integer per
                axis with a first entry between 1 and the number of rows and 1
                everywhere else.
        """
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(
                f"A variable needs a name. Received: name={name!r}. Expected a non-empty str."
            )
        shape = canonical_shape(shape)
        dtype = canonical_dtype_name(dtype)
        if colocate_with is not None:
            return self._colocate(name, shape, dtype, colocate_with)
        num_shards = 1
        if partitioner is not None and shape and shape[0] > 0:
            # The partitioner is user code: call it outside the lock.
            num_shards = _checked_num_shards(name, shape, partitioner(shape, dtype))
        row_ranges = div_partition(shape[0], num_shards) if shape else [RowRange(0, 0)]
        with self._lock:
            first_slot = self._num_slots_taken
            self._num_slots_taken += num_shards
        shards = []
        for shard_index, (row_start, row_stop) in enumerate(row_ranges):
            shards.append(
                ShardPlacement(
                    name=f"{name}/part_{shard_index}" if num_shards > 1 else name,
                    ps_index=(first_slot + shard_index) % self.num_ps,
                    row_start=row_start,
                    row_stop=row_stop,
                    shape=((row_stop - row_start),) + shape[1:] if shape else (),
                )
            )
        return VariablePlacement(name=name, shape=shape, dtype=dtype, shards=tuple(shards))

    def _colocate(self, name, shape, dtype, colocate_with):
        if not isinstance(colocate_with, VariablePlacement):
            raise InvalidArgumentError(
                "`colocate_with` must be the placement of an existing variable. Received: "
                f"colocate_with={colocate_with!r}. Expected a VariablePlacement."
            )
        ps_index = colocate_with.shards[0].ps_index
        if not 0 <= ps_index < self.num_ps:
            raise InvalidArgumentError(
                "`colocate_with` names a parameter server this cluster does not have. "
                f"Received: ps_index={ps_index} (variable {colocate_with.name!r}). "
                f"Expected 0 <= ps_index < {self.num_ps}."
            )
        shard = ShardPlacement(name, ps_index, 0, shape[0] if shape else 0, shape)
        return VariablePlacement(name=name, shape=shape, dtype=dtype, shards=(shard,))


def _checked_num_shards(name, shape, partitions):
    expected = (
        f"one integer per axis ({len(shape)}), the first at least 1, every other equal to 1"
    )
    entries = list(partitions) if isinstance(partitions, (list, tuple, np.ndarray)) else None
    usable = (
        entries is not None
        and len(entries) == len(shape)
        and all(is_integer(entry) for entry in entries)
        and all(entry == 1 for entry in entries[1:])
        and entries[0] >= 1
    )
    if not usable:
        raise InvalidArgumentError(
            f"The variable partitioner returned an unusable result for variable {name!r} "
            f"of shape {shape}: only the first axis can be split. Received: "
            f"partitions={partitions!r}. Expected {expected}."
        )
    # As TensorFlow: a partitioner asking for more shards than there are rows
    # (e.g. `[num_ps, 1]` for a 3-row bias) gets one shard per row.
    return min(int(entries[0]), shape[0])
