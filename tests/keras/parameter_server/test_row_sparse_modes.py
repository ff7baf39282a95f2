"""Tables on parameter servers are read by rows in every mode, exactly, and bad ids are refused first.

A 200,000 x 16 float32 table (12.8 MB) read by a `keras.layers.Embedding` and
a second one read by a custom layer through `keras.ops.take(table, ids,
axis=0)`, each split over two parameter servers. In coordinator `fit`, in
`ClusterCoordinator.schedule` custom loops and in between-graph `fit` on two
local devices, the servers' own byte counters show a step moving the rows its
batch touches, not the tables; with SGD and Adagrad the result equals plain
single-device Keras (weights, optimizer slots, History).
"""

import time

import keras
from tests import seeding
import numpy as np
import pytest
import torch

import kdist
import kdist.coordinator
from kdist import faults
from kdist.distribute.parameter_server.partitioners import MinSizePartitioner
from kdist.errors import InvalidArgumentError
from kdist.keras.parameter_server import embeddings as ps_embeddings
from kdist.keras.parameter_server import worker_steps
from tests.coordinator import _cluster
from tests.keras import _ps

pytestmark = pytest.mark.timeout(120)

ROWS, DIM, IDS, BATCH, STEPS = 200_000, 16, 4, 32, 10
TABLE_BYTES = ROWS * DIM * 4


@keras.saving.register_keras_serializable("kdist_tests")
class TakeTable(keras.layers.Layer):
    """A table read with `keras.ops.take(table, ids, axis=0)`."""

    def __init__(self, rows, dim, **kwargs):
        super().__init__(**kwargs)
        self.rows, self.dim = rows, dim

    def build(self, input_shape):
        self.table = self.add_weight(shape=(self.rows, self.dim), initializer="uniform", name="table")

    def call(self, ids):
        return keras.ops.take(self.table, ids, axis=0)

    def get_config(self):
        return {**super().get_config(), "rows": self.rows, "dim": self.dim}


def build_model(optimizer="sgd"):
    seeding.set_random_seed(7)
    ids = keras.Input((IDS,), dtype="int64")
    merged = keras.layers.Add(name="add")([keras.layers.Embedding(ROWS, DIM, name="emb")(ids),
                                           TakeTable(ROWS, DIM, name="take")(ids)])
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(merged)
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(pooled)
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(hidden), name="recommender")
    made = keras.optimizers.SGD(0.5) if optimizer == "sgd" else keras.optimizers.Adagrad(0.3)
    model.compile(made, "mse")
    return model


def _data(seed=0, num=BATCH * STEPS):
    rng = np.random.default_rng(seed)
    # Few distinct ids, so a batch repeats some: duplicates must be summed.
    ids = rng.integers(0, 500, size=(num, IDS)).astype("int64") * 397 % ROWS
    y = (ids % 3).mean(axis=1, keepdims=True).astype("float32")
    return ids, y


def _partitioner():
    return MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)


def _bytes(stats):
    return sum(s.bytes_sent + s.bytes_received for s in stats)


def _step_bound(ids):
    # Rows read + row gradients pushed for both tables, the dense layers both ways, headers.
    return 2 * 2 * len(np.unique(ids)) * DIM * 4 + 64 * 1024


def _plain(initial, x, y, optimizer, epochs=1):
    plain = build_model(optimizer)
    plain.set_weights(initial)
    history = plain.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return plain, history


def _assert_same(model, plain, history, plain_history, atol=2e-5):
    for ours, theirs in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=atol)
    worker_steps.session_of(model).read_back()  # the servers' slots into the local optimizer
    ours = {v.path.split("/", 1)[-1]: keras.ops.convert_to_numpy(v) for v in model.optimizer.variables}
    theirs = {v.path.split("/", 1)[-1]: keras.ops.convert_to_numpy(v) for v in plain.optimizer.variables}
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, atol=atol, err_msg=name)
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_coordinator_fit_moves_rows_and_equals_plain_keras(tmp_path, optimizer):
    x, y = _data()
    with _cluster.start(num_workers=1, num_ps=2, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=_partitioner())
        kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
        with strategy.scope():
            model = build_model(optimizer)
        assert [len(strategy.extended.remote_view(w).variables) for w in (model.get_layer("emb").embeddings,
                                                                           model.get_layer("take").table)] == [2, 2]
        initial = model.get_weights()
        before = _bytes(cluster.ps_stats())
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        moved = _bytes(cluster.ps_stats()) - before
        # The chief reads both tables once when fit ends; every step moves rows only
        # (reading and pushing the tables whole would be 4 x 12.8 MB a step).
        assert moved < 2 * TABLE_BYTES + 2 * STEPS * _step_bound(x[:BATCH]), moved
        plain, plain_history = _plain(initial, x, y, optimizer, epochs=2)
        _assert_same(model, plain, history, plain_history)
        strategy.extended.cluster_coordinator.shutdown()


