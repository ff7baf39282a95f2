"""Round-robin placement, div sharding and row grouping."""

import threading

import numpy as np
import pytest
import torch

from kdist.distribute.parameter_server.partitioners import FixedShardsPartitioner, MinSizePartitioner
from kdist.distribute.parameter_server.placement import (
    RoundRobinPlacer,
    ShardPlacement,
    VariablePlacement,
    device_string,
    div_partition,
)
from kdist.errors import InvalidArgumentError


def test_device_string():
    assert device_string(0) == "/job:ps/replica:0/task:0/device:CPU:0"
    assert device_string(3) == "/job:ps/replica:0/task:3/device:CPU:0"


def test_div_partition_seed_example():
    # 13 ids over 5 shards: [[0,1,2],[3,4,5],[6,7,8],[9,10],[11,12]]
    ranges = div_partition(13, 5)
    assert ranges == [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]
    assert [list(range(*r)) for r in ranges] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10], [11, 12]]


@pytest.mark.parametrize("num_rows, num_shards", [(10, 4), (100, 2), (7, 7), (1, 1), (1000, 3)])
def test_div_partition_tiles_evenly(num_rows, num_shards):
    ranges = div_partition(num_rows, num_shards)
    assert ranges[0][0] == 0 and ranges[-1][1] == num_rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [stop - start for start, stop in ranges]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("num_rows, num_shards", [(3, 4), (5, 0), (-1, 1), (4, 1.0)])
def test_div_partition_rejects_impossible_splits(num_rows, num_shards):
    with pytest.raises(InvalidArgumentError, match="Received: num_"):
        div_partition(num_rows, num_shards)


def test_round_robin_seed_example():
    # Three ps; v2..v5 created in scope land on ps 0, 1, 2, 0.
    placer = RoundRobinPlacer(num_ps=3)
    placements = [placer.place(f"v{i}", (), "float32") for i in range(2, 6)]
    assert [p.device for p in placements] == [
        "/job:ps/replica:0/task:0/device:CPU:0",
        "/job:ps/replica:0/task:1/device:CPU:0",
        "/job:ps/replica:0/task:2/device:CPU:0",
        "/job:ps/replica:0/task:0/device:CPU:0",
    ]
    assert not any(p.is_partitioned for p in placements)
    assert placements[0].shards[0] == ShardPlacement("v2", 0, 0, 0, ())


def test_fixed_shards_seed_example_names_the_parts():
    placer = RoundRobinPlacer(num_ps=2)
    placement = placer.place("w", (100, 10), "float32", FixedShardsPartitioner(num_shards=2))
    assert placement.is_partitioned and placement.num_shards == 2
    assert [s.name for s in placement.shards] == ["w/part_0", "w/part_1"]
    assert [s.shape for s in placement.shards] == [(50, 10), (50, 10)]
    assert [s.ps_index for s in placement.shards] == [0, 1]
    assert placement.device == device_string(0)


def test_thirteen_rows_over_five_shards():
    placement = RoundRobinPlacer(num_ps=3).place("e", (13, 4), "float32", FixedShardsPartitioner(5))
    assert [(s.row_start, s.row_stop) for s in placement.shards] == div_partition(13, 5)
    assert [s.shape for s in placement.shards] == [(3, 4), (3, 4), (3, 4), (2, 4), (2, 4)]
    # Each shard takes the next ps in turn, wrapping around.
    assert [s.ps_index for s in placement.shards] == [0, 1, 2, 0, 1]


def test_shards_and_whole_variables_share_one_counter():
    placer = RoundRobinPlacer(num_ps=3)
    first = placer.place("a", (4,), "float32")
    sharded = placer.place("b", (4, 2), "float32", FixedShardsPartitioner(2))
    after = placer.place("c", (4,), "float32")
    assert first.ps_index == 0
    assert [s.ps_index for s in sharded.shards] == [1, 2]
    assert after.ps_index == 0
    assert placer.num_slots_taken == 4


def test_one_partition_gives_an_unpartitioned_variable_named_as_given():
    placer = RoundRobinPlacer(num_ps=2)
    placement = placer.place("small", (10, 10), "float32", MinSizePartitioner(max_shards=2))
    assert not placement.is_partitioned
    assert placement.shards[0].name == "small"
    assert placement.shards[0].shape == (10, 10)


