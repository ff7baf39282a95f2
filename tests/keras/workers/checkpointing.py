"""One rank of a multi-worker run that checkpoints; see tests/keras/replica/test_multi_worker_checkpoints.py.

Modes:
- `chief_only`: fit with ModelCheckpoint + CSVLogger, then model.save and save_weights.
- `backup`: fit for `--epochs` with BackupAndRestore; `--slow` adds a pause per
  batch and prints `epoch=E batch=B` so a test can kill a rank mid-epoch.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["chief_only", "backup"], required=True)
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