def test_schedule_custom_loop_moves_rows_only(tmp_path):
    x, y = _data()
    with _cluster.start(num_workers=1, num_ps=2, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=_partitioner())
        coordinator = kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
        with strategy.scope():
            model = build_model()
            optimizer = keras.optimizers.SGD(0.5)
        initial = model.get_weights()

        def train_step(ids, labels):
            def replica_fn(ids, labels):
                loss = keras.ops.mean((model(torch.as_tensor(ids), training=True) - torch.as_tensor(labels)) ** 2)
                model.zero_grad()
                loss.backward()
                variables = model.trainable_variables
                optimizer.apply_gradients(zip([v.value.grad for v in variables], variables))
                return loss.detach()

            return strategy.run(replica_fn, args=(ids, labels))

        before = _bytes(cluster.ps_stats())
        for step in range(STEPS):
            batch = slice(step * BATCH, (step + 1) * BATCH)
            coordinator.schedule(train_step, args=(x[batch], y[batch]))
        deadline = time.monotonic() + 60
        while not coordinator.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        moved = _bytes(cluster.ps_stats()) - before
        # Measured before join(), which refreshes the chief's copies (tables included) once.
        assert moved < STEPS * _step_bound(x[:BATCH]), moved
        coordinator.join()
        # The updates reached the servers: plain Keras with the same steps agrees.
        plain, _ = _plain(initial, x, y, "sgd")
        views = [strategy.extended.remote_view(weight) for weight in model.weights]
        trained = [view.numpy() for view in views]
        for value, expected in zip(trained, plain.get_weights()):
            np.testing.assert_allclose(value, expected, atol=2e-5)
        # A bad id on the worker: its typed error reaches the chief; nothing was applied.
        bad = x[:BATCH].copy()
        bad[3, 1] = ROWS + 7
        coordinator.schedule(train_step, args=(bad, y[:BATCH]))
        with pytest.raises(InvalidArgumentError, match=rf"(?s)emb.*id {ROWS + 7}.*V={ROWS}"):
            coordinator.join()
        for view, value in zip(views, trained):
            np.testing.assert_array_equal(view.numpy(), value)
        coordinator.shutdown()


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_between_graph_two_local_devices_moves_rows_and_equals_plain_keras(tmp_path, optimizer):
    x, y = _data(seed=1)
    with _ps.server_processes(2, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=_partitioner(),
                                                 devices=["cpu:0", "cpu:1"])
        with strategy.scope():
            model = build_model(optimizer)
        initial = model.get_weights()
        # Two replicas of 16 samples each: their rows merge into one push (union, summed).
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        plain, plain_history = _plain(initial, x, y, optimizer, epochs=2)
        _assert_same(model, plain, history, plain_history, atol=5e-5)
        before = _bytes(cluster.stats())
        model.train_on_batch(x[BATCH:2 * BATCH], y[BATCH:2 * BATCH])
        assert _bytes(cluster.stats()) - before < _step_bound(x[BATCH:2 * BATCH])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_between_graph_one_device_equals_plain_keras(optimizer):
    x, y = _data(seed=2)
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=_partitioner())
        with strategy.scope():
            model = build_model(optimizer)
        initial = model.get_weights()
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        plain, plain_history = _plain(initial, x, y, optimizer, epochs=2)
        _assert_same(model, plain, history, plain_history)


def build_twice():
    """One table looked up twice per step: its two row gradients must be added."""
    seeding.set_random_seed(7)
    ids = keras.Input((IDS,), dtype="int64")
    emb = keras.layers.Embedding(ROWS, DIM, name="emb")
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(keras.layers.Multiply(name="mul")([emb(ids), emb(ids)]))
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(pooled))
    model.compile(keras.optimizers.SGD(0.5), "mse")
    return model


