"""Tests for kdist.distribute.context: current strategy, replica vs cross-replica context."""

import threading

import keras
import pytest
import torch

import kdist
from kdist.distribute.default_strategy import DefaultStrategy
from kdist.errors import StrategyScopeError


@pytest.fixture
def strategy():
    return kdist.MirroredStrategy(devices=["cpu:0", "cpu:1"])


def snapshot():
    replica_context = kdist.get_replica_context()
    return {
        "strategy": kdist.get_strategy(),
        "has_strategy": kdist.has_strategy(),
        "cross_replica": kdist.in_cross_replica_context(),
        "replica_context": replica_context,
        "replica_id": getattr(replica_context, "replica_id_in_sync_group", None),
        "num_replicas": getattr(replica_context, "num_replicas_in_sync", None),
        "cross_replica_context": kdist.get_cross_replica_context(),
    }


def assert_default_context(state):
    assert isinstance(state["strategy"], DefaultStrategy)
    assert state["has_strategy"] is False
    assert state["cross_replica"] is False
    assert isinstance(state["replica_context"], kdist.ReplicaContext)
    assert (state["replica_id"], state["num_replicas"]) == (0, 1)
    assert state["cross_replica_context"] is None


# ----- outside every scope ----------------------------------------------------------------
def test_outside_any_scope_the_default_strategy_is_current():
    state = snapshot()
    assert_default_context(state)
    assert kdist.get_strategy() is state["strategy"]  # one process-wide instance
    assert state["replica_context"].strategy is state["strategy"]


def test_default_replica_context_can_communicate_as_one_replica():
    context = kdist.get_replica_context()
    assert context.all_reduce("sum", torch.tensor(3.0)).item() == 3.0
    assert context.all_gather(torch.tensor([1.0, 2.0]), axis=0).tolist() == [1.0, 2.0]
    assert context.devices == (kdist.get_strategy().extended.worker_devices[0],)

    def merge_fn(strategy, value):
        assert kdist.in_cross_replica_context()
        return (strategy, value + 1)

    merged_strategy, merged = context.merge_call(merge_fn, args=(1,))
    assert merged_strategy is kdist.get_strategy() and merged == 2
    assert_default_context(snapshot())


def test_default_strategy_reports_one_device():
    default = kdist.get_strategy()
    assert default.num_replicas_in_sync == 1
    assert len(default.extended.worker_devices) == 1
    assert default.extended.parameter_devices == default.extended.worker_devices
    assert default.run(lambda x: x + 1, args=(1,)) == 2
    assert default.gather(torch.tensor([1.0, 2.0]), axis=0).tolist() == [1.0, 2.0]
    assert default.reduce("sum", torch.tensor(2.0), axis=None).item() == 2.0


# ----- inside scope() ---------------------------------------------------------------------
def test_inside_scope_is_the_cross_replica_context(strategy):
    with strategy.scope() as entered:
        state = snapshot()
    assert entered is strategy
    assert state["strategy"] is strategy
    assert state["has_strategy"] is True
    assert state["cross_replica"] is True
    assert state["replica_context"] is None
    assert state["cross_replica_context"] is strategy
    assert_default_context(snapshot())


def test_nested_reentry_of_the_same_strategy(strategy):
    scope = strategy.scope()
    with scope:
        with strategy.scope():
            with scope:
                assert kdist.get_cross_replica_context() is strategy
        assert kdist.get_strategy() is strategy
    assert not kdist.has_strategy()


def test_another_strategys_scope_inside_one_raises(strategy):
    other = kdist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        with pytest.raises(StrategyScopeError, match="Mixing different strategies"):
            with other.scope():
                pass  # pragma: no cover
        assert kdist.get_strategy() is strategy  # the failed entry left no frame
        with pytest.raises(StrategyScopeError):
            other.run(lambda: None)
    assert not kdist.has_strategy()
    with other.scope():  # each is fine on its own
        assert kdist.get_strategy() is other


def test_clear_session_inside_a_scope_keeps_the_strategy(strategy):
    with strategy.scope():
        keras.backend.clear_session()
        assert kdist.get_strategy() is strategy
        assert kdist.in_cross_replica_context()
    assert not kdist.has_strategy()


