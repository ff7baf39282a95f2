"""ClusterCoordinator against real `kdist server` processes on loopback."""

import numpy as np
import pytest

import kdist
import kdist.coordinator
import keras
from kdist.coordinator import RemoteValueStatus
from tests.coordinator import _cluster, _functions

pytestmark = pytest.mark.timeout(300)


def _train_state(strategy):
    with strategy.scope():
        model = _functions.build_model()
        optimizer = keras.optimizers.Adam(0.02)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    return model, optimizer, accuracy, _functions.make_train_step(strategy, model, optimizer, accuracy, loss_fn)


def test_custom_loop_trains_and_applies_each_scheduled_step_once(tmp_path):
    steps_per_epoch, epochs = 60, 5
    with _cluster.start(num_workers=2, num_ps=1, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        coordinator = kdist.coordinator.ClusterCoordinator(strategy)
        assert kdist.coordinator.ClusterCoordinator(strategy) is coordinator
        per_worker_dataset = coordinator.create_per_worker_dataset(_functions.dataset_fn)
        model, optimizer, accuracy, worker_fn = _train_state(strategy)
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
    assert test_accuracy >= 0.8, (test_accuracy, losses)
    assert stats["closures_done"] == steps_per_epoch * epochs
    # Two Dense layers: four variables, each updated once per scheduled step.
    assert len(ps_stats.variables) == 4
    assert {v.applied_updates for v in ps_stats.variables.values()} == {steps_per_epoch * epochs}
