"""Which rows of a row-partitioned variable each shard owns: computed here, and only here.

A variable split along axis 0 is dealt out with the *div* strategy: each
shard holds one contiguous, half-open `RowRange` of the full variable's rows,
the ranges tile the rows in order, and when the rows do not divide evenly
each of the first shards gets one extra row (`div_partition`). Everything
that maps between the full variable and its shards goes through this module:
placing a variable (`kdist.distribute.parameter_server.placement`), grouping
looked-up or pushed row ids by owner (`group_rows`), and cutting a full value
or gradient into shard parts (`RowRange.take`).
"""

import dataclasses
from typing import NamedTuple

import numpy as np

from kdist.errors import InvalidArgumentError
from kdist.validation import is_integer


class RowRange(NamedTuple):
    """The rows `[start, stop)` of the full variable that one shard holds.

    A tuple, so `RowRange(0, 3) == (0, 3)`. A scalar, which has no rows, is
    held as `RowRange(0, 0)`.

    Example:

    >>> RowRange(3, 6).take(np.arange(10)).tolist()
    [3, 4, 5]
    """

    start: int
    stop: int

    @property
    def num_rows(self):
        """The number of rows in the range."""
        return self.stop - self.start

    def take(self, array):
        """The rows of `array` (shaped like the full variable) in this range: a view, no copy."""
        return array[self.start : self.stop]


def div_partition(num_rows, num_shards):
    """Splits `num_rows` rows into `num_shards` contiguous ranges (div strategy).

    Args:
        num_rows: the number of rows, a non-negative integer.
        num_shards: the number of shards, between 1 and `max(num_rows, 1)`.

    Returns:
        A list of `RowRange` (half-open `(start, stop)` tuples), in row order.
        The first `num_rows % num_shards` ranges hold one row more than the others.

    Raises:
        kdist.errors.InvalidArgumentError: `num_shards` is below 1 or above the
            number of rows, or `num_rows` is negative.

    Example:

    >>> div_partition(13, 5)    # rows [0,1,2] [3,4,5] [6,7,8] [9,10] [11,12]
    [RowRange(start=0, stop=3), RowRange(start=3, stop=6), RowRange(start=6, stop=9), RowRange(start=9, stop=11), RowRange(start=11, stop=13)]
    """
    integers = is_integer(num_rows) and is_integer(num_shards)
    if not integers or num_rows < 0 or num_shards < 1 or num_shards > max(num_rows, 1):
        raise InvalidArgumentError(
            "Cannot split the rows into that many shards. Received: "
            f"num_rows={num_rows!r}, num_shards={num_shards!r}. Expected integers with "
            "1 <= num_shards <= num_rows: a shard holds at least one row."
        )
    base, extra = divmod(int(num_rows), int(num_shards))
    ranges = []
    start = 0
    for shard_index in range(int(num_shards)):
        stop = start + base + (1 if shard_index < extra else 0)
        ranges.append(RowRange(start, stop))
        start = stop
    return ranges


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """The ids of one lookup (or one row gradient) that fall in one shard.

    Attributes:
        shard_index: the index of the shard (in `VariablePlacement.shards`).
        local_ids: the ids relative to the shard's first row (int64, may repeat).
        positions: for each local id, its position in the flattened global ids.
    """

    shard_index: int
    local_ids: np.ndarray
    positions: np.ndarray


def owners(ids, ranges):
    """The index of the range that owns each of the (in-range, int64, 1-D) row `ids`.

    Example:

    >>> owners(np.array([12, 0, 4]), div_partition(13, 5)).tolist()
    [4, 0, 1]
    """
    stops = np.array([row_range.stop for row_range in ranges], dtype=np.int64)
    return np.searchsorted(stops, ids, side="right")


def group_rows(ids, ranges):
    """Groups the (in-range, int64, 1-D) row `ids` by the range that owns them.

    Args:
        ids: global row ids; they may repeat.
        ranges: the shards' `RowRange`s, tiling the rows in order.

    Returns:
        A list of `RowGroup`, one for each range owning at least one id, in
        range order.

    Example:

    >>> [(g.shard_index, g.local_ids.tolist(), g.positions.tolist())
    ...  for g in group_rows(np.array([12, 0, 4, 1]), div_partition(13, 5))]
    [(0, [0, 1], [1, 3]), (1, [1], [2]), (4, [1], [0])]
    """
    owner = owners(ids, ranges)
    groups = []
    for shard_index in np.unique(owner).tolist():
        positions = np.flatnonzero(owner == shard_index)
        groups.append(RowGroup(shard_index, ids[positions] - ranges[shard_index].start, positions))
    return groups
