"""Every write of a variable the parameter servers hold reaches them, or is refused.

`kdist.keras.parameter_server.variable_writes`: `set_weights` (model, layer,
optimizer), `assign`/`assign_add`/`assign_sub`, `load_own_variables`, inside
and outside the scope, before and after `compile`, change what the servers
hold (read here straight from them, not from the local copy), and training
afterwards equals plain Keras. Real gRPC servers in this process; one worker
(this process) or an in-process coordinator cluster.

A write the servers cannot take raises a typed error naming the variables and
the call, and the local copies stay as they were. kdist's own refreshes (the
pulls of `fit`, the read-back of `save`) are not sent back.

Negative control: with the write path switched off (no variable is recognised
as held by the servers), the Dense(2)-set-to-7 check fails.
"""

import contextlib

import keras
from tests import seeding
import numpy as np
import pytest

import kdist
import kdist.coordinator
from kdist.errors import ParameterServerUnavailableError, UnsupportedError
from kdist.cluster import SimpleClusterResolver
from kdist.ps import ServiceOptions, create_server
from kdist.keras.parameter_server import remote_tables, variable_writes
from tests.coordinator import _in_process
from tests.keras import _ps

pytestmark = pytest.mark.timeout(180)

SEVEN = 7.0


def _dense_model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense")], name="model")


