"""Tables held by the parameter servers only: no copy on the worker or the chief, and still the same numbers.

An `Embedding` table (and a row-partitioned `ops.take` table) created in scope
is initialised on its servers with the layer's own Keras initializer; the local
variable holds a `RemoteTable` of one element's memory. Training equals plain
Keras built from the same seed (no `set_weights`: the servers' initial values
themselves are compared); reading and writing the whole variable goes to the
servers; a gradient outside a kdist step is refused; a worker's peak memory
does not grow with the table.
"""

import json
import sys

import keras
from tests import seeding
import numpy as np
import pytest
import torch

import kdist
import kdist.coordinator
from kdist.distribute.parameter_server.partitioners import MinSizePartitioner
from kdist.errors import UnsupportedError
from kdist.keras.parameter_server import remote_tables, worker_steps
from tests import harness
from tests.coordinator import _cluster
from tests.keras import _ps
from tests.keras.parameter_server.test_row_sparse_modes import TakeTable

pytestmark = pytest.mark.timeout(180)

ROWS, DIM, IDS, BATCH, STEPS = 50_000, 8, 4, 32, 6


def build(optimizer="adagrad", initializer="uniform"):
    seeding.set_random_seed(11)
    ids = keras.Input((IDS,), dtype="int64")
    merged = keras.layers.Add()([keras.layers.Embedding(ROWS, DIM, embeddings_initializer=initializer, name="emb")(ids),
                                 TakeTable(ROWS, DIM, name="take")(ids)])
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(keras.layers.GlobalAveragePooling1D()(merged)))
    model.compile(keras.optimizers.Adagrad(0.3) if optimizer == "adagrad" else keras.optimizers.SGD(0.5), "mse")
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, ROWS, size=(BATCH * STEPS, IDS)).astype("int64")
    return ids, rng.random((BATCH * STEPS, 1)).astype("float32")


def _strategy(cluster):
    return kdist.ParameterServerStrategy(cluster.resolver(),
                                         variable_partitioner=MinSizePartitioner(64 << 10, max_shards=2))


def _tables(model):
    return [model.get_layer("emb").embeddings, model.get_layer("take").table]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_tables_live_on_the_servers_and_train_like_plain_keras(optimizer):
    x, y = _data()
    with _ps.in_process_servers(2) as cluster:
        strategy = _strategy(cluster)
        with strategy.scope():
            model = build(optimizer)
        for table in _tables(model):
            stand_in = remote_tables.of(table)
            assert stand_in is not None and stand_in.stride() == (0, 0), table.path
        # The creator sent no table: what the servers received is far below one table.
        assert sum(s.bytes_received for s in cluster.stats()) < ROWS * DIM * 4 // 4
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        plain = build(optimizer)  # same seed: its initial tables are what the servers computed
        plain_history = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        assert all(remote_tables.of(table) is not None for table in _tables(model))  # still no local copy
        for ours, theirs in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(ours, theirs, atol=2e-5)
        np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)
        np.testing.assert_allclose(model.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0), rtol=1e-5)
        np.testing.assert_allclose(model.predict(x, verbose=0), plain.predict(x, verbose=0), atol=1e-5)
        np.testing.assert_allclose(model(x[:8]).detach().numpy(), plain(x[:8]).detach().numpy(), atol=1e-5)
        if optimizer == "adagrad":
            # Slots are stand-ins too, until the chief reads them back (as a save does).
            assert any(remote_tables.of(v) is not None for v in model.optimizer.variables)
            worker_steps.session_of(model).read_back()
            ours = {v.path.split("/", 1)[-1]: keras.ops.convert_to_numpy(v) for v in model.optimizer.variables}
            theirs = {v.path.split("/", 1)[-1]: keras.ops.convert_to_numpy(v) for v in plain.optimizer.variables}
            for name, value in theirs.items():
                np.testing.assert_allclose(ours[name], value, atol=2e-5, err_msg=name)


def test_whole_reads_and_writes_go_to_the_servers(tmp_path):
    with _ps.in_process_servers(2) as cluster:
        strategy = _strategy(cluster)
        with strategy.scope():
            model = build("sgd")
        table = model.get_layer("emb").embeddings
        view = strategy.extended.remote_view(table)
        np.testing.assert_array_equal(table.numpy(), view.numpy())
        new = np.random.default_rng(1).random((ROWS, DIM)).astype("float32")
        table.assign(new)
        np.testing.assert_array_equal(view.numpy(), new)
        weights = model.get_weights()
        weights[0] = new * 2
        model.set_weights(weights)
        np.testing.assert_array_equal(view.numpy(), new * 2)
        path = tmp_path / "model.weights.h5"
        model.save_weights(path)
        table.assign(np.zeros((ROWS, DIM), "float32"))
        model.load_weights(path)
        np.testing.assert_array_equal(view.numpy(), new * 2)
        assert remote_tables.of(table) is not None


def test_a_gradient_outside_a_kdist_step_is_refused():
    with _ps.in_process_servers(1) as cluster:
        strategy = _strategy(cluster)
        with strategy.scope():
            model = build("sgd")
        loss = model(np.zeros((2, IDS), "int64")).sum()
        with pytest.raises(UnsupportedError, match="outside a step kdist runs"):
            loss.backward()


