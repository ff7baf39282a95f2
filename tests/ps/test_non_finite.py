"""Non-finite gradients: refused by default, and a refused push changes nothing.

One NaN applied by Adam poisons its moments for good, for every worker; so a
push holding NaN or infinity is refused whole (`INVALID_ARGUMENT` naming the
variable) before anything is applied: weights, optimizer slots and the
update-id bookkeeping stay as they were, and the fixed push then applies once.
"""

import keras
import numpy as np
import pytest

from kdist.errors import InvalidArgumentError, ParameterServerError
from kdist.ps import (
    DenseGradient,
    RowGradient,
    ServiceOptions,
    VariableClient,
    VariableInit,
    create_server,
)

pytestmark = pytest.mark.timeout(120)


def adam_config():
    return keras.optimizers.serialize(keras.optimizers.Adam(0.01))


def optimizer_snapshot(client, names):
    return {name: (state.iterations, {slot: value.copy() for slot, value in state.slots.items()})
            for name, state in client.optimizer_state(names).items()}


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_non_finite_gradients_are_refused_and_change_nothing(client, poison):
    client.create([VariableInit("w", np.linspace(-1, 1, 12, dtype="float32").reshape(4, 3)),
                   VariableInit("b", np.zeros(3, "float32"))])
    client.configure_optimizer(adam_config(), ["w", "b"])
    client.push([DenseGradient("w", np.ones((4, 3), "float32")),
                 DenseGradient("b", np.ones(3, "float32"))])
    values = {state.name: (state.value, state.version) for state in client.pull(["w", "b"])}
    slots = optimizer_snapshot(client, ["w", "b"])
    bad = np.ones((4, 3), "float32")
    bad[2, 1] = poison
    rows = np.ones((2, 3), "float32")
    rows[1, 0] = poison
    for gradients in ([DenseGradient("b", np.ones(3, "float32")), DenseGradient("w", bad)],
                      [DenseGradient("b", np.ones(3, "float32")),
                       RowGradient("w", np.array([0, 3]), rows)]):
        with pytest.raises(ParameterServerError) as caught:
            client.push(gradients, update_id="step-2")
        assert caught.value.code_name == "INVALID_ARGUMENT" and not caught.value.retryable
        detail = caught.value.detail
        assert "'w'" in detail and "non-finite" in detail and "1 NaN or infinite" in detail
    after = {state.name: (state.value, state.version) for state in client.pull(["w", "b"])}
    for name, (value, version) in values.items():
        np.testing.assert_array_equal(after[name][0], value)
        assert after[name][1] == version == 1
    after_slots = optimizer_snapshot(client, ["w", "b"])
    for name, (iterations, slot_values) in slots.items():
        assert after_slots[name][0] == iterations == 1
        for slot, value in slot_values.items():
            np.testing.assert_array_equal(after_slots[name][1][slot], value, err_msg=slot)
    stats = client.stats()
    assert stats.applied_pushes == 1 and stats.deduplicated_updates == 0
    # The refused pushes did not use up their update id: the fixed push applies, once.
    fixed = [DenseGradient("b", np.ones(3, "float32")),
             DenseGradient("w", np.nan_to_num(bad, posinf=1.0, neginf=1.0, nan=1.0))]
    assert client.push(fixed, update_id="step-2").versions == {"w": 2, "b": 2}
    assert client.push(fixed, update_id="step-2").versions == {"w": 2, "b": 2}
    assert client.stats().deduplicated_updates == 1
    assert all(np.isfinite(state.value).all() for state in client.pull(["w", "b"]))


def test_non_finite_gradients_apply_when_allowed():
    options = ServiceOptions(allow_non_finite_gradients=True, rpc_timeout_seconds=30)
    with create_server(options=options) as server, VariableClient(server.address) as client:
        client.create([VariableInit("w", np.zeros(3, "float32"))])
        client.configure_optimizer(adam_config(), ["w"])
        assert client.push([DenseGradient("w", np.array([1, np.nan, 1], "float32"))]
                           ).versions == {"w": 1}
        [state] = client.pull(["w"])
        assert np.isnan(state.value[1]) and np.isfinite(state.value[[0, 2]]).all()


def test_allow_non_finite_gradients_must_be_a_bool():
    with pytest.raises(InvalidArgumentError, match="allow_non_finite_gradients"):
        ServiceOptions(allow_non_finite_gradients="yes")


def test_a_loss_scale_optimizer_gets_non_finite_gradients(client):
    # LossScaleOptimizer must see an overflow to skip the step and lower its scale.
    config = keras.optimizers.serialize(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    client.create([VariableInit("w", np.ones(3, "float32"))])
    client.configure_optimizer(config, ["w"])
    client.push([DenseGradient("w", np.array([1, np.inf, 1], "float32"))])
    [state] = client.pull(["w"])
    np.testing.assert_array_equal(state.value, np.ones(3))  # the step was skipped
    client.push([DenseGradient("w", np.ones(3, "float32"))])
    [state] = client.pull(["w"])
    assert state.version == 2 and (state.value < 1).all() and np.isfinite(state.value).all()
