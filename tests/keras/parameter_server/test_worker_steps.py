"""`model.fit` under `ParameterServerStrategy`, against real parameter servers.

The backbone: one worker and one parameter server in its own process train in
synchronous order (pull, step, push, repeat), which must equal plain Keras on
the same batches — weights, optimizer slots read back from the server,
metrics, history, evaluate and predict. That proves the server-side optimizer
is the same math.
"""

import warnings

import keras
import numpy as np
import pytest

import kdist
from kdist import faults
from kdist.errors import UnsupportedError
from tests.keras import _models, _ps

pytestmark = pytest.mark.timeout(300)

EPOCHS = 2
BATCH = 64


def _train(model, x, y):
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=True)
    return history.history, model.evaluate(x, y, batch_size=BATCH, verbose=0), model.predict(x, batch_size=BATCH, verbose=0)


def _assert_saved_state_matches(reference, path):
    loaded = keras.saving.load_model(path)
    # Weights and optimizer variables; seed-generator states are not saved by Keras.
    for group in ("weights", "optimizer"):
        ref_vars = reference.weights if group == "weights" else reference.optimizer.variables
        got_vars = loaded.weights if group == "weights" else loaded.optimizer.variables
        assert len(ref_vars) == len(got_vars), group
        for ref, got in zip(ref_vars, got_vars):
            np.testing.assert_allclose(
                keras.ops.convert_to_numpy(got), keras.ops.convert_to_numpy(ref), atol=1e-5, rtol=1e-5, err_msg=f"{group}: {ref.path}"
            )


def _run_equivalence(cluster, tmp_path):
    x, y = _models.classification_data(600)
    reference = _models.mlp_dropout_batchnorm()
    expected = _train(reference, x, y)

    strategy = kdist.ParameterServerStrategy(cluster.resolver())
    candidate = _models.build_in_scope(_models.mlp_dropout_batchnorm, strategy)
    got = _train(candidate, x, y)

    _models.assert_same_history(expected[0], got[0])
    np.testing.assert_allclose(got[1], expected[1], atol=1e-5, rtol=1e-5)
    _models.assert_same_outputs(expected[2], got[2])
    for ref, cand in zip(reference.weights, candidate.weights):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(cand), keras.ops.convert_to_numpy(ref), atol=1e-5, rtol=1e-5)
    path = str(tmp_path / "ps_model.keras")
    candidate.save(path)
    _assert_saved_state_matches(reference, path)
    return cluster.stats()


@pytest.fixture(scope="module")
def one_ps(tmp_path_factory):
    with _ps.server_processes(1, tmp_path=tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


def test_one_worker_one_ps_matches_plain_keras(one_ps, tmp_path):
    before = one_ps.stats()[0]
    stats = _run_equivalence(one_ps, tmp_path)[0]
    steps = EPOCHS * int(np.ceil(600 / BATCH))
    pushes = stats.requests.get("push", 0) - before.requests.get("push", 0)
    # One push per step (gradients and BatchNorm statistics together), nothing else.
    assert pushes == steps
    assert stats.applied_pushes - before.applied_pushes == steps


def test_negative_control_skipping_pulls_breaks_equivalence(one_ps, tmp_path, monkeypatch):
    monkeypatch.setattr(faults.ACTIVE, "skip_pull", True)
    with pytest.raises(AssertionError):
        _run_equivalence(one_ps, tmp_path)


def test_each_step_costs_one_pull_and_one_push_per_server(tmp_path):
    x, y = _models.classification_data(256)
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = _models.mlp_l2()
        before = cluster.stats()
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        after = cluster.stats()
    steps = 4
    for old, new in zip(before, after):
        assert new.requests.get("push", 0) - old.requests.get("push", 0) == steps
        # One pull per step plus the read-back when fit ends.
        assert new.requests.get("pull", 0) - old.requests.get("pull", 0) == steps + 1


def test_custom_loop_apply_updates_the_servers_and_the_local_copy():
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            variable = keras.Variable(np.ones((3,), "float32"))
            optimizer = keras.optimizers.SGD(0.5)
        optimizer.apply([keras.ops.convert_to_tensor(np.full((3,), 2.0, "float32"))], [variable])
        np.testing.assert_allclose(keras.ops.convert_to_numpy(variable), np.zeros(3))
        key = strategy.extended.variable_router.route(variable).keys[0]
        (state,) = cluster.clients()[0].pull([key])
        np.testing.assert_allclose(state.value, np.zeros(3))
        assert state.version == 1
        assert int(optimizer.iterations.numpy()) == 1


def test_evaluate_reads_what_other_workers_pushed():
    x, y = _models.classification_data(128)
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = _models.mlp_l2()
        model.evaluate(x, y, verbose=0)
        route = strategy.extended.variable_router.route(model.weights[0])
        client = cluster.clients()[0]
        from kdist.ps import Assignment

        client.push([], [Assignment(route.keys[0], np.zeros(tuple(model.weights[0].shape), "float32"))])
        model.evaluate(x, y, verbose=0)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.weights[0]), 0.0)


def test_only_the_chief_writes_files(tmp_path):
    with _ps.in_process_servers(1, num_workers=2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver("worker", 1))
        with strategy.scope():
            model = _models.mlp_l2()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.save(str(tmp_path / "skipped.keras"))
        assert not (tmp_path / "skipped.keras").exists()
        assert any("chief" in str(warning.message) for warning in caught)


