"""Tests for kdist.distribute.strategy against the seed API pages (TF1 and TF2 Strategy)."""

import keras
import numpy as np
import pytest
import torch

import kdist
from kdist.errors import InvalidArgumentError, StrategyScopeError


def mirrored(num_replicas):
    return kdist.MirroredStrategy(devices=[f"cpu:{i}" for i in range(num_replicas)])


@pytest.fixture
def strategy():
    return mirrored(2)


def global_batch_8(strategy):
    """Seed 002: a global batch of 8 over 2 replicas, examples [0..3] and [4..7]."""
    (element,) = strategy.experimental_distribute_dataset([np.arange(8)])
    return element


# ----- merge_call: the seed 003 example with TF2 names ------------------------------------
def merge_fn(strategy, three_plus_replica_id):
    return sum(strategy.experimental_local_results(three_plus_replica_id))


def three_plus_replica_id(three):
    context = kdist.get_replica_context()
    v = three + context.replica_id_in_sync_group
    s = context.merge_call(merge_fn, v)
    return s + v


def test_seed_merge_call_example_with_two_replicas(strategy):
    with strategy.scope():
        merged = strategy.extended.call_for_each_replica(three_plus_replica_id, args=(3,))
        assert strategy.unwrap(merged) == [10, 11]
    assert strategy.experimental_local_results(merged) == (10, 11)
    ran = strategy.run(three_plus_replica_id, args=(3,))
    assert isinstance(ran, kdist.PerReplica)
    assert strategy.experimental_local_results(ran) == (10, 11)


def test_seed_merge_call_example_with_three_replicas():
    strategy = mirrored(3)
    # v = 3, 4, 5 and s = 12.
    assert strategy.unwrap(strategy.run(three_plus_replica_id, args=(3,))) == [15, 16, 17]


def test_seed_merge_call_example_with_tensors(strategy):
    result = strategy.run(three_plus_replica_id, args=(torch.tensor(3),))
    assert [t.item() for t in strategy.experimental_local_results(result)] == [10, 11]


# ----- reduce: axis semantics of seed 002 -------------------------------------------------
def test_reduce_axis_none_adds_across_replicas_elementwise(strategy):
    total = strategy.reduce("sum", global_batch_8(strategy), axis=None)
    assert total.tolist() == [4, 6, 8, 10]


def test_reduce_axis_0_reduces_the_global_batch(strategy):
    values = global_batch_8(strategy)
    assert strategy.reduce("sum", values, axis=0).item() == 28
    assert strategy.reduce("mean", values, axis=0).item() == 3.5
    floats = kdist.PerReplica([torch.arange(4.0), torch.arange(4.0, 8.0)])
    assert strategy.reduce("mean", floats, axis=0).item() == 3.5
    assert strategy.reduce("mean", floats, axis=None).tolist() == [2.0, 3.0, 4.0, 5.0]


def test_reduce_mean_of_integer_flags_does_not_truncate(strategy):
    correct = kdist.PerReplica([torch.tensor([1, 0, 0]), torch.tensor([0, 0, 1])])
    assert strategy.reduce("mean", correct, axis=0).item() == pytest.approx(1 / 3)


def test_partial_batch_split_evenly_mean_uses_the_global_denominator(strategy):
    (values,) = strategy.experimental_distribute_dataset([np.arange(6)])
    assert [v.tolist() for v in values.values] == [[0, 1, 2], [3, 4, 5]]
    assert strategy.reduce("mean", values, axis=0).item() == 2.5
    assert strategy.reduce("sum", values, axis=0).item() == 15


def test_partial_batch_split_the_tensorflow_way(strategy):
    uneven = kdist.PerReplica([torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0])])
    assert strategy.reduce("mean", uneven, axis=0).item() == 2.5  # denominator 6
    # Contrast: averaging per-replica means weighs examples 1/8 and 1/4.
    means = kdist.PerReplica([v.mean() for v in uneven.values])
    assert strategy.reduce("mean", means, axis=None).item() == 3.0
    with pytest.raises(InvalidArgumentError, match=r"\(4,\), \(2,\)"):
        strategy.reduce("sum", uneven, axis=None)