def test_the_current_strategy_is_per_thread(strategy):
    seen = {}
    entered, release = threading.Event(), threading.Event()

    def other_thread():
        seen["before"] = snapshot()
        with strategy.scope():
            seen["inside"] = kdist.get_strategy()
            entered.set()
            release.wait(timeout=10)

    with strategy.scope():
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert entered.wait(timeout=10)
    # The other thread is still inside its scope; this thread is not.
    main_state = snapshot()
    release.set()
    thread.join(timeout=10)
    assert_default_context(seen["before"])
    assert seen["inside"] is strategy
    assert_default_context(main_state)


# ----- inside run() -----------------------------------------------------------------------
def test_inside_run_is_a_replica_context(strategy):
    result = strategy.run(snapshot)
    states = strategy.experimental_local_results(result)
    assert [s["replica_id"] for s in states] == [0, 1]
    for state in states:
        assert state["strategy"] is strategy
        assert state["has_strategy"] is True
        assert state["cross_replica"] is False
        assert state["num_replicas"] == 2
        assert state["cross_replica_context"] is None
        assert state["replica_context"].strategy is strategy


def test_replica_context_devices(strategy):
    devices = strategy.run(lambda: kdist.get_replica_context().devices)
    assert strategy.experimental_local_results(devices) == (("cpu:0",), ("cpu:1",))


def test_reentering_the_scope_inside_run_keeps_the_replica_context(strategy):
    def fn():
        with strategy.scope():
            return kdist.get_replica_context().replica_id_in_sync_group

    assert strategy.experimental_local_results(strategy.run(fn)) == (0, 1)


def test_merge_fn_runs_in_the_cross_replica_context(strategy):
    def fn():
        return kdist.get_replica_context().merge_call(lambda s: snapshot())

    state = strategy.run(fn)  # every replica gets the same merged object
    assert state["cross_replica"] is True
    assert state["replica_context"] is None
    assert state["cross_replica_context"] is strategy


# ----- all_reduce / all_gather ------------------------------------------------------------
def test_all_reduce_seed_example_sums_replica_ids(strategy):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(ctx.replica_id_in_sync_group)
    )
    result = strategy.run(
        lambda value: kdist.get_replica_context().all_reduce("sum", value), args=(values,)
    )
    assert isinstance(result, kdist.PerReplica)
    assert [r.item() for r in strategy.experimental_local_results(result)] == [1, 1]


def test_all_reduce_mean_of_a_structure_and_of_a_shared_constant():
    strategy = kdist.MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])

    def fn():
        context = kdist.get_replica_context()
        replica_id = float(context.replica_id_in_sync_group)
        structure = {"a": torch.tensor([replica_id]), "b": (torch.tensor(2 * replica_id),)}
        # The constant 1 is one object passed by every replica: it counts once per replica.
        return context.all_reduce("mean", structure), context.all_reduce("SUM", 1)

    for means, count in strategy.experimental_local_results(strategy.run(fn)):
        assert means["a"].tolist() == [1.0] and means["b"][0].item() == 2.0
        assert count.item() == 3


def test_all_reduce_gives_each_replica_its_own_tensor(strategy):
    def fn():
        context = kdist.get_replica_context()
        total = context.all_reduce("sum", torch.tensor([1.0]))
        if context.replica_id_in_sync_group == 0:
            total.mul_(100.0)  # must not leak into replica 1's result
        context.merge_call(lambda s: None)  # replica 1 reads after replica 0 wrote
        return total.clone()

    results = strategy.experimental_local_results(strategy.run(fn))
    assert [r.item() for r in results] == [200.0, 2.0]


def test_all_gather_along_axis_0_and_1(strategy):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([[ctx.replica_id_in_sync_group, 10]])
    )

    def fn(value):
        context = kdist.get_replica_context()
        return context.all_gather(value, axis=0), context.all_gather(value, axis=1)

    for rows, columns in strategy.experimental_local_results(strategy.run(fn, args=(values,))):
        assert rows.tolist() == [[0, 10], [1, 10]]
        assert columns.tolist() == [[0, 10, 1, 10]]
