"""The data a coordinator `fit` takes: arrays, a dataset_fn or generator function, a PyDataset.

One worker, one closure in flight and no shuffling: a PyDataset gives the same
batches in the same order as plain Keras, so the weights must match it. Any
other type is refused with an error that names the accepted forms.
"""

import keras
import numpy as np
import pytest

import kdist
import kdist.coordinator
from kdist.errors import InvalidArgumentError
from tests.coordinator import _in_process

pytestmark = pytest.mark.timeout(300)

X = np.random.default_rng(1).normal(size=(40, 4)).astype("float32")
Y = (X @ np.arange(1, 5, dtype="float32"))[:, None]


class Batches(keras.utils.PyDataset):
    """Batches of 8 rows of X, Y."""

    def __len__(self):
        return 5

    def __getitem__(self, index):
        rows = slice(index * 8, (index + 1) * 8)
        return X[rows], Y[rows]


class BatchesWithEpochHook(Batches):
    """Counts its epochs: Keras calls `on_epoch_end` where the batches are read (here: the chief)."""

    epochs_ended = 0

    def on_epoch_end(self):
        type(self).epochs_ended += 1


def _model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    return model


@pytest.mark.parametrize("dataset_class", [Batches, BatchesWithEpochHook])
def test_py_dataset_equals_plain_keras(dataset_class):
    with _in_process.cluster() as (_, strategy):
        kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
        with strategy.scope():
            model = _model()
        initial = model.get_weights()
        history = model.fit(dataset_class(), epochs=2, shuffle=False, verbose=0)
        hooks_run = BatchesWithEpochHook.epochs_ended
        weights = model.get_weights()
        iterations = int(model.optimizer.iterations.numpy())
    plain = _model()
    plain.set_weights(initial)
    plain_history = plain.fit(dataset_class(), epochs=2, shuffle=False, verbose=0)
    for got, expected in zip(weights, plain.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)
    assert iterations == 10
    if dataset_class is BatchesWithEpochHook:
        assert hooks_run == 2  # once per epoch, on the chief (plain Keras' iterator adds a call of its own)


def test_generator_function_and_refused_forms():
    def generator_function():
        while True:
            for start in range(0, 40, 8):
                yield X[start:start + 8], Y[start:start + 8]

    with _in_process.cluster() as (_, strategy):
        with strategy.scope():
            model = _model()
        history = model.fit(generator_function, epochs=2, steps_per_epoch=5, verbose=0)
        assert history.history["loss"][-1] < history.history["loss"][0]
        assert int(model.optimizer.iterations.numpy()) == 10
        with pytest.raises(InvalidArgumentError, match="PyDataset") as error:
            model.fit(generator_function(), steps_per_epoch=5, verbose=0)
        assert "pass the function that creates it" in str(error.value)
        assert "dataset_fn" in str(error.value) and "arrays" in str(error.value)
        with pytest.raises(InvalidArgumentError, match="Received: x of type str"):
            model.fit("data.csv", verbose=0)
        with pytest.raises(InvalidArgumentError, match="steps_per_epoch is required"):
            model.fit(generator_function, verbose=0)