def test_seed_step_fn_reduce_lands_on_the_host(strategy):
    def step_fn():
        return torch.tensor(kdist.get_replica_context().replica_id_in_sync_group)

    per_replica_result = strategy.run(step_fn)
    total = strategy.reduce("SUM", per_replica_result, axis=None)
    assert total.item() == 1
    assert total.device == torch.device("cpu")


@pytest.mark.parametrize("op", ["sum", "SUM", "Sum", kdist.ReduceOp.SUM])
def test_reduce_accepts_names_in_any_case(strategy, op):
    values = kdist.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    assert strategy.reduce(op, values, axis=None).item() == 3.0


@pytest.mark.parametrize("op", ["Mean", "mean", kdist.ReduceOp.MEAN])
def test_reduce_mean_names(strategy, op):
    values = kdist.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    assert strategy.reduce(op, values, axis=None).item() == 1.5


def test_reduce_rejects_an_unknown_op(strategy):
    with pytest.raises(InvalidArgumentError, match="reduce_op='max'"):
        strategy.reduce("max", kdist.PerReplica([1, 2]), axis=None)


def test_reduce_of_a_plain_tensor(strategy):
    plain = torch.tensor([1.0, 3.0])
    with pytest.raises(InvalidArgumentError, match="cannot be summed"):
        strategy.reduce("sum", plain, axis=None)
    assert strategy.reduce("mean", plain, axis=None).tolist() == [1.0, 3.0]
    assert strategy.reduce("mean", plain, axis=0).item() == 2.0


def test_reduce_a_structure_leaf_by_leaf(strategy):
    result = strategy.run(
        lambda: {"ids": torch.tensor([kdist.get_replica_context().replica_id_in_sync_group])}
    )
    reduced = strategy.reduce("sum", (result, result), axis=0)
    assert reduced[0]["ids"].item() == 1 and reduced[1]["ids"].item() == 1


def test_cross_replica_apis_refuse_a_replica_context(strategy):
    values = kdist.PerReplica([torch.ones(1), torch.ones(1)])
    for call in (
        lambda: strategy.reduce("sum", values, axis=None),
        lambda: strategy.gather(values, axis=0),
        lambda: strategy.run(lambda: None),
    ):
        with pytest.raises(StrategyScopeError, match="cross-replica context"):
            strategy.run(call)


# ----- gather -----------------------------------------------------------------------------
def test_seed_gather_example(strategy):
    values = strategy.experimental_distribute_values_from_function(
        lambda _: torch.tensor([[1], [2]])
    )
    gathered = strategy.gather(values, axis=0)
    assert gathered.tolist() == [[1], [2], [1], [2]]
    assert gathered.device == torch.device("cpu")


def test_seed_gather_combinations_with_four_replicas():
    strategy = mirrored(4)
    single_tensor = torch.arange(6).reshape(1, 2, 3)
    values = strategy.experimental_distribute_values_from_function(lambda _: single_tensor)
    assert strategy.gather(values, axis=0).shape == (4, 2, 3)
    assert strategy.gather(values, axis=1).tolist() == [[[0, 1, 2], [3, 4, 5]] * 4]
    assert strategy.gather(values, axis=2).tolist() == [[[0, 1, 2] * 4, [3, 4, 5] * 4]]


def test_gather_components_may_differ_only_along_axis(strategy):
    values = kdist.PerReplica([torch.zeros(1, 2, 3), torch.ones(1, 3, 3)])
    assert strategy.gather(values, axis=1).shape == (1, 5, 3)
    for axis in (0, 2):
        with pytest.raises(InvalidArgumentError, match=f"axis={axis}"):
            strategy.gather(values, axis=axis)


def test_gather_rejects_scalars_and_out_of_range_axes(strategy):
    scalars = strategy.experimental_distribute_values_from_function(lambda _: torch.tensor(1))
    with pytest.raises(InvalidArgumentError, match="rank >= 1"):
        strategy.gather(scalars, axis=0)
    vectors = kdist.PerReplica([torch.zeros(2), torch.zeros(2)])
    with pytest.raises(InvalidArgumentError, match="axis=1"):
        strategy.gather(vectors, axis=1)


# ----- extended ---------------------------------------------------------------------------
def test_extended_devices(strategy):
    extended = strategy.extended
    assert extended.worker_devices == ("cpu:0", "cpu:1")
    assert extended.parameter_devices == ("cpu:0",)
    assert extended.non_slot_devices([]) == ("cpu:0",)
    assert strategy.num_replicas_in_sync == 2
    assert repr(strategy) == "MirroredStrategy(devices=['cpu:0', 'cpu:1'])"


