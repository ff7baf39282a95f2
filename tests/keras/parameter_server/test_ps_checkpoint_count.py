"""Parameter-server checkpoints written with 2 ps restore exactly with 3 (issue 24 point 4), with Keras.

Between-graph training, one worker (this process: training is synchronous and
equals plain Keras) and real gRPC servers in this process, each checkpointing
itself into `root/ps-<i>` after every push (what `kdist launch
--ps-checkpoint-dir root --ps-checkpoint-every 1` gives):

- 2 ps, `FixedShardsPartitioner(2)`: `fit` stops after its first epoch (no
  `BackupAndRestore`: the state is the servers' own checkpoints);
- 3 new ps on the same root, `MinSizePartitioner` (the embedding table in 3
  shards, re-split from the 2 old parts): the same model built in scope holds
  what the old servers held (variables, slots, iterations), and its second
  epoch ends equal to plain Keras never interrupted.

Negative control: the same resume on an empty root no longer equals it.
"""

import contextlib

import keras
import numpy as np
import pytest

import kdist
from kdist.distribute.parameter_server.partitioners import FixedShardsPartitioner, MinSizePartitioner
from kdist.ps import ServiceOptions, create_server
from tests.keras import _ps
from tests.keras.parameter_server.test_backup_ps_count import (
    BATCH,
    EPOCHS,
    ROWS,
    SAMPLES,
    Interrupted,
    build_model,
    h5_values,
    make_data,
    mismatches,
    results,
)

pytestmark = pytest.mark.timeout(300)


class SnapshotAt(keras.callbacks.Callback):
    """At epoch `epoch`'s begin: saves what the servers hold, then raises `Interrupted` when `stop`."""

    def __init__(self, path, epoch, stop):
        super().__init__()
        self.path, self.epoch, self.stop = path, epoch, stop

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            self.model.save_weights(self.path)
            if self.stop:
                raise Interrupted(f"stopped before epoch {epoch}")


@contextlib.contextmanager
def checkpointing_servers(root, num_ps):
    servers = [create_server(options=ServiceOptions(checkpoint_dir=str(root / f"ps-{index}"),
                                                    checkpoint_every="1"), layout=(index, num_ps))
               for index in range(num_ps)]
    try:
        yield _ps.Cluster(_ps._spec([server.address for server in servers], 1))
    finally:
        for server in servers:
            server.stop(None)


def run(root, num_ps, partitioner, snapshot, initial_epoch, stop):
    x, y = make_data()
    with checkpointing_servers(root, num_ps) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=partitioner)
        with strategy.scope():
            model = build_model()
        table = strategy.extended.remote_view(model.layers[0].embeddings).variables
        assert [s.ps_index for s in table] == list(range(num_ps))
        callbacks = [SnapshotAt(str(snapshot), 1, stop)]
        if stop:
            with pytest.raises(Interrupted):
                model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
            return None
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, initial_epoch=initial_epoch,
                            shuffle=False, verbose=0, callbacks=callbacks)
        # A save reads the servers' slots into the local optimizer (fit reads the weights only).
        model.save_weights(str(snapshot.parent / "end.weights.h5"))
        return results(model, history.history, x, y)


@pytest.fixture(scope="module")
def uninterrupted():
    x, y = make_data()
    model = build_model()
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return results(model, history.history, x, y)


@pytest.fixture(scope="module")
def old_job(tmp_path_factory):
    """The checkpoint root of a 2-ps job stopped after its first epoch, and what its servers held then."""
    root = tmp_path_factory.mktemp("ps-2") / "ps-checkpoints"
    snapshot = root.parent / "old.weights.h5"
    run(root, 2, FixedShardsPartitioner(2), snapshot, 0, stop=True)
    return root, h5_values(snapshot)


def test_a_two_ps_checkpoint_restores_on_three_ps_and_training_continues_exactly(
        tmp_path, old_job, uninterrupted):
    root, old = old_job
    snapshot = tmp_path / "new.weights.h5"
    values = run(root, 3, MinSizePartitioner(min_shard_bytes=256, max_shards=3), snapshot, 1, stop=False)
    restored = h5_values(snapshot)
    # What the 3 servers hold at the resumed epoch's begin: the old servers' state, slots and iterations.
    assert set(restored) == set(old) and len(old) > 5
    assert [key for key in old if not np.array_equal(old[key], restored[key])] == []
    table = next(key for key in old if old[key].shape[:1] == (ROWS,) and not key.startswith("optimizer"))
    assert not np.array_equal(old[table][::-1], restored[table])  # the comparison sees row order
    assert int(values["optimizer/0"]) == EPOCHS * SAMPLES // BATCH
    assert mismatches(uninterrupted, values) == []


def test_negative_control_an_empty_root_does_not_continue_the_run(tmp_path, uninterrupted):
    values = run(tmp_path / "empty", 3, MinSizePartitioner(min_shard_bytes=256, max_shards=3),
                 tmp_path / "new.weights.h5", 1, stop=False)
    assert any(key.startswith("weight/") for key in mismatches(uninterrupted, values))
