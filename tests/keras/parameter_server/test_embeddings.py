"""Tables on parameter servers are read by rows, and custom loops train them exactly.

A 100,000 x 64 embedding table split over two parameter servers trains, and a
step moves only the rows the batch looks up (asserted on the servers' byte
counters), never the 25.6 MB table.

Custom loops over a 10^6-row table the servers hold (`torch.autograd.grad`
over `v.value`, as TensorFlow's `tape.gradient` renamed, and `loss.backward()`
with `.grad`), in a worker's own loop (between-graph) and in
`ClusterCoordinator.schedule` closures: the table's gradient is a sparse row
gradient, `apply_gradients` pushes its rows only (the servers count the bytes
and the rows), and the result equals plain single-device Keras running the
same loop (which computes a dense gradient). A dense gradient for such a
table is refused, naming the variable and the rule.
"""

import keras
from tests import seeding
import numpy as np
import pytest
import torch

import kdist
import kdist.coordinator
from kdist.distribute.parameter_server.partitioners import MinSizePartitioner
from kdist.errors import UnsupportedError
from kdist.keras.parameter_server import remote_tables
from tests.coordinator import _cluster
from tests.keras import _ps

pytestmark = pytest.mark.timeout(300)

ROWS, DIM = 100_000, 64
IDS_PER_SAMPLE = 4
BATCH = 32


def _data(num_samples, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, ROWS, size=(num_samples, IDS_PER_SAMPLE)).astype("int64")
    y = (ids % 2).mean(axis=1, keepdims=True).astype("float32")
    return ids, y


def _build():
    seeding.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((IDS_PER_SAMPLE,), dtype="int64"),
            keras.layers.Embedding(ROWS, DIM),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


def _payload_bytes(stats):
    return sum(s.bytes_sent + s.bytes_received for s in stats)


def test_sharded_embedding_trains_and_moves_only_looked_up_rows(tmp_path):
    x, y = _data(640)
    with _ps.server_processes(2, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(
            cluster.resolver(), variable_partitioner=MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
        )
        with strategy.scope():
            model = _build()
        table = model.layers[0].embeddings
        view = strategy.extended.remote_view(table)
        assert [(s.row_start, s.row_stop, s.ps_index) for s in view.variables] == [(0, 50_000, 0), (50_000, 100_000, 1)]
        initial = np.array(keras.ops.convert_to_numpy(table))

        model.train_on_batch(x[:BATCH], y[:BATCH])  # builds the optimizer, configures the servers
        before = cluster.stats()
        model.train_on_batch(x[BATCH : 2 * BATCH], y[BATCH : 2 * BATCH])
        after = cluster.stats()
        step_bytes = _payload_bytes(after) - _payload_bytes(before)
        table_bytes = ROWS * DIM * 4
        looked_up = len(np.unique(x[BATCH : 2 * BATCH]))
        # Rows read + row gradients pushed, the small dense layer both ways, and
        # the fit-end read-back of what changed; far below one table transfer.
        assert step_bytes < 6 * looked_up * DIM * 4 + 64 * 1024, step_bytes
        assert step_bytes < table_bytes / 100
        for old, new in zip(before, after):
            assert new.requests.get("lookup", 0) - old.requests.get("lookup", 0) >= 1

        history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0)
        assert history.history["loss"][-1] < history.history["loss"][0]
        trained = view.numpy()
        touched = np.unique(x)
        untouched = np.setdiff1d(np.arange(ROWS), touched)[:1000]
        assert not np.allclose(trained[touched], initial[touched])
        # Adam moves nothing whose gradient was always zero.
        np.testing.assert_array_equal(trained[untouched], initial[untouched])
        # After fit, the local table holds the servers' values.
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(table), trained)


# ----- custom loops over a table the servers hold -------------------------------------
BIG_ROWS, BIG_DIM, BIG_STEPS = 1_000_000, 8, 3
BIG_TABLE_BYTES = BIG_ROWS * BIG_DIM * 4


def _build_big():
    seeding.set_random_seed(5)
    return keras.Sequential(
        [
            keras.Input((IDS_PER_SAMPLE,), dtype="int64"),
            keras.layers.Embedding(BIG_ROWS, BIG_DIM, name="emb"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1, name="out"),
        ]
    )


def _big_data(step):
    rng = np.random.default_rng(step)
    # Few distinct ids, so a batch repeats some: their rows' gradients are summed.
    ids = (rng.integers(0, 40, size=(BATCH, IDS_PER_SAMPLE)) * 24_989 % BIG_ROWS).astype("int64")
    return ids, (ids % 2).mean(axis=1, keepdims=True).astype("float32")


def _custom_step(model, optimizer, form, ids, labels):
    """One step of a custom loop: forward, the gradient in `form`, `apply_gradients`."""
    loss = keras.ops.mean((model(torch.as_tensor(ids), training=True) - torch.as_tensor(labels)) ** 2)
    variables = model.trainable_variables
    if form == "autograd.grad":
        gradients = torch.autograd.grad(loss, [v.value for v in variables])
    else:
        model.zero_grad()
        loss.backward()
        gradients = [v.value.grad for v in variables]
    optimizer.apply_gradients(zip(gradients, variables))
    return loss.detach()


def _plain_big(form):
    """Plain Keras on one device running the same loop: the table's gradient is dense there."""
    model = _build_big()
    optimizer = keras.optimizers.Adagrad(0.3)
    for step in range(BIG_STEPS):
        _custom_step(model, optimizer, form, *_big_data(step))
    return model


