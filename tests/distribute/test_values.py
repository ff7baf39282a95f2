"""Tests for kdist.distribute.values and the Strategy methods that build or unwrap them."""

import collections

import numpy as np
import pytest
import torch

import kdist
from kdist.distribute.values import (
    Mirrored,
    PerReplica,
    check_num_components,
    local_results,
    regroup,
    select_replica,
)
from kdist.errors import InvalidArgumentError

Pair = collections.namedtuple("Pair", ["first", "second"])


@pytest.fixture
def strategy():
    return kdist.MirroredStrategy(devices=["cpu:0", "cpu:1"])


# ----- the containers ---------------------------------------------------------------------
@pytest.mark.parametrize("cls", [PerReplica, Mirrored])
def test_distributed_values_hold_components_in_replica_order(cls):
    value = cls([10, 11, 12])
    assert value.values == (10, 11, 12)
    assert len(value) == 3
    assert isinstance(value, kdist.DistributedValues)
    assert repr(value) == f"{cls.__name__}:{{\n  0: 10,\n  1: 11,\n  2: 12\n}}"


@pytest.mark.parametrize("cls", [PerReplica, Mirrored])
def test_distributed_values_need_a_component(cls):
    with pytest.raises(InvalidArgumentError, match=f"{cls.__name__} needs at least one"):
        cls([])


def test_local_results_of_plain_and_distributed_values():
    plain = torch.ones(2)
    assert local_results(plain) == (plain,)
    assert local_results(PerReplica([1, 2])) == (1, 2)


def test_select_replica_picks_components_in_a_nested_structure():
    structure = {"x": PerReplica(["x0", "x1"]), "y": ("shared", Mirrored(["m0", "m1"]))}
    assert select_replica(1, structure) == {"x": "x1", "y": ("shared", "m1")}
    assert select_replica(0, structure) == {"x": "x0", "y": ("shared", "m0")}


# ----- regroup ----------------------------------------------------------------------------
def test_regroup_keeps_an_object_shared_by_every_replica():
    shared = object()
    assert regroup([shared, shared]) is shared


def test_regroup_wraps_differing_leaves_and_keeps_structure():
    shared = torch.zeros(1)
    merged = regroup([(shared, {"loss": 0.5}), (shared, {"loss": 0.25})])
    assert isinstance(merged, tuple) and merged[0] is shared
    assert isinstance(merged[1]["loss"], PerReplica)
    assert merged[1]["loss"].values == (0.5, 0.25)


def test_regroup_equal_but_distinct_objects_are_per_replica():
    # Equality is not identity: two replicas' equal tensors are still two values.
    merged = regroup([torch.tensor(1.0), torch.tensor(1.0)])
    assert isinstance(merged, PerReplica)


def test_regroup_keeps_namedtuples_and_honours_wrap():
    merged = regroup([Pair(1.5, "a"), Pair(2.5, "b")], wrap=Mirrored)
    assert type(merged) is Pair
    assert isinstance(merged.first, Mirrored) and merged.first.values == (1.5, 2.5)


def test_regroup_of_one_replica_returns_its_structure():
    structure = {"a": [1, 2]}
    assert regroup([structure]) is structure


def test_regroup_rejects_structures_that_differ():
    with pytest.raises(InvalidArgumentError, match="Structures differ"):
        regroup([(1, 2), (1, 2, 3)])
    with pytest.raises(InvalidArgumentError, match="Structures differ"):
        regroup([{"a": 1}, {"b": 1}])


def test_check_num_components_rejects_values_of_another_strategy():
    check_num_components((PerReplica([1, 2]), {"k": 3}), 2, "args")
    with pytest.raises(InvalidArgumentError, match="3 components.*2 replicas"):
        check_num_components((PerReplica([1, 2, 3]),), 2, "args")


# ----- Strategy.experimental_local_results / unwrap ---------------------------------------
def test_experimental_local_results_and_unwrap(strategy):
    per_replica = strategy.run(lambda: kdist.get_replica_context().replica_id_in_sync_group)
    assert strategy.experimental_local_results(per_replica) == (0, 1)
    assert strategy.unwrap(per_replica) == [0, 1]
    plain = torch.ones(1)
    assert strategy.experimental_local_results(plain) == (plain,)
    assert strategy.unwrap(plain) == [plain]


def test_experimental_local_results_of_a_structure_gives_one_structure_per_replica(strategy):
    result = strategy.run(lambda: {"id": kdist.get_replica_context().replica_id_in_sync_group})
    assert strategy.experimental_local_results(result) == ({"id": 0}, {"id": 1})


# ----- experimental_distribute_values_from_function (seed examples) -----------------------
def test_values_from_function_constant(strategy):
    values = strategy.experimental_distribute_values_from_function(lambda ctx: torch.tensor(1.0))
    results = strategy.experimental_local_results(values)
    assert len(results) == 2
    assert all(isinstance(r, torch.Tensor) and r.item() == 1.0 for r in results)


def test_values_from_function_by_replica_id(strategy):
    array_value = np.array([3.0, 2.0, 1.0])
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: array_value[ctx.replica_id_in_sync_group]
    )
    assert strategy.experimental_local_results(values) == (3.0, 2.0)


def test_values_from_function_num_replicas_in_sync(strategy):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.num_replicas_in_sync
    )
    assert strategy.experimental_local_results(values) == (2, 2)


def test_values_from_function_passes_a_value_context_per_replica():
    strategy = kdist.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    contexts = []
    strategy.experimental_distribute_values_from_function(contexts.append)
    assert contexts == [kdist.ValueContext(i, 3) for i in range(3)]


def test_values_from_function_feed_run(strategy):
    # Seed example 2 of `run`: each replica doubles num_replicas_in_sync.
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.num_replicas_in_sync
    )
    result = strategy.run(lambda value: value * 2, args=(values,))
    assert set(strategy.experimental_local_results(result)) == {4}


def test_values_from_function_on_one_replica_returns_the_value():
    strategy = kdist.MirroredStrategy(devices=["cpu:0"])
    assert strategy.experimental_distribute_values_from_function(lambda ctx: "only") == "only"
