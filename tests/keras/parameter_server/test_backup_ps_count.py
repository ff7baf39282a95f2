"""A parameter-server `BackupAndRestore` backup written with 2 ps restores exactly with 1 and with 3.

The backup is an ordinary Keras weights file: the chief reads every variable,
every optimizer slot and the iterations back from the servers, whole (a
partitioned variable as the concatenation of its shards). Restoring writes each
value to the servers of the job that restores it, split by that job's
partitioning. Between-graph training, one worker (this process, so training is
synchronous and equals plain Keras) and real gRPC servers in this process:

- 2 ps, `FixedShardsPartitioner(2)`: `fit` is interrupted after its first
  epoch's backup;
- the same `fit` again on 1 ps (one shard each) and on 3 ps
  (`MinSizePartitioner`, the embedding table in 3 shards) restores the backup:
  what the servers hold after the restore equals the backup file (variables,
  slots, iterations), and the run ends equal to plain Keras never interrupted
  (weights, slots, iterations, History of the resumed epoch, evaluate, predict).

Negative control: the same backup with its optimizer slots lost (zeroed in the
file) no longer equals the uninterrupted run.

The optimizer state reaches the servers through `load_weights`
(`kdist.keras.parameter_server.variable_writes`, the `LoadOptimizerState` call).
"""

import shutil

import h5py
import keras
from tests import seeding
import numpy as np
import pytest

import kdist
from kdist.distribute.parameter_server.partitioners import FixedShardsPartitioner, MinSizePartitioner
from tests.keras import _ps

pytestmark = pytest.mark.timeout(300)

ROWS, DIM, IDS = 40, 8, 4
BATCH = 32
SAMPLES = 256
EPOCHS = 2
WEIGHTS_FILE = "latest.weights.h5"  # Keras' BackupAndRestore file name


class Interrupted(Exception):
    pass


class InterruptAtEpoch(keras.callbacks.Callback):
    """Raises when epoch `epoch` begins: the previous epoch's backup is on disk, training stops."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise Interrupted(f"interrupted before epoch {epoch}")


class SnapshotAfterRestore(keras.callbacks.Callback):
    """At the first epoch the fit runs, saves what the servers hold (the chief reads it back)."""

    def __init__(self, path):
        super().__init__()
        self.path, self.epochs = path, []

    def on_epoch_begin(self, epoch, logs=None):
        if not self.epochs:
            self.model.save_weights(self.path)
        self.epochs.append(epoch)


def make_data():
    rng = np.random.default_rng(5)
    ids = rng.integers(0, ROWS, size=(SAMPLES, IDS)).astype("int64")
    y = (np.sin(ids).mean(axis=1, keepdims=True) + 0.1 * rng.normal(size=(SAMPLES, 1))).astype("float32")
    return ids, y


def build_model():
    seeding.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((IDS,), dtype="int64"),
        keras.layers.Embedding(ROWS, DIM),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(6, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile(keras.optimizers.Adam(0.02), "mse", metrics=["mae"])
    return model


def fit(model, callbacks, x, y):
    # shuffle=False: the backup is taken at an epoch's end, where Keras resumes.
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    return history.history


def results(model, history, x, y):
    values = {f"history/{key}": np.asarray(value, "float64") for key, value in history.items()}
    for i, variable in enumerate(model.weights):
        values[f"weight/{i}"] = np.asarray(keras.ops.convert_to_numpy(variable))
    for i, variable in enumerate(model.optimizer.variables):  # iterations first, then the slots
        values[f"optimizer/{i}"] = np.asarray(keras.ops.convert_to_numpy(variable))
    values["evaluate"] = np.asarray(model.evaluate(x, y, batch_size=BATCH, verbose=0), "float64")
    values["predict"] = model.predict(x, batch_size=BATCH, verbose=0)
    return values


def h5_values(path):
    """Every dataset of a Keras weights file, by its path in the file."""
    values = {}
    with h5py.File(path, "r") as file:
        file.visititems(lambda name, item: values.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None)
    return values


def mismatches(expected, got):
    assert set(expected) == set(got)
    differing = []
    for key, value in got.items():
        wanted = expected[key][-len(value):] if key.startswith("history/") else expected[key]
        if np.shape(wanted) != np.shape(value) or not np.allclose(wanted, value, rtol=2e-5, atol=2e-6):
            differing.append(key)
    return differing


@pytest.fixture(scope="module")
def uninterrupted():
    x, y = make_data()
    model = build_model()
    history = fit(model, [], x, y)
    return results(model, history, x, y)


@pytest.fixture(scope="module")
def backup(tmp_path_factory):
    """The backup of a 2-ps job (FixedShardsPartitioner(2)) interrupted after its first epoch."""
    directory = tmp_path_factory.mktemp("backup-2ps") / "backup"
    x, y = make_data()
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=FixedShardsPartitioner(2))
        with strategy.scope():
            model = build_model()
        table = model.layers[0].embeddings
        assert [s.ps_index for s in strategy.extended.remote_view(table).variables] == [0, 1]
        with pytest.raises(Interrupted):
            fit(model, [keras.callbacks.BackupAndRestore(str(directory)), InterruptAtEpoch(1)], x, y)
    return directory


RESTORES = {
    "1_ps": (1, lambda: FixedShardsPartitioner(1), 1),
    "3_ps": (3, lambda: MinSizePartitioner(min_shard_bytes=256, max_shards=3), 3),
}


def resume(tmp_path, backup_dir, num_ps, partitioner, num_table_shards):
    """The interrupted fit run again on `num_ps` servers; returns (results, restored snapshot, epochs run)."""
    directory = tmp_path / "backup"
    shutil.copytree(backup_dir, directory)
    x, y = make_data()
    snapshot = SnapshotAfterRestore(str(tmp_path / "restored.weights.h5"))
    with _ps.in_process_servers(num_ps) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=partitioner)
        with strategy.scope():
            model = build_model()
        table = model.layers[0].embeddings
        shards = strategy.extended.remote_view(table).variables if num_table_shards > 1 else []
        assert [s.ps_index for s in shards] == list(range(num_table_shards if num_table_shards > 1 else 0))
        history = fit(model, [keras.callbacks.BackupAndRestore(str(directory)), snapshot], x, y)
        values = results(model, history, x, y)
    return values, h5_values(snapshot.path), snapshot.epochs


def split_by_kind(values):
    """`(variables, optimizer state)` of a Keras weights file's datasets."""
    return ({k: v for k, v in values.items() if not k.startswith("optimizer/")},
            {k: v for k, v in values.items() if k.startswith("optimizer/")})