def _data(samples=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((samples, 3)).astype("float32"), rng.random((samples, 2)).astype("float32")


def _on_servers(strategy, variable):
    """What the parameter servers hold for `variable` (read from them; the local copy is untouched)."""
    router = strategy.extended.variable_router
    return router.read_whole(router.route(variable))


def _sevens(model):
    return [np.full(weight.shape, SEVEN, "float32") for weight in model.get_weights()]


def _check_set_to_seven_survives_fit(in_scope, compiled_first):
    x, y = _data()
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = _dense_model()
            if compiled_first:
                model.compile(keras.optimizers.SGD(0.0), "mse")
        with strategy.scope() if in_scope else contextlib.nullcontext():
            model.set_weights(_sevens(model))
        for variable in model.weights:
            np.testing.assert_array_equal(_on_servers(strategy, variable), SEVEN)
        if not compiled_first:
            with strategy.scope():
                model.compile(keras.optimizers.SGD(0.0), "mse")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        for weight in model.get_weights():
            np.testing.assert_array_equal(weight, SEVEN)


@pytest.mark.parametrize("compiled_first", [True, False], ids=["after_compile", "before_compile"])
@pytest.mark.parametrize("in_scope", [True, False], ids=["in_scope", "outside_scope"])
def test_dense_set_to_seven_is_what_fit_with_zero_learning_rate_returns(in_scope, compiled_first):
    _check_set_to_seven_survives_fit(in_scope, compiled_first)


def test_control_with_the_write_path_switched_off_the_sevens_are_lost(monkeypatch):
    monkeypatch.setattr(variable_writes, "_target_of", lambda variable: None)
    with pytest.raises(AssertionError):
        _check_set_to_seven_survives_fit(in_scope=False, compiled_first=True)


def test_set_weights_from_plain_keras_then_fit_equals_plain_keras():
    x, y = _data(64)
    seeding.set_random_seed(3)
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    plain.compile(keras.optimizers.Adam(0.05), "mse")
    initial = plain.get_weights()
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        seeding.set_random_seed(4)  # other initial values than plain's
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.BatchNormalization(), keras.layers.Dense(2)])
            model.compile(keras.optimizers.Adam(0.05), "mse")
        model.set_weights(initial)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        weights = model.get_weights()
        on_servers = [_on_servers(strategy, variable) for variable in model.weights]
    plain_history = plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for ours, served, theirs in zip(weights, on_servers, plain.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(served, theirs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)


def test_assign_assign_add_and_assign_sub_reach_the_servers_and_add_to_their_value():
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = _dense_model()
        kernel, bias = model.get_layer("dense").kernel, model.get_layer("dense").bias
        kernel.assign(np.ones((3, 2), "float32"))
        np.testing.assert_array_equal(_on_servers(strategy, kernel), 1.0)
        # Another worker moved the servers' value: assign_add adds to it, not to the stale copy.
        router = strategy.extended.variable_router
        router.send_gradients((), (), assign=[(router.route(kernel), np.full((3, 2), 10.0, "float32"))])
        kernel.assign_add(np.full((3, 2), 2.0, "float32"))
        np.testing.assert_array_equal(_on_servers(strategy, kernel), 12.0)
        kernel.assign_sub(np.full((3, 2), 0.5, "float32"))
        np.testing.assert_array_equal(_on_servers(strategy, kernel), 11.5)
        model.get_layer("dense").set_weights([np.full((3, 2), 3.0, "float32"), np.full((2,), -1.0, "float32")])
        np.testing.assert_array_equal(_on_servers(strategy, kernel), 3.0)
        np.testing.assert_array_equal(_on_servers(strategy, bias), -1.0)
        with strategy.scope():
            model.compile(keras.optimizers.SGD(0.0), "mse")
        model.fit(*_data(), batch_size=8, verbose=0)
        np.testing.assert_array_equal(kernel.numpy(), 3.0)
        np.testing.assert_array_equal(bias.numpy(), -1.0)


def _trained_adam(strategy, x, y):
    with strategy.scope():
        model = _dense_model()
        model.compile(keras.optimizers.Adam(0.1), "mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


def optimizer_weights(optimizer):
    return [variable.numpy() for variable in optimizer.variables]


def _server_slots(strategy, model):
    router = strategy.extended.variable_router
    routes = router.routes(model.trainable_variables)
    return [(iterations, {name: np.asarray(value) for name, value in slots.items()})
            for iterations, slots in router.optimizer_state(routes)]


def test_optimizer_set_weights_and_load_own_variables_reach_the_servers_slots():
    x, y = _data()
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        model = _trained_adam(strategy, x, y)
        optimizer = model.optimizer
        written = [np.full(variable.shape, 0.25 * (index + 1), "float32")
                   for index, variable in enumerate(optimizer.variables)]
        written[0] = np.asarray(40, dtype=written[0].dtype)  # iterations
        written[1] = optimizer.variables[1].numpy()  # learning rate: as it is
        optimizer.set_weights(written)
        state = _server_slots(strategy, model)
        assert [iterations for iterations, _ in state] == [40, 40]
        # Slots in the optimizer's order (per variable: momentum, velocity).
        slots = [value for _, per_variable in state for value in per_variable.values()]
        for served, expected in zip(slots, written[2:]):
            np.testing.assert_array_equal(served, expected)
        for local, expected in zip(optimizer_weights(optimizer)[2:], written[2:]):
            np.testing.assert_array_equal(local, expected)
        # load_own_variables (what a weights file restores) takes the same way.
        store = {str(index): value * 2 if index >= 2 else value for index, value in enumerate(written)}
        optimizer.load_own_variables(store)
        slots = [value for _, per_variable in _server_slots(strategy, model) for value in per_variable.values()]
        for served, expected in zip(slots, written[2:]):
            np.testing.assert_array_equal(served, expected * 2)
        # A lone slot assign too, leaving the other slots as the servers hold them.
        optimizer.variables[2].assign(np.full(optimizer.variables[2].shape, -3.0, "float32"))
        slots = [value for _, per_variable in _server_slots(strategy, model) for value in per_variable.values()]
        np.testing.assert_array_equal(slots[0], -3.0)
        np.testing.assert_array_equal(slots[1], written[3] * 2)


def test_optimizer_state_written_then_trained_equals_plain_keras():
    x, y = _data(32)
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        model = _trained_adam(strategy, x, y)
        seeding.set_random_seed(1)
        plain = _dense_model()
        plain.compile(keras.optimizers.Adam(0.1), "mse")
        plain.optimizer.build(plain.trainable_variables)
        # Plain Keras' fresh state (iterations 0, zero slots) and its weights, written into ours.
        model.set_weights(plain.get_weights())
        model.optimizer.set_weights(optimizer_weights(plain.optimizer))
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        weights = model.get_weights()
    plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for ours, theirs in zip(weights, plain.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_tables_and_ordinary_variables_are_written_in_one_push_per_server():
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            ids = keras.Input((2,), dtype="int64")
            hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(100, 4, name="emb")(ids))
            model = keras.Model(ids, keras.layers.Dense(1, name="out")(hidden))
        table = model.get_layer("emb").embeddings
        assert remote_tables.of(table) is not None
        before = cluster.stats()[0].requests.get("push", 0)
        new = [np.full(weight.shape, index + 1.0, "float32") for index, weight in enumerate(model.weights)]
        model.set_weights(new)
        assert cluster.stats()[0].requests.get("push", 0) == before + 1
        for variable, expected in zip(model.weights, new):
            np.testing.assert_array_equal(_on_servers(strategy, variable), expected)
            np.testing.assert_array_equal(variable.numpy(), expected)
        assert remote_tables.of(table) is not None  # still no local copy


def test_kdist_refreshes_are_not_sent_back():
    x, y = _data()
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = _dense_model()
            model.compile(keras.optimizers.Adam(0.1), "mse")
        model.set_weights(_sevens(model))
        assert cluster.stats()[0].requests.get("push", 0) == 1
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # 2 steps: 2 gradient pushes
        pushes = cluster.stats()[0].requests.get("push", 0)
        assert pushes == 3
        model.save_weights(_tmp_weights())  # reads the servers' weights and slots back
        model.predict(x, verbose=0)
        stats = cluster.stats()[0]
        assert stats.requests.get("push", 0) == pushes and stats.requests.get("load_optimizer_state", 0) == 0


def _tmp_weights():
    import tempfile

    return f"{tempfile.mkdtemp()}/model.weights.h5"


def test_a_write_the_servers_cannot_take_is_refused_and_changes_nothing():
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = _dense_model()
            model.compile(keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2), "mse")
        model.optimizer.build(model.trainable_variables)
        before = optimizer_weights(model.optimizer)
        changed = [value + 1 for value in before]
        with pytest.raises(UnsupportedError, match="gradient_accumulation_steps") as error:
            model.optimizer.set_weights(changed)
        assert "optimizer.set_weights()" in str(error.value.__notes__)
        assert "model_dense_kernel_momentum" in str(error.value.__notes__)
        for local, expected in zip(optimizer_weights(model.optimizer), before):
            np.testing.assert_array_equal(local, expected)


def test_a_write_to_unreachable_servers_raises_their_error_and_changes_nothing():
    options = ServiceOptions(rpc_timeout_seconds=2.0, connect_timeout_seconds=2.0, recovery_timeout_seconds=0.0)
    server = create_server("127.0.0.1:0")
    try:
        resolver = SimpleClusterResolver({"worker": ["127.0.0.1:1"], "ps": [server.address]},
                                         task_type="worker", task_id=0)
        strategy = kdist.ParameterServerStrategy(resolver, options=options)
        with strategy.scope():
            model = _dense_model()
        before = model.get_weights()
    finally:
        server.stop(None)
    if True:
        with pytest.raises(ParameterServerUnavailableError) as error:
            model.set_weights(_sevens(model))
        assert "set_weights()" in str(error.value.__notes__)
        for local, expected in zip(model.get_weights(), before):
            np.testing.assert_array_equal(local, expected)


def test_a_coordinator_chief_writes_reach_the_servers_its_workers_train_on():
    x, y = _data(32)
    with _in_process.cluster(num_workers=1) as (_, strategy):
        kdist.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = _dense_model()
            model.compile(keras.optimizers.SGD(0.0), "mse")
        model.set_weights(_sevens(model))
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        for weight in model.get_weights():
            np.testing.assert_array_equal(weight, SEVEN)
        model.get_layer("dense").bias.assign_add(np.ones((2,), "float32"))
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        np.testing.assert_array_equal(model.get_layer("dense").bias.numpy(), SEVEN + 1)


def test_a_new_learning_rate_reaches_servers_before_training_and_is_refused_after():
    x, y = _data()
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = _dense_model()
            model.compile(keras.optimizers.SGD(0.5), "mse")
        model.set_weights(_sevens(model))
        model.optimizer.learning_rate = 0.0  # before the first step: the servers take it
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        for weight in model.get_weights():
            np.testing.assert_array_equal(weight, SEVEN)
        with pytest.raises(UnsupportedError, match="LearningRateSchedule") as error:
            model.optimizer.learning_rate = 0.3
        assert "learning_rate" in str(error.value.__notes__)
        assert float(model.optimizer.learning_rate.numpy()) == 0.0


def test_a_write_while_another_optimizer_is_being_built_is_not_mistaken_for_it(monkeypatch):
    """An optimizer is watched from its first variable on; a write that comes (from another
    thread, as a coordinator worker's metric reset did) before its __init__ has set its
    step count and learning rate goes through. The interleaving is forced here: the write
    runs right after the optimizer is registered."""
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        metric = keras.metrics.Mean()
        metric.update_state(3.0)
        watch = variable_writes.watch
        seen = []

        def watch_then_write(strategy_, optimizer=None):
            watch(strategy_, optimizer)
            if isinstance(optimizer, keras.optimizers.Optimizer) and not seen:
                seen.append(hasattr(optimizer, "_learning_rate"))
                metric.reset_state()  # not held by the servers: written locally

        monkeypatch.setattr(variable_writes, "watch", watch_then_write)
        with strategy.scope():
            model = _dense_model()
            model.compile(keras.optimizers.SGD(0.0), "mse")
        assert seen == [False]  # the write came while the optimizer was half-built
        assert float(metric.result()) == 0.0