def test_partitioner_is_not_called_for_scalars_or_empty_variables():
    calls = []

    def partitioner(shape, dtype):
        calls.append(shape)
        return [2] + [1] * (len(shape) - 1)

    placer = RoundRobinPlacer(num_ps=2)
    assert not placer.place("scalar", (), "float32", partitioner).is_partitioned
    assert not placer.place("empty", (0, 3), "float32", partitioner).is_partitioned
    assert calls == []
    assert placer.place("rows", (4, 3), "float32", partitioner).is_partitioned
    assert calls == [(4, 3)]


def test_partitioner_receives_canonical_shape_and_dtype():
    seen = []
    placer = RoundRobinPlacer(num_ps=2)
    placer.place("w", torch.Size([6, 2]), torch.float16, lambda s, d: seen.append((s, d)) or [1, 1])
    assert seen == [((6, 2), "float16")]


def test_colocated_variables_follow_the_target_and_take_no_slot():
    placer = RoundRobinPlacer(num_ps=3)
    placer.place("v0", (), "float32")  # ps 0
    target = placer.place("v1", (8, 2), "float32")  # ps 1
    slot = placer.place("v1/momentum", (8, 2), "float32", FixedShardsPartitioner(4), colocate_with=target)
    assert slot.ps_index == 1 and not slot.is_partitioned
    assert slot.shards[0] == ShardPlacement("v1/momentum", 1, 0, 8, (8, 2))
    assert placer.num_slots_taken == 2
    assert placer.place("v2", (), "float32").ps_index == 2


def test_colocating_with_a_sharded_variable_uses_its_first_shard():
    placer = RoundRobinPlacer(num_ps=3)
    placer.place("a", (), "float32")
    sharded = placer.place("w", (9, 2), "float32", FixedShardsPartitioner(3))  # ps 1, 2, 0
    colocated = placer.place("w_stat", (), "float32", colocate_with=sharded)
    assert colocated.ps_index == 1 and colocated.shards[0].name == "w_stat"


def test_colocate_with_must_be_a_placement_on_this_cluster():
    with pytest.raises(InvalidArgumentError, match="colocate_with"):
        RoundRobinPlacer(2).place("x", (), "float32", colocate_with="w")
    elsewhere = RoundRobinPlacer(5)
    for i in range(4):
        target = elsewhere.place(f"v{i}", (), "float32")
    with pytest.raises(InvalidArgumentError, match="ps_index=3"):
        RoundRobinPlacer(2).place("x", (), "float32", colocate_with=target)


@pytest.mark.parametrize("num_ps", [0, -1, 1.5, None, True])
def test_num_ps_must_be_positive(num_ps):
    with pytest.raises(InvalidArgumentError, match="Received: num_ps="):
        RoundRobinPlacer(num_ps)


@pytest.mark.parametrize(
    "result",
    [[2, 2], [1, 3], [0, 1], [-1, 1], [2], [2, 1, 1], None, [2.0, 1], ["2", 1]],
)
def test_unusable_partitioner_results_are_rejected(result):
    placer = RoundRobinPlacer(num_ps=2)
    with pytest.raises(InvalidArgumentError, match="partitioner") as error:
        placer.place("w", (4, 3), "float32", lambda shape, dtype: result)
    assert "Received: partitions=" in str(error.value)
    assert placer.num_slots_taken == 0  # nothing was placed


def test_more_shards_than_rows_gives_one_shard_per_row():
    # As TensorFlow: `[num_ps, 1]` for a 3-row bias splits it into 3 one-row shards.
    placement = RoundRobinPlacer(num_ps=5).place("b", (3, 2), "float32", lambda shape, dtype: [5, 1])
    assert [(s.row_start, s.row_stop) for s in placement.shards] == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("name, shape, dtype", [("", (2,), "float32"), (None, (2,), "float32"),
                                                ("w", (-1, 2), "float32"), ("w", (2,), "nope")])
def test_invalid_variables_are_rejected(name, shape, dtype):
    with pytest.raises(InvalidArgumentError):
        RoundRobinPlacer(2).place(name, shape, dtype)