@pytest.fixture(scope="module")
def resumed(tmp_path_factory, backup):
    """Each restore run once: name -> (results, what the servers held after the restore, epochs run)."""
    runs = {}
    for name, (num_ps, partitioner, num_table_shards) in sorted(RESTORES.items()):
        runs[name] = resume(tmp_path_factory.mktemp(f"resume-{name}"), backup, num_ps, partitioner(), num_table_shards)
    return runs


@pytest.mark.parametrize("restore", sorted(RESTORES))
def test_variables_of_a_two_ps_backup_restore_exactly_on_another_number_of_ps(backup, resumed, restore):
    saved, _ = split_by_kind(h5_values(backup / WEIGHTS_FILE))
    _, restored, epochs = resumed[restore]
    restored, _ = split_by_kind(restored)

    assert epochs == [1]  # resumed after the backed-up epoch
    # Re-split by the new partitioning (asserted in `resume`), read back whole: the backup's values.
    assert set(restored) == set(saved) and len(saved) == 5
    assert [key for key in saved if not np.array_equal(saved[key], restored[key])] == []
    # Negative control of the comparison: the table's rows out of order are seen.
    table = next(key for key in saved if saved[key].shape == (ROWS, DIM))
    assert not np.array_equal(saved[table][::-1], restored[table])


@pytest.mark.parametrize("restore", sorted(RESTORES))
def test_optimizer_state_of_a_two_ps_backup_restores_and_the_run_ends_as_uninterrupted(
        backup, resumed, uninterrupted, restore):
    _, saved = split_by_kind(h5_values(backup / WEIGHTS_FILE))
    values, restored, _ = resumed[restore]
    _, restored = split_by_kind(restored)

    assert set(restored) == set(saved) and len(saved) > 2
    assert [key for key in saved if not np.array_equal(saved[key], restored[key])] == []  # slots, iterations
    assert len(values["history/loss"]) == 1
    assert int(values["optimizer/0"]) == EPOCHS * SAMPLES // BATCH  # iterations
    assert mismatches(uninterrupted, values) == []


def test_negative_control_a_backup_without_its_slots_fails_the_comparison(tmp_path, backup, uninterrupted):
    broken = tmp_path / "broken"
    shutil.copytree(backup, broken)
    with h5py.File(broken / WEIGHTS_FILE, "r+") as file:
        slots = []
        file["optimizer"].visititems(lambda name, item: slots.append(item) if isinstance(item, h5py.Dataset) else None)
        assert len(slots) > 1
        for item in slots:
            if item.shape:  # the slots; iterations is the scalar
                item[...] = np.zeros(item.shape, item.dtype)
    values, _, _ = resume(tmp_path / "run", broken, 3, MinSizePartitioner(min_shard_bytes=256, max_shards=3), 3)
    assert any(key.startswith("weight/") for key in mismatches(uninterrupted, values))