def test_one_process_strategies_are_their_own_chief(strategy):
    """Roles are computed on the extended once; one process checkpoints and trains in place."""
    for extended in (strategy.extended, kdist.get_strategy().extended):
        assert extended.is_chief and extended.should_checkpoint and extended.should_save_summary
        assert not extended.drives_workers
        assert extended.should_init and not extended.experimental_between_graph


def test_reduce_to_one_or_several_destinations(strategy):
    values = kdist.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    extended = strategy.extended
    assert extended.reduce_to("sum", values, "cpu:0").tolist() == [4.0, 6.0]
    mirrored_result = extended.reduce_to("mean", values, ["cpu:0", "cpu:1"])
    assert isinstance(mirrored_result, kdist.Mirrored)
    assert [v.tolist() for v in mirrored_result.values] == [[2.0, 3.0], [2.0, 3.0]]
    assert mirrored_result.values[0] is not mirrored_result.values[1]
    assert len(extended.reduce_to("sum", values, values).values) == 2  # replica devices
    variable = keras.Variable([0.0, 0.0])
    assert extended.reduce_to("sum", values, variable).tolist() == [4.0, 6.0]


def test_batch_reduce_to(strategy):
    values = kdist.PerReplica([torch.tensor(1.0), torch.tensor(5.0)])
    one, several = strategy.extended.batch_reduce_to(
        "sum", [(values, "cpu:0"), (values, ["cpu:0", "cpu:1"])]
    )
    assert one.item() == 6.0
    assert [v.item() for v in several.values] == [6.0, 6.0]


def test_broadcast_to(strategy):
    copies = strategy.extended.broadcast_to(torch.tensor(7.0), ["cpu:0", "cpu:1"])
    assert isinstance(copies, kdist.Mirrored)
    assert [c.item() for c in copies.values] == [7.0, 7.0]
    with pytest.raises(InvalidArgumentError, match="destinations entry 'tpu:0'"):
        strategy.extended.broadcast_to(torch.tensor(7.0), ["tpu:0"])


def test_update_runs_fn_on_the_variable(strategy):
    with strategy.scope():
        variable = keras.Variable(1.0)
    extended = strategy.extended
    extended.update(variable, lambda var, delta: var.assign_add(delta), args=(2.0,))
    assert float(variable.numpy()) == 3.0
    same_everywhere = kdist.Mirrored([torch.tensor(4.0), torch.tensor(4.0)])
    extended.update(variable, lambda var, delta: var.assign_add(delta), args=(same_everywhere,))
    assert float(variable.numpy()) == 7.0
    result = extended.update(variable, lambda var: var.assign(0.5), group=False)
    assert isinstance(result, tuple) and len(result) == 1
    assert float(variable.numpy()) == 0.5


def test_update_refuses_per_replica_arguments(strategy):
    variable = keras.Variable(1.0)
    per_replica = kdist.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(InvalidArgumentError, match="PerReplica"):
        strategy.extended.update(variable, lambda var, d: var.assign_add(d), args=(per_replica,))
    with pytest.raises(InvalidArgumentError, match="PerReplica"):
        strategy.extended.update(
            variable, lambda var, d: var.assign_add(d), kwargs={"d": per_replica}
        )
    assert float(variable.numpy()) == 1.0


def test_colocate_vars_with_needs_the_scope(strategy):
    with strategy.scope():
        first = keras.Variable(1.0)
        with strategy.extended.colocate_vars_with(first):
            assert strategy.extended.colocation_target is first
        assert strategy.extended.colocation_target is None
    with pytest.raises(StrategyScopeError, match="inside the strategy's scope"):
        with strategy.extended.colocate_vars_with(first):
            pass  # pragma: no cover


def test_call_for_each_replica_unwraps_args_and_kwargs(strategy):
    xs = kdist.PerReplica([1, 2])
    result = strategy.extended.call_for_each_replica(
        lambda x, y: x * y, args=(xs,), kwargs={"y": kdist.PerReplica([10, 100])}
    )
    assert strategy.experimental_local_results(result) == (10, 200)