def _table_stats(stats, keys):
    """`(bytes received, bytes sent, rows updated of the table's shards)` summed over the servers."""
    rows = sum(server.variables[key].rows_updated for server in stats for key in keys if key in server.variables)
    return sum(s.bytes_received for s in stats), sum(s.bytes_sent for s in stats), rows


def _assert_step_moved_rows(before, after, ids):
    touched = len(np.unique(ids))
    received, sent = after[0] - before[0], after[1] - before[1]
    row_bytes = touched * (BIG_DIM * 4 + 8)  # a row and its id
    # Pushed: the touched rows' gradients (+ the small dense layer, ids, headers); read: the rows.
    assert received < 2 * row_bytes + 8 * 1024, (received, touched)
    assert sent < 2 * row_bytes + 8 * 1024, (sent, touched)
    assert received < BIG_TABLE_BYTES / 1000
    assert after[2] - before[2] == touched  # the servers applied exactly the touched rows
    return received


def _assert_equals_plain(strategy, model, plain):
    table = model.get_layer("emb").embeddings
    assert remote_tables.of(table) is not None  # still no local copy of the table
    trained = strategy.extended.remote_view(table).numpy()
    np.testing.assert_allclose(trained, keras.ops.convert_to_numpy(plain.get_layer("emb").embeddings), atol=1e-6)
    for ours, theirs in zip(model.get_layer("out").get_weights(), plain.get_layer("out").get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)


def _big_partitioner():
    return MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)


@pytest.mark.parametrize("form", ["autograd.grad", "backward"])
def test_between_graph_custom_loop_pushes_rows_only_and_equals_plain_keras(form):
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=_big_partitioner())
        with strategy.scope():
            model = _build_big()
            optimizer = keras.optimizers.Adagrad(0.3)
        keys = strategy.extended.variable_router.route(model.get_layer("emb").embeddings).keys
        assert len(keys) == 2
        for step in range(BIG_STEPS):
            ids, labels = _big_data(step)
            before = _table_stats(cluster.stats(), keys)
            strategy.run(_custom_step, args=(model, optimizer, form, ids, labels))
            received = _assert_step_moved_rows(before, _table_stats(cluster.stats(), keys), ids)
            print(f"{form} step {step}: {len(np.unique(ids))} rows, {received} bytes received by the servers")
        _assert_equals_plain(strategy, model, _plain_big(form))


@pytest.mark.parametrize("form", ["autograd.grad", "backward"])
def test_scheduled_custom_loop_pushes_rows_only_and_equals_plain_keras(tmp_path, form):
    with _cluster.start(num_workers=1, num_ps=2, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=_big_partitioner())
        coordinator = kdist.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = _build_big()
            optimizer = keras.optimizers.Adagrad(0.3)
        keys = strategy.extended.variable_router.route(model.get_layer("emb").embeddings).keys

        def worker_fn(ids, labels):
            return strategy.run(_custom_step, args=(model, optimizer, form, ids, labels))

        for step in range(BIG_STEPS):
            ids, labels = _big_data(step)
            before = _table_stats(cluster.ps_stats(), keys)
            coordinator.schedule(worker_fn, args=(ids, labels)).fetch()  # one step at a time
            _assert_step_moved_rows(before, _table_stats(cluster.ps_stats(), keys), ids)
        coordinator.join()
        _assert_equals_plain(strategy, model, _plain_big(form))
        coordinator.shutdown()


def test_second_order_gradients_through_a_table_equal_plain_keras():
    """`create_graph=True`: a penalty on the table's own gradient differentiates through the lookup exactly."""

    def penalised_step(model, optimizer, ids, labels):
        loss = keras.ops.mean((model(torch.as_tensor(ids), training=True) - torch.as_tensor(labels)) ** 2)
        variables = model.trainable_variables
        first = torch.autograd.grad(loss, [v.value for v in variables], create_graph=True)
        table_gradient = first[0].coalesce().values() if first[0].is_sparse else first[0]
        total = loss + 10.0 * (table_gradient**2).sum()
        optimizer.apply_gradients(zip(torch.autograd.grad(total, [v.value for v in variables]), variables))

    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = _build_big()
            optimizer = keras.optimizers.Adagrad(0.3)
        plain, plain_optimizer = _build_big(), keras.optimizers.Adagrad(0.3)
        for step in range(2):
            strategy.run(penalised_step, args=(model, optimizer, *_big_data(step)))
            penalised_step(plain, plain_optimizer, *_big_data(step))
        _assert_equals_plain(strategy, model, plain)


def test_a_dense_gradient_for_a_table_is_refused_naming_it_and_nothing_is_pushed():
    def densified_step(model, optimizer, ids, labels):
        loss = keras.ops.mean((model(torch.as_tensor(ids), training=True) - torch.as_tensor(labels)) ** 2)
        variables = model.trainable_variables
        gradients = [g.to_dense() if g.is_sparse else g for g in torch.autograd.grad(loss, [v.value for v in variables])]
        optimizer.apply_gradients(zip(gradients, variables))

    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = keras.Sequential([keras.Input((IDS_PER_SAMPLE,), dtype="int64"), keras.layers.Embedding(1000, 4),
                                      keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD(0.1)
        before = [s.applied_pushes for s in cluster.stats()]
        ids, labels = _big_data(0)
        with pytest.raises(UnsupportedError, match=r"(?s)'sequential.*/embeddings'.*dense gradient.*rows"):
            strategy.run(densified_step, args=(model, optimizer, ids % 1000, labels))
        assert [s.applied_pushes for s in cluster.stats()] == before
        assert int(optimizer.iterations.numpy()) == 0
