"""Bad arguments to the coordinator: typed errors naming the argument; nothing starts."""

import pytest

import kdist
import kdist.coordinator
from kdist.cluster import SimpleClusterResolver
from kdist.errors import InvalidArgumentError

# Nothing listens on these ports: dispatchers retry in the background until shut down.
CLUSTER = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}


@pytest.fixture
def coordinator():
    strategy = kdist.ParameterServerStrategy(SimpleClusterResolver(CLUSTER, task_type="chief", task_id=0))
    coordinator = kdist.coordinator.ClusterCoordinator(strategy, worker_retry_seconds=0.1)
    yield coordinator
    coordinator.shutdown()


def test_needs_a_parameter_server_strategy():
    with pytest.raises(InvalidArgumentError, match="ParameterServerStrategy"):
        kdist.coordinator.ClusterCoordinator(kdist.MirroredStrategy(["cpu:0"]))


def test_needs_worker_tasks():
    cluster = {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:3"]}
    strategy = kdist.ParameterServerStrategy(SimpleClusterResolver(cluster, task_type="chief", task_id=0))
    with pytest.raises(InvalidArgumentError, match="'worker' tasks"):
        kdist.coordinator.ClusterCoordinator(strategy)


@pytest.mark.parametrize("name", ["worker_retry_seconds", "ps_unavailable_seconds", "closures_in_flight_per_worker"])
@pytest.mark.parametrize("value", [0, -1, "1", True])
def test_durations_must_be_positive_numbers(name, value):
    strategy = kdist.ParameterServerStrategy(SimpleClusterResolver(CLUSTER, task_type="chief", task_id=0))
    with pytest.raises(InvalidArgumentError, match=name):
        kdist.coordinator.ClusterCoordinator(strategy, **{name: value})
    assert strategy.extended._cluster_coordinator is None


def test_schedule_checks_its_arguments_and_queues_nothing(coordinator):
    with pytest.raises(InvalidArgumentError, match="fn must be callable"):
        coordinator.schedule(3)
    with pytest.raises(InvalidArgumentError, match="args must be a tuple"):
        coordinator.schedule(print, args=3)
    with pytest.raises(InvalidArgumentError, match="kwargs must be a dict"):
        coordinator.schedule(print, kwargs=[1])
    assert coordinator.done()
    assert coordinator.stats["closures_scheduled"] == 0


def test_per_worker_iterators_yield_only_on_workers(coordinator):
    iterator = iter(coordinator.create_per_worker_dataset(lambda: iter([1, 2])))
    with pytest.raises(InvalidArgumentError, match="only on workers"):
        next(iterator)
    with pytest.raises(InvalidArgumentError, match="dataset_fn must be a callable"):
        coordinator.create_per_worker_dataset([1, 2])
