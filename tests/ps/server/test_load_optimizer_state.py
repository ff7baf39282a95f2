"""`VariableClient.load_optimizer_state`: a client sets a variable's optimizer iterations and slots.

This is how a restored backup's optimizer state reaches the servers
(`kdist.keras.parameter_server.variable_writes`). Checked on a real server:
the loaded state is what `optimizer_state` reads back and what the next push
continues from (equal to a Keras optimizer given the same state), and a
request with one bad variable changes none.
"""

import keras
import numpy as np
import pytest

from kdist.errors import ParameterServerError
from kdist.ps import DenseGradient, OptimizerState, VariableInit

ADAM = keras.optimizers.serialize(keras.optimizers.Adam(0.1))


def _adam_variables(client, names):
    client.create([VariableInit(name, np.ones((3, 2), "float32"), True) for name in names])
    client.configure_optimizer(ADAM, names)


def test_loaded_state_is_read_back_and_the_next_push_continues_from_it(client):
    _adam_variables(client, ["w"])
    momentum = np.full((3, 2), 0.25, "float32")
    velocity = np.full((3, 2), 0.5, "float32")
    slots = dict(zip(client.optimizer_state(["w"])["w"].slots, (momentum, velocity)))
    client.load_optimizer_state({"w": OptimizerState(7, slots)})

    state = client.optimizer_state(["w"])["w"]
    assert state.iterations == 7
    for name, value in slots.items():
        np.testing.assert_array_equal(state.slots[name], value)

    gradient = np.arange(6, dtype="float32").reshape(3, 2)
    client.push([DenseGradient("w", gradient)])
    # The same step by a Keras Adam holding the same state.
    variable = keras.Variable(np.ones((3, 2), "float32"))
    reference = keras.optimizers.Adam(0.1)
    reference.build([variable])
    reference.iterations.assign(7)
    slot_variables = [v for v in reference.variables if tuple(v.shape) == (3, 2)]  # m, then v
    for slot, value in zip(slot_variables, (momentum, velocity)):
        slot.assign(value)
    reference.apply([keras.ops.convert_to_tensor(gradient)], [variable])
    [pulled] = client.pull(["w"])
    np.testing.assert_allclose(pulled.value, keras.ops.convert_to_numpy(variable), rtol=1e-6)
    assert client.optimizer_state(["w"])["w"].iterations == 8


@pytest.mark.parametrize("defect", ["unknown slot", "missing slot", "shape", "iterations", "unconfigured"])
def test_one_bad_variable_loads_nothing(client, defect):
    _adam_variables(client, ["a", "b"])
    client.create([VariableInit("plain", np.ones(2, "float32"), True)])
    before = client.optimizer_state(["a", "b"])
    good = OptimizerState(5, {name: np.full((3, 2), 2.0, "float32") for name in before["a"].slots})
    bad_slots = dict(good.slots)
    name = "b"
    if defect == "unknown slot":
        bad_slots["nonsense"] = np.zeros((3, 2), "float32")
    elif defect == "missing slot":
        bad_slots.pop(next(iter(bad_slots)))
    elif defect == "shape":
        bad_slots[next(iter(bad_slots))] = np.zeros((2, 3), "float32")
    elif defect == "unconfigured":
        name, bad_slots = "plain", {}
    bad = OptimizerState(-1 if defect == "iterations" else 5, bad_slots)

    with pytest.raises(ParameterServerError) as caught:
        client.load_optimizer_state({"a": good, name: bad})

    expected = "FAILED_PRECONDITION" if defect == "unconfigured" else "INVALID_ARGUMENT"
    assert caught.value.code_name == expected
    after = client.optimizer_state(["a", "b"])
    for variable in ("a", "b"):
        assert after[variable].iterations == before[variable].iterations == 0
        for slot, value in before[variable].slots.items():
            np.testing.assert_array_equal(after[variable].slots[slot], value)
