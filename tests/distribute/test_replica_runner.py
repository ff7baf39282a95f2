"""Tests for kdist.distribute.replica_runner: threads, merge_call, errors, regrouping."""

import collections
import threading

import pytest
import torch

import kdist
from kdist.errors import InvalidArgumentError, ReplicaSyncError, StrategyScopeError

Output = collections.namedtuple("Output", ["loss", "name"])


def mirrored(num_replicas):
    return kdist.MirroredStrategy(devices=[f"cpu:{i}" for i in range(num_replicas)])


@pytest.fixture
def strategy():
    return mirrored(3)


def replica_id():
    return kdist.get_replica_context().replica_id_in_sync_group


def live_replica_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("kdist-replica")]


@pytest.fixture(autouse=True)
def no_leftover_threads():
    assert live_replica_threads() == []
    yield
    assert live_replica_threads() == []


# ----- errors -----------------------------------------------------------------------------
def test_an_exception_in_one_replica_propagates(strategy):
    def fn():
        if replica_id() == 1:
            raise KeyError("replica 1 failed")
        return replica_id()

    with pytest.raises(KeyError, match="replica 1 failed"):
        strategy.run(fn)


def test_the_first_replicas_exception_wins(strategy):
    class ReplicaError(Exception):
        pass

    def fn():
        if replica_id() > 0:
            raise ReplicaError(replica_id())

    with pytest.raises(ReplicaError) as info:
        strategy.run(fn)
    assert info.value.args == (1,)


def test_an_exception_while_others_wait_in_merge_call(strategy):
    def fn():
        context = kdist.get_replica_context()
        context.merge_call(lambda s: None)
        if replica_id() == 2:
            raise RuntimeError("after the first merge")
        return context.merge_call(lambda s: "second")

    with pytest.raises(RuntimeError, match="after the first merge"):
        strategy.run(fn)


def test_an_exception_in_merge_fn_propagates(strategy):
    def merge_fn(strategy):
        raise ZeroDivisionError("in merge_fn")

    with pytest.raises(ZeroDivisionError, match="in merge_fn"):
        strategy.run(lambda: kdist.get_replica_context().merge_call(merge_fn))


def test_replicas_that_disagree_about_merge_call_raise(strategy):
    def fn():
        if replica_id() == 1:
            return "returned"
        return kdist.get_replica_context().merge_call(lambda s: "merged")

    with pytest.raises(ReplicaSyncError, match=r"replicas \[1\] finished, replicas \[0, 2\]"):
        strategy.run(fn)


def test_merge_call_with_different_functions_raises(strategy):
    def first(s):
        return 1

    def second(s):
        return 2

    def fn():
        return kdist.get_replica_context().merge_call(first if replica_id() == 0 else second)

    with pytest.raises(ReplicaSyncError, match="different functions"):
        strategy.run(fn)


def test_the_strategy_still_works_after_a_failed_run(strategy):
    with pytest.raises(ValueError):
        strategy.run(lambda: (_ for _ in ()).throw(ValueError("boom")))
    assert strategy.unwrap(strategy.run(replica_id)) == [0, 1, 2]
    assert not kdist.has_strategy()


def test_run_inside_run_raises(strategy):
    with pytest.raises(StrategyScopeError, match="call_for_each_replica"):
        strategy.run(lambda: strategy.run(replica_id))


def test_distributed_arguments_must_match_the_replica_count(strategy):
    with pytest.raises(InvalidArgumentError, match="2 components.*3 replicas"):
        strategy.run(lambda x: x, args=(kdist.PerReplica([1, 2]),))
    with pytest.raises(InvalidArgumentError, match="4 components.*1 replicas"):
        mirrored(1).run(lambda x: x, kwargs={"x": kdist.PerReplica([1, 2, 3, 4])})


# ----- scheduling -------------------------------------------------------------------------
def test_each_replica_runs_in_its_own_thread(strategy):
    names = strategy.run(lambda: threading.current_thread().name)
    assert strategy.unwrap(names) == ["kdist-replica-0", "kdist-replica-1", "kdist-replica-2"]


def test_replicas_run_one_at_a_time_in_replica_order(strategy):
    log = []

    def fn():
        log.append(("before", replica_id()))
        kdist.get_replica_context().merge_call(lambda s: log.append(("merge",)))
        log.append(("after", replica_id()))

    strategy.run(fn)
    assert log == [
        ("before", 0), ("before", 1), ("before", 2),
        ("merge",),
        ("after", 0), ("after", 1), ("after", 2),
    ]  # fmt: skip


def test_several_merge_calls_in_sequence(strategy):
    def fn():
        context = kdist.get_replica_context()
        total = context.merge_call(lambda s, x: sum(s.unwrap(x)), args=(replica_id() + 1,))
        scaled = total * (replica_id() + 1)
        weighted = context.merge_call(lambda s, x: sum(s.unwrap(x)), args=(scaled,))
        return total, weighted

    # Every replica gets the same merged objects back, so the result is not distributed.
    assert strategy.run(fn) == (6, 36)


def test_merge_fn_results_are_unwrapped_per_replica(strategy):
    def merge_fn(s, values, scale=1):
        return kdist.PerReplica([v * scale for v in s.unwrap(values)][::-1])

    def fn():
        return kdist.get_replica_context().merge_call(
            merge_fn, args=(replica_id(),), kwargs={"scale": 10}
        )

    assert strategy.unwrap(strategy.run(fn)) == [20, 10, 0]


def test_one_replica_runs_inline_and_merges_at_once():
    strategy = mirrored(1)

    def fn(x):
        in_thread = threading.current_thread() is threading.main_thread()
        return kdist.get_replica_context().merge_call(lambda s, v: (v * 2, in_thread), args=(x,))

    assert strategy.run(fn, args=(kdist.PerReplica([4]),)) == (8, True)


# ----- regrouping of results --------------------------------------------------------------
def test_run_returns_the_object_every_replica_returned(strategy):
    shared = torch.ones(2)
    assert strategy.run(lambda: shared) is shared
    assert strategy.run(lambda x: x, args=(shared,)) is shared


def test_run_regroups_nested_results_leaf_wise(strategy):
    shared = object()

    def fn():
        return {
            "pair": (shared, replica_id()),
            "output": Output(loss=torch.tensor(float(replica_id())), name="same"),
        }

    result = strategy.run(fn)
    assert result["pair"][0] is shared
    assert isinstance(result["pair"][1], kdist.PerReplica)
    assert result["pair"][1].values == (0, 1, 2)
    assert type(result["output"]) is Output
    assert [t.item() for t in result["output"].loss.values] == [0.0, 1.0, 2.0]
    assert result["output"].name == "same"