def _overwriting_gradient_into(weight, ids):
    # A worker bug: a second lookup's row gradient replaces the first one's instead of adding to it.
    def hook(gradient):
        weight.grad = torch.sparse_coo_tensor(ids[None], gradient, size=tuple(weight.shape), check_invariants=False)

    return hook


@pytest.mark.parametrize("fault", ["dropped_row_gradient", "unsummed_duplicate_ids"])
def test_negative_controls_break_equality(monkeypatch, fault):
    """The equality checks can fail: a server dropping a row, a worker not summing a table's row gradients."""
    x, y = _data(seed=2)
    if fault == "dropped_row_gradient":
        monkeypatch.setattr(faults.ACTIVE, fault, True)  # in-process servers read it
    else:
        monkeypatch.setattr(ps_embeddings, "_sparse_gradient_into", _overwriting_gradient_into)
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=_partitioner(),
                                                 devices=["cpu:0", "cpu:1"])
        with strategy.scope():
            model = build_twice()
        initial = model.get_weights()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        plain = build_twice()
        plain.set_weights(initial)
        plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        ours, theirs = model.get_layer("emb").embeddings, plain.get_layer("emb").embeddings
        same = np.allclose(keras.ops.convert_to_numpy(ours), keras.ops.convert_to_numpy(theirs), atol=2e-5)
        assert not same


def test_one_table_looked_up_twice_equals_plain_keras():
    """The control's own positive case: without the bug, the two lookups' gradients add up."""
    x, y = _data(seed=2)
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=_partitioner(),
                                                 devices=["cpu:0", "cpu:1"])
        with strategy.scope():
            model = build_twice()
        initial = model.get_weights()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        plain = build_twice()
        plain.set_weights(initial)
        plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        for ours, theirs in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(ours, theirs, atol=2e-5)


@pytest.mark.parametrize(
    "bad, layer, shown",
    [(ROWS, "emb", f"id {ROWS}"), (-1, "emb", "id -1"), (1.5, "emb", "float ids .the id 1.5"), (ROWS + 3, "take", f"id {ROWS + 3}")],
)
def test_bad_ids_are_refused_naming_layer_id_and_v_before_any_push(bad, layer, shown):
    x, y = _data(seed=3, num=BATCH)
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=_partitioner())
        with strategy.scope():
            model = build_model()
        model.train_on_batch(x, y)
        if layer == "take" or isinstance(bad, float):
            # ops.take alone (the Embedding refuses first otherwise); float ids reach a layer
            # only through a float Input (an int64 Input casts them before any layer runs).
            inputs = keras.Input((IDS,), dtype="float32" if isinstance(bad, float) else "int64")
            model = keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(model.get_layer(layer)(inputs)))
            with strategy.scope():
                model.compile(keras.optimizers.SGD(0.5), "mse")
            y = np.zeros((BATCH, DIM), "float32")
        views = [strategy.extended.remote_view(w) for w in model.weights]
        before_values = [view.numpy() for view in views]
        before = [s.applied_pushes for s in cluster.stats()]
        bad_x = x.astype("float32") if isinstance(bad, float) else x.copy()
        bad_x[5, 2] = bad
        with pytest.raises(InvalidArgumentError, match=rf"(?s){layer}.*{shown}.*V={ROWS}"):
            model.train_on_batch(bad_x, y)
        assert [s.applied_pushes for s in cluster.stats()] == before
        for view, value in zip(views, before_values):
            np.testing.assert_array_equal(view.numpy(), value)


def build_regularized():
    seeding.set_random_seed(7)
    ids = keras.Input((IDS,), dtype="int64")
    emb = keras.layers.Embedding(ROWS, DIM, name="emb", embeddings_regularizer=keras.regularizers.L2(1e-4))
    model = keras.Sequential([ids, emb, keras.layers.GlobalAveragePooling1D(name="pool"), keras.layers.Dense(1, name="out")])
    model.compile(keras.optimizers.SGD(0.5), "mse")
    return model


def test_a_table_also_read_densely_is_read_whole_and_stays_exact():
    """A regularizer reads the whole table: the step reads it from the servers first, then trains densely."""
    x, y = _data(seed=4)
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=_partitioner())
        with strategy.scope():
            model = build_regularized()
        initial = model.get_weights()
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        assert not strategy.extended.variable_router.route(model.get_layer("emb").embeddings).row_sparse
        plain = build_regularized()
        plain.set_weights(initial)
        plain_history = plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        for ours, theirs in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(ours, theirs, atol=2e-5)
        np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)
