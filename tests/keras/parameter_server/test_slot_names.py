"""A variable with two optimizer slots of one short name reads both back from the servers."""

import keras
import numpy as np
import pytest

import kdist
from kdist.keras.parameter_server import variable_writes, worker_steps
from tests.keras import _ps

pytestmark = pytest.mark.timeout(180)


@keras.saving.register_keras_serializable(package="kdist_tests")
class TwoAccumulators(keras.optimizers.Optimizer):
    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._sums = [self.add_variable_from_reference(variable, "accumulator") for variable in variables]
        self._squares = [self.add_variable_from_reference(variable, "accumulator") for variable in variables]

    def update_step(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        self.assign_add(self._sums[index], gradient)
        self.assign_add(self._squares[index], gradient * gradient)
        self.assign_sub(variable, learning_rate * gradient)


def test_two_same_named_slots_read_back_from_the_servers():
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
            model.compile(optimizer=TwoAccumulators(learning_rate=0.1), loss="mse")
        x, y = np.ones((4, 3), "float32"), np.zeros((4, 1), "float32")
        model.fit(x, y, epochs=1, batch_size=4, verbose=0)
        session = worker_steps.session_of(model)
        [route] = session.router.routes([model.layers[0].kernel])
        [(iterations, slots)] = session.router.optimizer_state([route])
        assert list(slots) == ["accumulator", "accumulator_1"]
        optimizer = model.optimizer
        # Local copies only (a write would reach the servers: kdist.keras.parameter_server.variable_writes).
        with variable_writes.internal():
            for variable in optimizer._sums + optimizer._squares:
                variable.assign(np.zeros(variable.shape, "float32"))
        session.read_back()
        np.testing.assert_allclose(keras.ops.convert_to_numpy(optimizer._sums[0]), slots["accumulator"])
        np.testing.assert_allclose(keras.ops.convert_to_numpy(optimizer._squares[0]), slots["accumulator_1"])
        assert not np.allclose(slots["accumulator"], slots["accumulator_1"])
