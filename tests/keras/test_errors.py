"""Clear, typed errors for invalid use; nothing is changed when they are raised."""

import keras
import numpy as np
import pytest

import kdist
from kdist.errors import InvalidArgumentError, InvalidDeviceError, UnsupportedError
from kdist.keras import _compat
from tests.keras import _models as m


def test_fit_with_global_batch_smaller_than_replicas_raises_and_changes_nothing():
    model = m.build_in_scope(m.mlp_l2, m.mirrored(3))
    before = [w.copy() for w in model.get_weights()]
    x, y = m.classification_data(64)
    with pytest.raises(InvalidArgumentError, match=r"batch_size=2") as info:
        model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert "global batch" in str(info.value)
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.skipif(
    not _compat.TORCH_TRAINER_REJECTS_STEPS_PER_EXECUTION,
    reason="this Keras runs steps_per_execution > 1 on torch (tests/keras/replica/test_engine.py)",
)
def test_steps_per_execution_above_one_is_refused_clearly():
    strategy = m.mirrored(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x, y = m.classification_data(64)
    with pytest.raises(UnsupportedError, match="steps_per_execution=2"):
        model.fit(x, np.zeros((64, 4), "float32"), batch_size=16, verbose=0)


def test_jit_compile_is_turned_off_with_a_warning():
    strategy = m.mirrored(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    x, _ = m.classification_data(64)
    with pytest.warns(UserWarning, match="jit_compile=True is turned off"):
        model.fit(x, np.zeros((64, 4), "float32"), batch_size=16, verbose=0)
    assert model.jit_compile is False


@pytest.mark.parametrize(
    "devices, pattern",
    [
        ([], "At least one device"),
        (["cpu:0", "cpu:0"], "Duplicate devices"),
        (["tpu:0"], "tpu:0"),
        (["cuda:7"], "not visible"),
    ],
)
def test_bad_devices_raise(devices, pattern):
    with pytest.raises(InvalidDeviceError, match=pattern):
        kdist.MirroredStrategy(devices)


def test_merge_call_inside_evaluate_test_step_is_refused_clearly():
    """Inside train_step a merge runs the step in merge mode (tests/keras/replica/test_gradient_merge.py);
    evaluate's replicas still run one after another, so a merge there is refused."""

    class Chatty(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def test_step(self, data):
            kdist.get_replica_context().all_reduce("sum", 1.0)
            return {}

    strategy = m.mirrored(2)
    with strategy.scope():
        model = Chatty()
        model.compile(optimizer="sgd", loss="mse")
    x, y = m.regression_data(32)
    with pytest.raises(UnsupportedError, match="strategy.run"):
        model.evaluate(x, y, batch_size=16, verbose=0)

