"""A coordinator `fit`'s saves hold exactly the steps they name, and its step count is exact.

Real `kdist server` processes (one ps, one worker: the run is deterministic).
Each epoch is cut into closures of `steps_per_execution=4` steps, all in
flight at once between saves. A `ModelCheckpoint(save_freq=8)` file named by
its step must equal a coordinator fit of that many steps from the same
seed on the same batches; a callback before it sleeps at each save, so
closures still in flight there would land in the file (the negative control
turns the drain off and sees them). An uninterrupted run counts one optimizer
iteration per step, every time (it used to count 25 for 24 steps now and
then: a save took the servers' count, in-flight steps included, and the
chief then added those steps again as their closures returned).
"""

import re

import keras
from tests import seeding
import numpy as np
import pytest

import kdist
from kdist.keras.parameter_server import save_points
from tests.coordinator import _cluster

STEPS, PACK, SAVE_FREQ, BATCH = 24, 4, 8, 8


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32"))


def _model():
    seeding.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=PACK)
    return model


class _SlowSave(keras.callbacks.Callback):
    """Sleeps where a save is due, so that closures in flight there would be applied before it."""

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % SAVE_FREQ == 0:
            import time

            time.sleep(0.6)


def _weights_after(strategy, steps):
    """The weights of a coordinator fit on the first `steps` batches only (nothing else in flight)."""
    with strategy.scope():
        model = _model()
    x, y = _data()
    model.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def _strategy(cluster):
    strategy = kdist.ParameterServerStrategy(cluster.resolver())
    # One closure at a time per worker: two sent together may run in either order,
    # which would make even an uninterrupted run differ from itself.
    kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
    return strategy


def _fit_with_checkpoints(strategy, directory):
    with strategy.scope():
        model = _model()
    initial = model.get_weights()
    x, y = _data()
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(directory / "step-{batch}.weights.h5"), save_weights_only=True, save_freq=SAVE_FREQ)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[_SlowSave(), checkpoint])
    saved = {}
    for path in directory.glob("step-*.weights.h5"):
        restored = _model()
        restored.load_weights(str(path))
        saved[int(re.search(r"step-(\d+)", path.name).group(1))] = restored.get_weights()
    return model, initial, saved


def _assert_saves_hold_their_steps(strategy, saved):
    # ModelCheckpoint names the file by the steps of the epoch it holds ({batch} counts from 1).
    assert sorted(saved) == [8, 16, 24], sorted(saved)
    for batch, weights in saved.items():
        expected = _weights_after(strategy, batch)
        for got, want in zip(weights, expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"checkpoint of step {batch}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", [0, 1])
def test_saves_hold_exactly_their_steps_and_iterations_count_each_step_once(tmp_path, run):
    with _cluster.start(num_workers=1, num_ps=1, tmp_path=tmp_path) as cluster:
        strategy = _strategy(cluster)
        model, initial, saved = _fit_with_checkpoints(strategy, tmp_path)
        _assert_saves_hold_their_steps(strategy, saved)
        assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == STEPS
        model.save_weights(str(tmp_path / "final.weights.h5"))  # a save reads the servers back
        assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == STEPS
        strategy.extended.cluster_coordinator.shutdown()


@pytest.mark.timeout(120)
def test_control_without_the_drain_a_save_holds_steps_in_flight(tmp_path, monkeypatch):
    monkeypatch.setattr(save_points, "barriers", lambda callbacks, chunks: set())
    with _cluster.start(num_workers=1, num_ps=1, tmp_path=tmp_path) as cluster:
        strategy = _strategy(cluster)
        _, _, saved = _fit_with_checkpoints(strategy, tmp_path)
        with pytest.raises(AssertionError, match="checkpoint of step"):
            _assert_saves_hold_their_steps(strategy, saved)
        strategy.extended.cluster_coordinator.shutdown()
