"""Saves that fail partway through, for real: the file size limit (RLIMIT_FSIZE) is lowered mid-run.

See tests/keras/test_atomic_save.py and tests/keras/replica/test_multi_worker_checkpoints.py.
Each mode saves once, records the files, lowers the limit to a third of the
saved file, saves again (which must fail with EFBIG), restores the limit and
writes `<mode>[rank].json` (and `first.npz`, the first save's weights) in `--dir`.

Modes:
- `ps_save`: one worker and one in-process parameter server;
  `model.save`, `save_weights` and a `ModelCheckpoint` in `fit` fail; a
  negative control writes in place (Keras' own save) over a copy of the file.
- `coordinator_backup`: the chief of an in-process coordinator cluster; the
  `BackupAndRestore` save at the end of an epoch fails.
- `coordinator_resume`: the same `fit`, run again in a new process: it must
  resume from the backup that the failed save left.
- `multi_worker_save`: one rank of a two-rank MultiWorkerMirroredStrategy job;
  the chief's collective `model.save` fails.
"""

import argparse
import contextlib
import hashlib
import json
import os
import resource
import shutil
import signal
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402


def _model():
    # About 0.5 MB with Adam's slots: a third of it is mid-file.
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(128, 64)).astype("float32"), rng.normal(size=(128, 10)).astype("float32")


def _digest(path):
    with open(path, "rb") as reader:
        return hashlib.sha256(reader.read()).hexdigest()


@contextlib.contextmanager
def _file_size_limit(limit):
    """Writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored) until the block ends."""
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, previous_handler)


# h5py segfaults when the objects of a file whose write failed are freed (plain
# Keras too, without kdist): the errors, and with them those objects, are kept
# alive, and the process ends with os._exit.
_KEPT_ALIVE = []


def _attempt(function):
    """`None` if `function()` succeeded, else `[exception type name, errno]`."""
    try:
        function()
    except Exception as error:  # noqa: BLE001 - recorded for the test to judge
        _KEPT_ALIVE.append(error)
        return [type(error).__name__, getattr(error, "errno", None)]
    return None


def ps_save(directory):
    import kdist
    from tests.keras import _ps

    x, y = _data()
    model_path = os.path.join(directory, "model.keras")
    weights_path = os.path.join(directory, "model.weights.h5")
    control_path = os.path.join(directory, "control", "model.keras")
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = _model()
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        model.save(model_path)
        model.save_weights(weights_path)
        np.savez(os.path.join(directory, "first.npz"), *model.get_weights())
        os.makedirs(os.path.dirname(control_path))
        shutil.copy(model_path, control_path)
        before = {name: _digest(os.path.join(directory, name)) for name in ("model.keras", "model.weights.h5")}
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # the servers' weights move on
        with _file_size_limit(os.path.getsize(model_path) // 3):
            errors = {
                "save": _attempt(lambda: model.save(model_path)),
                "save_weights": _attempt(lambda: model.save_weights(weights_path)),
                "model_checkpoint": _attempt(lambda: model.fit(
                    x, y, batch_size=32, epochs=1, verbose=0,
                    callbacks=[keras.callbacks.ModelCheckpoint(model_path)])),
                # Negative control: Keras' own save, in place, as before kdist routed it.
                "in_place": _attempt(lambda: type(model).save(model, control_path)),
            }
    after = {name: _digest(os.path.join(directory, name)) for name in before}
    return {"errors": errors, "before": before, "after": after,
            "control_size": os.path.getsize(control_path), "saved_size": os.path.getsize(model_path)}


def _backup_fit(model, directory, epochs):
    backup = keras.callbacks.BackupAndRestore(os.path.join(directory, "backup"), delete_checkpoint=False)
    x, y = _data()
    return model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=[backup])


def coordinator_backup(directory):
    from tests.coordinator import _in_process

    backup_dir = os.path.join(directory, "backup")
    weights_path = os.path.join(backup_dir, "latest.weights.h5")
    metadata_path = os.path.join(backup_dir, "training_metadata.json")
    with _in_process.cluster(num_workers=1, num_ps=1) as (_, strategy):
        with strategy.scope():
            model = _model()
        _backup_fit(model, directory, epochs=1)
        np.savez(os.path.join(directory, "first.npz"), *model.get_weights())
        before = {"weights": _digest(weights_path), "metadata": _digest(metadata_path)}
        with _file_size_limit(os.path.getsize(weights_path) // 3):
            error = _attempt(lambda: _backup_fit(model, directory, epochs=3))
        after = {"weights": _digest(weights_path), "metadata": _digest(metadata_path)}
    return {"errors": {"backup": error}, "before": before, "after": after, "listing": sorted(os.listdir(backup_dir))}


def coordinator_resume(directory):
    """"Rerun the same command to resume": a new process, new servers, the same fit."""
    from tests.coordinator import _in_process

    with _in_process.cluster(num_workers=1, num_ps=1) as (_, strategy):
        with strategy.scope():
            model = _model()
        history = _backup_fit(model, directory, epochs=3)
    return {"resumed_epochs": list(history.epoch)}


def multi_worker_save(directory):
    import kdist

    strategy = kdist.MultiWorkerMirroredStrategy(communication_options=kdist.CommunicationOptions(timeout_seconds=60))
    rank = strategy.extended.collectives.rank
    x, y = _data()
    path = os.path.join(directory, "model.keras")
    with strategy.scope():
        model = _model()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    model.save(path)
    if rank == 0:
        np.savez(os.path.join(directory, "first.npz"), *model.get_weights())
    before = {"model.keras": _digest(path)}
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    # Only the chief writes; the limit is lowered where the write happens.
    limit = _file_size_limit(os.path.getsize(path) // 3) if rank == 0 else contextlib.nullcontext()
    with limit:
        error = _attempt(lambda: model.save(path))
    after = {"model.keras": _digest(path)}
    return {"errors": {"save": error}, "before": before, "after": after, "rank": rank}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ps_save", "coordinator_backup", "coordinator_resume", "multi_worker_save"], required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    result = globals()[args.mode](args.dir)
    name = f"{args.mode}{result.get('rank', '')}.json"
    with open(os.path.join(args.dir, name), "w") as writer:
        json.dump(result, writer)
    print(f"{args.mode} finished", flush=True)
    sys.stderr.flush()
    os._exit(0)  # see _KEPT_ALIVE


if __name__ == "__main__":
    main()