def test_constraints_are_refused_with_a_clear_error():
    x, y = _models.classification_data(64)
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(4, kernel_constraint=keras.constraints.NonNeg())])
            model.compile("sgd", "mse")
        with pytest.raises(UnsupportedError, match="constraint"):
            model.fit(x, np.zeros((64, 4), "float32"), verbose=0)


def test_ema_is_refused_with_a_clear_error():
    x, y = _models.classification_data(64)
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(4)])
            model.compile(keras.optimizers.Adam(use_ema=True), "mse")
        with pytest.raises(UnsupportedError, match="use_ema"):
            model.fit(x, np.zeros((64, 4), "float32"), verbose=0)


def test_two_local_devices_push_one_combined_update():
    x, y = _models.classification_data(256)
    reference = _models.mlp_l2()
    reference.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), devices=["cpu:0", "cpu:1"])
        model = _models.build_in_scope(_models.mlp_l2, strategy)
        before = cluster.stats()[0]
        model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
        after = cluster.stats()[0]
    assert after.requests.get("push", 0) - before.requests.get("push", 0) == 4
    for ref, cand in zip(reference.weights, model.weights):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(cand), keras.ops.convert_to_numpy(ref), atol=1e-5, rtol=1e-5)


def test_load_weights_writes_the_loaded_values_to_the_servers(tmp_path):
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        source = _models.mlp_l2(seed=11)
        path = str(tmp_path / "source.weights.h5")
        source.save_weights(path)
        model = _models.build_in_scope(_models.mlp_l2, strategy)
        model.load_weights(path)
        client = cluster.clients()[0]
        for variable, expected in zip(model.weights, source.weights):
            (state,) = client.pull([strategy.extended.variable_router.route(variable).keys[0]])
            np.testing.assert_array_equal(state.value, keras.ops.convert_to_numpy(expected))


def test_model_checkpoint_on_the_chief_writes_the_servers_state(tmp_path):
    x, y = _models.classification_data(128)
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        model = _models.build_in_scope(_models.mlp_l2, strategy)
        path = str(tmp_path / "checkpoint.keras")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(path)])
        store = strategy.extended.variable_router
        server_values = []
        for variable in model.weights:
            route = store.route(variable)
            (state,) = store.clients[route.placement.shards[0].ps_index].pull([route.keys[0]])
            server_values.append(state.value)
        slots = store.optimizer_state(store.routes(model.trainable_weights))
    loaded = keras.saving.load_model(path)
    for weight, value in zip(loaded.weights, server_values):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(weight), value)
    # Adam's iteration count and first slot came from the servers, not from the worker's unused copy.
    assert int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)) == 4
    first_momentum = next(v for v in loaded.optimizer.variables if "momentum" in v.path)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(first_momentum), slots[0][1]["momentum"])


def test_an_unreachable_parameter_server_gives_a_retryable_error_in_bounded_time():
    import time

    from kdist.errors import ParameterServerUnavailableError
    from kdist.ps import ServiceOptions
    from tests import harness

    (port,) = harness.free_ports(1)
    resolver = kdist.cluster.SimpleClusterResolver(
        {"worker": ["127.0.0.1:1"], "ps": [f"127.0.0.1:{port}"]}, task_type="worker", task_id=0
    )
    options = ServiceOptions(connect_timeout_seconds=1.0, rpc_timeout_seconds=2.0)
    strategy = kdist.ParameterServerStrategy(resolver, options=options)
    start = time.monotonic()
    with pytest.raises(ParameterServerUnavailableError) as error:
        with strategy.scope():
            keras.Variable(np.zeros(3, "float32"))
    assert error.value.retryable
    assert time.monotonic() - start < 10


def test_a_custom_train_step_matches_plain_keras():
    # The model's own train_step calls optimizer.apply_gradients: that path pushes too.
    x, y = _models.regression_data(256)
    reference = _models.custom_step()
    expected = reference.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False).history
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        model = _models.build_in_scope(_models.custom_step, strategy)
        got = model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False).history
    _models.assert_same_history(expected, got)
    for ref, cand in zip(reference.weights, model.weights):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(cand), keras.ops.convert_to_numpy(ref), atol=1e-5, rtol=1e-5)


def test_a_model_built_outside_the_scope_is_refused_with_a_clear_error():
    x, y = _models.classification_data(64)
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(4)])
        with strategy.scope():
            model.compile("sgd", "mse")
        with pytest.raises(UnsupportedError, match="created in strategy.scope"):
            model.fit(x, np.zeros((64, 4), "float32"), verbose=0)


def test_an_optimizer_shared_by_two_models_keeps_one_combined_push_per_step():
    # Attaching the optimizer to a second model must not drop the replica
    # engine's recorder around the push: each of the 2 replicas would then push
    # on its own (8 pushes instead of 4).
    x, y = _models.classification_data(256)
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), devices=["cpu:0", "cpu:1"])
        first = _models.build_in_scope(_models.mlp_l2, strategy)
        with strategy.scope():
            second = _models.mlp_l2(seed=3)
            second.compile(first.optimizer, loss=first.loss)
        before = cluster.stats()[0]
        second.fit(x, y, batch_size=64, epochs=1, verbose=0)
        after = cluster.stats()[0]
    assert after.requests.get("push", 0) - before.requests.get("push", 0) == 4
