"""The process that drives the workers is the chief: it saves, checkpoints and backs up.

TensorFlow's tutorial runs its coordinator with a resolver that names no task;
with a `ClusterCoordinator` the same holds. A negative control disables the
rule (`FaultInjection.coordinator_not_chief`) and the files are missing, so the
checks below can fail.
"""

import keras
import numpy as np
import pytest

import kdist
import kdist.coordinator
from kdist import faults
from tests.coordinator import _in_process

pytestmark = pytest.mark.timeout(300)

EPOCHS, STEPS = 2, 6


def _dataset_fn():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.arange(1, 5, dtype="float32"))[:, None]
    while True:
        for start in range(0, 64, 16):
            yield x[start:start + 16], y[start:start + 16]


def _fit_with_callbacks(tmp_path, explicit_coordinator):
    with _in_process.cluster() as (resolver, strategy):
        assert resolver.task_type is None
        if explicit_coordinator:
            kdist.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=2)
        history = model.fit(_dataset_fn, epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0, callbacks=[
            keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt.keras")),
            keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt.weights.h5"), save_weights_only=True),
        ])
        model.save(str(tmp_path / "final.keras"))
        return strategy, history, int(model.optimizer.iterations.numpy())


@pytest.mark.parametrize("explicit_coordinator", [False, True])
def test_the_coordinator_checkpoints_and_counts_steps(tmp_path, explicit_coordinator):
    strategy, history, iterations = _fit_with_callbacks(tmp_path, explicit_coordinator)
    assert strategy.extended.is_coordinator and strategy.extended.is_chief
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert iterations == EPOCHS * STEPS
    for name in ("ckpt.keras", "ckpt.weights.h5", "final.keras"):
        assert (tmp_path / name).is_file(), name
    reloaded = keras.saving.load_model(str(tmp_path / "final.keras"))
    assert int(reloaded.optimizer.iterations.numpy()) == EPOCHS * STEPS


def test_negative_control_a_coordinator_that_is_not_chief_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(faults.ACTIVE, "coordinator_not_chief", True)
    with pytest.warns(UserWarning, match="only the chief writes files"):
        _fit_with_callbacks(tmp_path, explicit_coordinator=False)
    assert not any((tmp_path / name).exists() for name in ("ckpt.keras", "ckpt.weights.h5", "final.keras"))