def test_concurrent_placement_gives_distinct_complete_slots():
    num_threads, per_thread = 8, 25
    shard_counts = [1, 3, 2]
    total_slots = num_threads * sum(shard_counts[i % len(shard_counts)] for i in range(per_thread))
    # One ps per slot: every slot then names a distinct ps index.
    placer = RoundRobinPlacer(num_ps=total_slots)
    start = threading.Barrier(num_threads)
    results = [[] for _ in range(num_threads)]

    def work(thread_index):
        start.wait(timeout=30)
        for i in range(per_thread):
            num_shards = shard_counts[i % len(shard_counts)]
            partitioner = FixedShardsPartitioner(num_shards)
            results[thread_index].append(
                placer.place(f"t{thread_index}/v{i}", (6, 2), "float32", partitioner)
            )

    threads = [threading.Thread(target=work, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    placements = [p for per_thread_results in results for p in per_thread_results]
    slots = [s.ps_index for p in placements for s in p.shards]
    assert sorted(slots) == list(range(total_slots))
    # The shards of one variable take consecutive slots.
    for placement in placements:
        indices = [s.ps_index for s in placement.shards]
        assert indices == list(range(indices[0], indices[0] + len(indices)))
    assert placer.num_slots_taken == total_slots


def test_variable_placement_checks_its_shards():
    with pytest.raises(InvalidArgumentError, match="tile"):
        VariablePlacement("w", (4, 2), "float32", (ShardPlacement("w/part_0", 0, 0, 2, (2, 2)),
                                                   ShardPlacement("w/part_1", 1, 3, 4, (1, 2))))
    with pytest.raises(InvalidArgumentError, match="cover"):
        VariablePlacement("w", (4, 2), "float32", (ShardPlacement("w", 0, 0, 3, (3, 2)),))
    with pytest.raises(InvalidArgumentError, match="at least one shard"):
        VariablePlacement("w", (4, 2), "float32", ())


def test_shard_for_rows_groups_ids_by_owner():
    placement = RoundRobinPlacer(num_ps=5).place("e", (13, 4), "float32", FixedShardsPartitioner(5))
    ids = np.array([[12, 0, 4], [1, 9, 12]])
    groups = placement.shard_for_rows(ids)
    assert [g.shard_index for g in groups] == [0, 1, 3, 4]
    flat = ids.reshape(-1)
    for group in groups:
        shard = placement.shards[group.shard_index]
        np.testing.assert_array_equal(group.local_ids + shard.row_start, flat[group.positions])
        assert ((group.local_ids >= 0) & (group.local_ids < shard.num_rows)).all()
    assert sorted(p for g in groups for p in g.positions.tolist()) == list(range(flat.size))
    assert groups[0].local_ids.tolist() == [0, 1] and groups[0].positions.tolist() == [1, 3]


def test_shard_for_rows_accepts_lists_tensors_and_empty_ids():
    placement = RoundRobinPlacer(num_ps=2).place("e", (6, 1), "float32", FixedShardsPartitioner(2))
    assert [g.shard_index for g in placement.shard_for_rows(torch.tensor([5, 1]))] == [0, 1]
    assert [g.shard_index for g in placement.shard_for_rows([3])] == [1]
    assert placement.shard_for_rows(np.zeros((0, 3), dtype=np.int64)) == []


@pytest.mark.parametrize("ids", [[6], [-1], [0.5]])
def test_shard_for_rows_rejects_bad_ids(ids):
    placement = RoundRobinPlacer(num_ps=2).place("e", (6, 1), "float32", FixedShardsPartitioner(2))
    with pytest.raises(InvalidArgumentError):
        placement.shard_for_rows(ids)


def test_shard_for_rows_on_a_scalar_is_rejected():
    with pytest.raises(InvalidArgumentError, match="scalar"):
        RoundRobinPlacer(1).place("s", (), "float32").shard_for_rows([0])


def test_placements_are_frozen():
    placement = RoundRobinPlacer(1).place("s", (2,), "float32")
    with pytest.raises(AttributeError):
        placement.name = "t"
    with pytest.raises(AttributeError):
        placement.shards[0].ps_index = 3
