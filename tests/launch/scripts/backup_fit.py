"""One rank of a MultiWorkerMirroredStrategy job with BackupAndRestore, for `kdist launch --max-restarts`.

backup_fit.py OUTDIR [--epochs E] [--save-freq epoch|N] [--pause SECONDS]

Writes OUTDIR/<pid>.pid, trains `tests.keras.workers.fit_equivalence`'s model
with `keras.callbacks.BackupAndRestore(OUTDIR/backup, save_freq=...)` and prints
"epoch=E batch=B pid=P" after every batch (then pauses), so a test can kill a
rank at a chosen step. At the end it writes OUTDIR/rank<R>.npz (weights,
optimizer and metric variables, History, evaluate, predict) and prints
"rank R finished". The script has no restart logic: a restarted job runs it
again from the start, and `fit` resumes from the backup.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests.keras.workers import fit_equivalence  # noqa: E402

COLLECTIVE_TIMEOUT_SECONDS = 60.0


class Progress(keras.callbacks.Callback):
    def __init__(self, pause):
        super().__init__()
        self._pause = pause
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        print(f"epoch={self._epoch} batch={batch} pid={os.getpid()}", flush=True)
        time.sleep(self._pause)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--save-freq", default="epoch")
    parser.add_argument("--pause", type=float, default=0.05)
    args = parser.parse_args()
    save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
    with open(os.path.join(args.out, f"{os.getpid()}.pid"), "w") as file:
        file.write(str(os.getpid()))

    strategy = kdist.MultiWorkerMirroredStrategy(
        communication_options=kdist.CommunicationOptions(timeout_seconds=COLLECTIVE_TIMEOUT_SECONDS)
    )
    rank = strategy.extended.collectives.rank
    callbacks = [
        keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup"), save_freq=save_freq),
        Progress(args.pause),
    ]
    results = fit_equivalence.train(
        strategy, callbacks=callbacks, epochs=args.epochs, initial_seed=fit_equivalence.SEED + rank
    )
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), **results)
    print(f"rank {rank} finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
