"""`model.fit` and `model.evaluate` on the chief, driving workers through the coordinator."""

import numpy as np
import pytest

import kdist
import kdist.coordinator
import keras
from tests.coordinator import _cluster, _functions

pytestmark = pytest.mark.timeout(300)


def _compiled(strategy, steps_per_execution=1):
    with strategy.scope():
        model = _functions.build_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=steps_per_execution)
    return model


def _plain(initial_weights):
    model = _functions.build_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.set_weights(initial_weights)
    return model


class _BatchLogs(keras.callbacks.Callback):
    """Records `(epoch, batch, logs)` at every train batch end."""

    def __init__(self):
        super().__init__()
        self.records, self._epoch = [], None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.records.append((self._epoch, batch, dict(logs)))


def test_fit_on_one_worker_equals_plain_keras(tmp_path):
    """Array data, no shuffling, one worker: the same global batches in the same order as plain Keras."""
    x, y = _functions.make_digits(256, seed=1)
    x_val, y_val = _functions.make_digits(64, seed=2)
    with _cluster.start(num_workers=1, num_ps=1, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        # One closure in flight: the worker runs the closures in schedule order,
        # as plain Keras runs the batches (with two, neighbours may swap).
        kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
        model = _compiled(strategy, steps_per_execution=3)
        initial = model.get_weights()
        batch_logs = _BatchLogs()
        history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                            validation_data=(x_val, y_val), callbacks=[batch_logs])
        evaluated = model.evaluate(x_val, y_val, batch_size=32, verbose=0, return_dict=True)
        weights = model.get_weights()
        predictions = model.predict(x_val, verbose=0)
        strategy.extended.cluster_coordinator.shutdown()
    plain = _plain(initial)
    plain_batch_logs = _BatchLogs()
    plain_history = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, validation_data=(x_val, y_val),
                              callbacks=[plain_batch_logs])
    # A callback with a batch-end hook hears once per closure of 3, 3 and 2 steps, with
    # the same running logs plain Keras has after that step.
    assert [(epoch, batch) for epoch, batch, _ in batch_logs.records] == [(e, b) for e in (0, 1) for b in (2, 5, 7)]
    plain_logs = {(epoch, batch): logs for epoch, batch, logs in plain_batch_logs.records}
    for epoch, batch, logs in batch_logs.records:
        for key, value in plain_logs[(epoch, batch)].items():
            assert logs[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (epoch, batch, key)
    for got, expected in zip(weights, plain.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    for key, values in plain_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-5, err_msg=key)
    expected = plain.evaluate(x_val, y_val, batch_size=32, verbose=0, return_dict=True)
    for key, value in expected.items():
        assert evaluated[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    np.testing.assert_allclose(predictions, plain.predict(x_val, verbose=0), rtol=1e-5, atol=1e-6)


def test_fit_with_a_dataset_fn_needs_steps_per_epoch_and_shows_progress(tmp_path, capsys):
    with _cluster.start(num_workers=1, num_ps=1, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        model = _compiled(strategy)
        with pytest.raises(kdist.errors.InvalidArgumentError, match="steps_per_epoch is required"):
            model.fit(_functions.dataset_fn, epochs=1, verbose=0)
        with pytest.raises(kdist.errors.UnsupportedError, match="class_weight"):
            model.fit(_functions.dataset_fn, epochs=1, steps_per_epoch=2, class_weight={0: 1.0})
        history = model.fit(_functions.dataset_fn, epochs=2, steps_per_epoch=4, verbose=1)
        strategy.extended.cluster_coordinator.shutdown()
    assert len(history.history["loss"]) == 2
    progress = capsys.readouterr().out
    # Keras' ProgbarLogger: off a terminal, one line per epoch (see tests/keras/parameter_server/test_chief_progress.py).
    assert "Epoch 2/2" in progress and "4/4 - " in progress and "/step - " in progress


def test_fit_with_two_workers_two_ps_and_partitioned_variables_saves_the_ps_state(tmp_path):
    """2 workers + 2 ps, MinSizePartitioner, a dataset_fn, BackupAndRestore + ModelCheckpoint.

    The cluster lists an evaluator that never starts: the chief does not wait for it.
    """
    x_test, y_test = _functions.make_digits(400, seed=9)
    checkpoint = str(tmp_path / "model-{epoch}.keras")
    with _cluster.start(num_workers=2, num_ps=2, tmp_path=tmp_path, evaluator=True) as cluster:
        strategy = kdist.ParameterServerStrategy(
            cluster.resolver(),
            variable_partitioner=kdist.partitioners.MinSizePartitioner(min_shard_bytes=1024, max_shards=2))
        with strategy.scope():
            model = _functions.build_model()
            model.compile(optimizer=keras.optimizers.Adam(0.02), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"], steps_per_execution=5)
        kernel = model.layers[1].kernel
        assert strategy.extended.placement(kernel).is_partitioned
        history = model.fit(
            _functions.dataset_fn, epochs=3, steps_per_epoch=40, verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
                       keras.callbacks.ModelCheckpoint(checkpoint)])
        model.save(tmp_path / "final.keras")
        stats = cluster.ps_stats()
        coordinator = strategy.extended.cluster_coordinator
        coordinator_stats = coordinator.stats
        server_values = {
            key: value for client in strategy.extended.variable_router.clients
            for key, value in zip(*_read_all(client))}
        coordinator.shutdown()
    assert len(history.history["loss"]) == 3
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert coordinator_stats["closures_done"] == 3 * 40 // 5
    # Both parameter servers hold shards, and every trainable shard got every step.
    assert all(server.variables for server in stats)
    applied = {v.applied_updates for server in stats for v in server.variables.values()}
    assert applied == {3 * 40}
    reloaded = keras.saving.load_model(tmp_path / "final.keras")
    # Well above chance (0.1) after 120 steps of asynchronous training.
    assert _functions.accuracy_of(reloaded, x_test, y_test) >= 0.6
    # The saved kernel is the concatenation of its shards on the servers.
    layer = reloaded.layers[1]
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(layer.kernel),
        np.concatenate([server_values[key] for key in strategy.extended.variable_router.route(kernel).keys]))
    for epoch in (1, 2, 3):
        assert (tmp_path / f"model-{epoch}.keras").exists()


def _read_all(client):
    names = list(client.stats().variables)
    return names, [state.value for state in client.pull(names)]
