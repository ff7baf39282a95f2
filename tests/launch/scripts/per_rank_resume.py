"""A MultiWorkerMirroredStrategy fit on input split per rank, with step backups.

per_rank_resume.py OUTDIR STOP_AT

Each rank reads its own samples (i % WORLD_SIZE == RANK), declared with
`kdist.distribute.per_rank`; `BackupAndRestore(OUTDIR/backup, save_freq=2)`.
With STOP_AT >= 0 every rank exits with code 3 after batch STOP_AT of epoch 0
(after that step's backup when it is one), leaving a mid-epoch backup. Prints "finished"
at the end.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402
import numpy as np  # noqa: E402

BATCH = 4
SAMPLES = 48


class RankBatches(keras.utils.PyDataset):
    def __init__(self, rank, world):
        super().__init__()
        rng = np.random.default_rng(0)
        x = rng.normal(size=(SAMPLES, 3)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        mine = np.arange(SAMPLES) % world == rank
        self.x, self.y = x[mine], y[mine]

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        part = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[part], self.y[part]


class StopAt(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.step:
            os._exit(3)


def main():
    out, stop_at = sys.argv[1], int(sys.argv[2])
    strategy = kdist.MultiWorkerMirroredStrategy()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_freq=2)]
    if stop_at >= 0:
        callbacks.append(StopAt(stop_at))
    model.fit(kdist.distribute.per_rank(RankBatches(rank, world)), epochs=2, verbose=0,
              callbacks=callbacks)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
