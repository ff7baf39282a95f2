"""A 100,000 x 64 embedding table split over two parameter servers.

It trains, and a step moves only the rows the batch looks up (asserted on the
servers' byte counters), never the 25.6 MB table.
"""

import keras
import numpy as np
import pytest

import kdist
from kdist.distribute.parameter_server.partitioners import MinSizePartitioner
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
    keras.utils.set_random_seed(3)
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
