"""The server-side optimizer equals local Keras: same gradients, same weights and slots."""

import keras
import numpy as np
import pytest

from kdist.ps import DenseGradient, RowGradient, VariableInit
from kdist.rpc.dtypes import to_numpy as from_torch

pytestmark = pytest.mark.timeout(120)

NUM_STEPS = 6


def _local_run(optimizer, initial, gradients):
    variable = keras.Variable(initial.copy(), name="kernel")
    optimizer.build([variable])
    for gradient in gradients:
        optimizer.apply([keras.ops.convert_to_tensor(gradient)], [variable])
    slots = [value for value in optimizer.variables
             if value is not optimizer.iterations and "learning_rate" not in value.path]
    return from_torch(variable.value).copy(), [from_torch(slot.value).copy() for slot in slots]


def _service_run(client, optimizer, initial, gradients, name="kernel"):
    client.create([VariableInit(name, initial)])
    client.configure_optimizer(keras.optimizers.serialize(optimizer), [name])
    for step, gradient in enumerate(gradients):
        client.push([DenseGradient(name, gradient, version=step)])
    [state] = client.pull([name])
    return state.value, client.optimizer_state([name])[name]


def _adam():
    return keras.optimizers.Adam(learning_rate=0.01, beta_1=0.8, beta_2=0.95, amsgrad=True)


def _data(rng):
    initial = rng.standard_normal((17, 5)).astype("float32")
    gradients = [rng.standard_normal((17, 5)).astype("float32") for _ in range(NUM_STEPS)]
    return initial, gradients


def test_adam_weights_and_slots_equal_local_keras(client, rng):
    initial, gradients = _data(rng)
    local_weights, local_slots = _local_run(_adam(), initial, gradients)
    weights, state = _service_run(client, _adam(), initial, gradients)
    np.testing.assert_allclose(weights, local_weights, rtol=0, atol=1e-6)
    assert state.iterations == NUM_STEPS
    assert list(state.slots) == ["momentum", "velocity", "velocity_hat"]
    for served, local in zip(state.slots.values(), local_slots, strict=True):
        np.testing.assert_allclose(served, local, rtol=0, atol=1e-6)


def test_negative_control_detects_a_different_optimizer(client, rng):
    # The comparison above can fail: a slightly different beta_1 shows up.
    initial, gradients = _data(rng)
    local_weights, _ = _local_run(_adam(), initial, gradients)
    other = keras.optimizers.Adam(learning_rate=0.01, beta_1=0.81, beta_2=0.95, amsgrad=True)
    weights, _ = _service_run(client, other, initial, gradients)
    assert np.abs(weights - local_weights).max() > 1e-6


def test_row_gradients_equal_local_keras_on_dense_take_gradients(client, rng):
    # Single-device Keras on torch differentiates ops.take into a dense gradient.
    initial = rng.standard_normal((8, 3)).astype("float32")
    ids = np.array([1, 5, 1, 7])
    rows = [rng.standard_normal((4, 3)).astype("float32") for _ in range(3)]
    dense = []
    for row in rows:
        gradient = np.zeros_like(initial)
        np.add.at(gradient, ids, row)
        dense.append(gradient)
    local_weights, local_slots = _local_run(_adam(), initial, dense)
    client.create([VariableInit("table", initial)])
    client.configure_optimizer(keras.optimizers.serialize(_adam()), ["table"])
    for row in rows:
        client.push([RowGradient("table", ids, row)])
    [state] = client.pull(["table"])
    np.testing.assert_allclose(state.value, local_weights, rtol=0, atol=1e-6)
    slots = client.optimizer_state(["table"])["table"].slots
    for served, local in zip(slots.values(), local_slots, strict=True):
        np.testing.assert_allclose(served, local, rtol=0, atol=1e-6)
