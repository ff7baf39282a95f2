"""One rank of a multi-worker run that checkpoints; see tests/keras/replica/test_multi_worker_checkpoints.py.

Modes:
- `chief_only`: fit with ModelCheckpoint + CSVLogger, then model.save and save_weights.
- `backup`: fit for `--epochs` with BackupAndRestore; `--slow` adds a pause per
  batch and prints `epoch=E batch=B` so a test can kill a rank mid-epoch.
- `own_paths`: TensorFlow's multi-worker tutorial's saving: the chief saves to
  `--dir/model.keras` (and `.weights.h5`), every other rank to a temporary
  directory of its own, loads what it saved, then removes that directory.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402

from tests.keras.workers import fit_equivalence  # noqa: E402


class Progress(keras.callbacks.Callback):
    def __init__(self, pause):
        super().__init__()
        self._pause = pause
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        print(f"epoch={self._epoch} batch={batch}", flush=True)
        time.sleep(self._pause)

    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch_end={epoch}", flush=True)


def save_and_load_own_paths(strategy, directory, rank):
    """The tutorial's `write_filepath`: a non-chief rank writes under `workertemp_<rank>` and removes it after."""
    import shutil

    seeding.set_random_seed(fit_equivalence.SEED)
    x, y = fit_equivalence.make_data()
    with strategy.scope():
        model = fit_equivalence.build_model()
    model.fit(x, y, batch_size=fit_equivalence.GLOBAL_BATCH, epochs=1, verbose=0)
    x = x[:64]
    own = directory if strategy.extended.is_chief else os.path.join(directory, f"workertemp_{rank}")
    os.makedirs(own, exist_ok=True)
    model.save(os.path.join(own, "model.keras"))
    model.save_weights(os.path.join(own, "model.weights.h5"))
    loaded = keras.saving.load_model(os.path.join(own, "model.keras"),
                                     custom_objects={"SampleCount": fit_equivalence.SampleCount})
    predict = model.predict(x, verbose=0)
    reloaded_predict = loaded.predict(x, verbose=0)
    model.load_weights(os.path.join(own, "model.weights.h5"))
    weights_predict = model.predict(x, verbose=0)
    if not strategy.extended.is_chief:
        shutil.rmtree(own)  # raises if nothing was written there
    return {"predict": predict, "reloaded_predict": reloaded_predict, "weights_predict": weights_predict}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["chief_only", "backup", "own_paths"], required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--slow", action="store_true")
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args()

    import kdist

    strategy = kdist.MultiWorkerMirroredStrategy(
        communication_options=kdist.CommunicationOptions(timeout_seconds=args.timeout)
    )
    rank = strategy.extended.collectives.rank
    if args.mode == "own_paths":
        results = save_and_load_own_paths(strategy, args.dir, rank)
        np.savez(os.path.join(args.dir, f"rank{rank}.npz"), **results)
        print(f"rank {rank} finished", flush=True)
        return 0
    if args.mode == "chief_only":
        callbacks = [
            keras.callbacks.ModelCheckpoint(os.path.join(args.dir, "checkpoints", "model.keras")),
            keras.callbacks.CSVLogger(os.path.join(args.dir, "logs", "training.csv")),
        ]
        os.makedirs(os.path.join(args.dir, "logs"), exist_ok=True)
    else:
        callbacks = [keras.callbacks.BackupAndRestore(os.path.join(args.dir, "backup"))]
        if args.slow:
            callbacks.append(Progress(pause=0.1))
    results = fit_equivalence.train(
        strategy, callbacks=callbacks, epochs=args.epochs, initial_seed=fit_equivalence.SEED + rank
    )
    np.savez(os.path.join(args.dir, f"rank{rank}.npz"), **results)
    print(f"rank {rank} finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
