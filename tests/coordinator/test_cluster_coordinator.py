"""ClusterCoordinator against real `kdist server` processes on loopback."""

import numpy as np
import pytest

import kdist
import kdist.coordinator
from kdist.coordinator import RemoteValueStatus
from tests.coordinator import _cluster, _failing, _functions

pytestmark = pytest.mark.timeout(300)


def test_custom_loop_trains_and_applies_each_scheduled_step_once(tmp_path):
    steps_per_epoch, epochs = 60, 5
    with _cluster.start(num_workers=2, num_ps=1, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        coordinator = kdist.coordinator.ClusterCoordinator(strategy)
        assert kdist.coordinator.ClusterCoordinator(strategy) is coordinator
        per_worker_dataset = coordinator.create_per_worker_dataset(_functions.dataset_fn)
        model, optimizer, accuracy, worker_fn = _functions.train_state(strategy)
        losses = []
        for _ in range(epochs):
            iterator = iter(per_worker_dataset)
            accuracy.reset_state()
            values = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(steps_per_epoch)]
            coordinator.join()
            assert coordinator.done()
            assert all(value.status is RemoteValueStatus.READY for value in values)
            losses.append(float(np.mean(coordinator.fetch(values))))
            # Every closure's metric update counted once on the chief.
            assert float(accuracy.count.numpy()) == steps_per_epoch * _functions.BATCH
        x_test, y_test = _functions.make_digits(500, seed=7)
        test_accuracy = _functions.accuracy_of(model, x_test, y_test)
        stats = coordinator.stats
        [ps_stats] = cluster.ps_stats()
        coordinator.shutdown()
    assert losses[-1] < losses[0]
    # Asynchronous: how stale each push is depends on scheduling, and 15 runs on
    # 2 busy cores ended between 0.77 and 0.91 (an untrained model: about 0.1).
    assert test_accuracy >= 0.7, (test_accuracy, losses)
    assert stats["closures_done"] == steps_per_epoch * epochs
    # Two Dense layers: four variables, each updated once per scheduled step.
    assert len(ps_stats.variables) == 4
    assert {v.applied_updates for v in ps_stats.variables.values()} == {steps_per_epoch * epochs}


def test_a_closure_pulls_only_the_variables_it_references(tmp_path):
    """One pull per closure that carries the model; none for a closure that carries no variables."""
    x, _ = _functions.make_digits(4, seed=3)
    with _cluster.start(num_workers=1, num_ps=1, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        coordinator = kdist.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = _functions.build_model()
        # The worker's session holds the model from now on.
        assert coordinator.schedule(_functions.predict_shape, args=(model, x)).fetch() == (4, 10)
        coordinator.join()

        def pulls():
            return cluster.ps_stats()[0].requests.get("pull", 0)

        before = pulls()
        values = [coordinator.schedule(_failing.work, args=(0.0, index)) for index in range(5)]
        coordinator.join()  # the chief's own refresh: one pull
        after_plain = pulls()
        for _ in range(3):
            coordinator.schedule(_functions.predict_shape, args=(model, x))
        coordinator.join()
        after_model = pulls()
        coordinator.shutdown()
    assert coordinator.fetch(values) == list(range(5))
    assert after_plain - before == 1
    assert after_model - after_plain == 3 + 1


def test_a_programming_error_in_the_parameter_server_watch_is_raised_not_swallowed():
    # Nothing listens: a scheduled closure stays queued until the watch's error fails the queue.
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    strategy = kdist.ParameterServerStrategy(
        kdist.cluster.SimpleClusterResolver(cluster, task_type="chief", task_id=0))
    [client] = strategy.extended.variable_router.clients

    def broken_health(timeout=None):
        raise TypeError("a bug in the health check")

    client.health = broken_health
    coordinator = kdist.coordinator.ClusterCoordinator(strategy, worker_retry_seconds=0.1)
    try:
        # schedule() raises it when the watch already failed, else join() does.
        with pytest.raises(TypeError, match="a bug in the health check"):
            coordinator.schedule(_functions.fail, args=("never runs",))
            assert coordinator._queue.wait_idle(timeout=30)
            coordinator.join()
    finally:
        coordinator.shutdown()
