"""Row ownership: div ranges, owners and row groups, computed in one place."""

import numpy as np
import pytest

from kdist.distribute.parameter_server.partitioners import FixedShardsPartitioner
from kdist.distribute.parameter_server.placement import RoundRobinPlacer
from kdist.distribute.parameter_server.rows import RowRange, div_partition, group_rows, owners
from kdist.errors import InvalidArgumentError


def test_ranges_are_row_ranges_and_tuples():
    ranges = div_partition(13, 5)
    assert ranges == [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]
    assert all(isinstance(row_range, RowRange) for row_range in ranges)
    assert [row_range.num_rows for row_range in ranges] == [3, 3, 3, 2, 2]
    assert div_partition(np.int64(4), np.int32(2)) == [(0, 2), (2, 4)]


@pytest.mark.parametrize("num_rows, num_shards", [(3, 4), (3, 0), (-1, 1), (3.0, 1), (True, 1), (3, None)])
def test_impossible_splits_are_refused(num_rows, num_shards):
    with pytest.raises(InvalidArgumentError, match="Received: num_rows="):
        div_partition(num_rows, num_shards)


def test_owner_of_every_row_is_the_range_holding_it():
    ranges = div_partition(13, 5)
    rows = np.arange(13)
    expected = [index for index, row_range in enumerate(ranges) for _ in range(row_range.num_rows)]
    assert owners(rows, ranges).tolist() == expected


def test_groups_put_rows_back_in_place():
    ranges = div_partition(10, 3)
    ids = np.array([9, 0, 4, 4, 3, 7])
    table = np.arange(10) * 10
    gathered = np.empty(len(ids), dtype=table.dtype)
    for group in group_rows(ids, ranges):
        gathered[group.positions] = ranges[group.shard_index].take(table)[group.local_ids]
    np.testing.assert_array_equal(gathered, table[ids])


def test_placement_shard_parts_tile_the_variable():
    placement = RoundRobinPlacer(3).place("w", (7, 2), "float32", FixedShardsPartitioner(3))
    value = np.arange(14, dtype="float32").reshape(7, 2)
    assert placement.row_ranges == ((0, 3), (3, 5), (5, 7))
    parts = [placement.shard_part(position, value) for position in range(placement.num_shards)]
    np.testing.assert_array_equal(np.concatenate(parts), value)
    assert all(np.shares_memory(part, value) for part in parts)
    whole = RoundRobinPlacer(3).place("b", (7,), "float32")
    assert whole.shard_part(0, value) is value