def test_initializers_the_servers_cannot_rerun_stay_local():
    class Halves(keras.initializers.Initializer):
        def __call__(self, shape, dtype=None):
            return keras.ops.full(shape, 0.5, dtype=dtype)

    x, y = _data()
    with _ps.in_process_servers(2) as cluster:
        strategy = _strategy(cluster)
        with strategy.scope():
            model = build("sgd", initializer=Halves())
        assert remote_tables.of(model.get_layer("emb").embeddings) is None
        assert remote_tables.of(model.get_layer("take").table) is not None
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        plain = build("sgd", initializer=Halves())
        plain.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        for ours, theirs in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(ours, theirs, atol=2e-5)


_WORKER = """
import json, sys
import numpy as np, keras, kdist
from kdist.cluster import SimpleClusterResolver
from kdist.distribute.parameter_server.partitioners import MinSizePartitioner
spec, rows = json.loads(sys.argv[1]), int(sys.argv[2])
strategy = kdist.ParameterServerStrategy(SimpleClusterResolver(spec, task_type="worker", task_id=0),
                                         variable_partitioner=MinSizePartitioner(256 << 10, max_shards=2))
with strategy.scope():
    model = keras.Sequential([keras.Input((20,), dtype="int64"), keras.layers.Embedding(rows, 64),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adagrad(0.01), "mse")
rng = np.random.default_rng(0)
model.fit(rng.integers(0, rows, (1024, 20)), rng.random((1024, 1)), batch_size=256, epochs=1, verbose=0)
peak = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0].split()[1]
print("PEAK_KB", peak)
"""


def _worker_peak_kb(tmp_path, rows):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    with _ps.server_processes(2, tmp_path=tmp_path) as cluster:
        spec = harness.ProcessSpec(f"worker-{rows}", (sys.executable, str(script), json.dumps(cluster.spec), str(rows)),
                                   {"OMP_NUM_THREADS": "1"})
        result = harness.run([spec], timeout=150).check()
    return int(result.output(f"worker-{rows}").split("PEAK_KB")[-1].split()[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_worker_s_peak_memory_does_not_grow_with_the_table(tmp_path):
    small = _worker_peak_kb(tmp_path, 10_000)
    large = _worker_peak_kb(tmp_path, 2_000_000)  # 512 MB table, 512 MB Adagrad slot
    assert large - small < 100 * 1024, f"peak RSS {small} KB at 10^4 rows, {large} KB at 2*10^6"


def test_a_dense_use_in_a_step_makes_the_stand_in_an_ordinary_parameter_in_place():
    with _ps.in_process_servers(1) as cluster:
        strategy = _strategy(cluster)
        with strategy.scope():
            model = build("sgd")
        table = model.get_layer("emb").embeddings
        stand_in = remote_tables.of(table)
        expected = table.numpy()
        stand_in.materialise(torch.from_numpy(expected))
        assert type(table.value) is torch.nn.Parameter and table.value is stand_in  # the same object
        np.testing.assert_array_equal(table.numpy(), expected)


def _worker_holds(model):
    """Run on a coordinator's worker: what its rebuilt model holds for each weight."""
    return [type(remote_tables.of(weight)).__name__ for weight in model.weights]


def test_coordinator_workers_hold_no_table_and_fit_equals_plain_keras(tmp_path):
    x, y = _data()
    with _cluster.start(num_workers=1, num_ps=2, tmp_path=tmp_path) as cluster:
        strategy = _strategy(cluster)
        coordinator = kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
        with strategy.scope():
            model = build("adagrad")
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        held = coordinator.schedule(_worker_holds, args=(model,)).fetch()
        assert held.count("RemoteTable") == 2, held  # the two tables: stand-ins on the worker too
        plain = build("adagrad")
        plain_history = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        for ours, theirs in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(ours, theirs, atol=2e-5)
        np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)


def _peak_rss_kb():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _coordinator_worker_peak_kb(tmp_path, rows):
    with _cluster.start(num_workers=1, num_ps=2, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(),
                                                 variable_partitioner=MinSizePartitioner(256 << 10, max_shards=2))
        coordinator = kdist.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            model = keras.Sequential([keras.Input((20,), dtype="int64"), keras.layers.Embedding(rows, 64),
                                      keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
            # Adagrad's accumulators start at 0.1: a slot made on the worker would be written, so counted.
            model.compile(keras.optimizers.Adagrad(0.01), "mse")
        rng = np.random.default_rng(0)
        model.fit(rng.integers(0, rows, (1024, 20)), rng.random((1024, 1)), batch_size=256, epochs=1, verbose=0)
        return coordinator.schedule(_peak_rss_kb).fetch()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KB")
def test_a_coordinator_worker_s_peak_memory_does_not_grow_with_the_table(tmp_path):
    # The worker rebuilds the chief's compiled model: Keras builds its optimizer while
    # deserialising it, before the table is bound. Its slots must be stand-ins even then.
    small = _coordinator_worker_peak_kb(tmp_path, 10_000)
    large = _coordinator_worker_peak_kb(tmp_path, 2_000_000)  # 512 MB table, 512 MB accumulator
    assert large - small < 100 * 1024, f"worker peak RSS {small} KB at 10^4 rows, {large} KB at 2*10^6"
