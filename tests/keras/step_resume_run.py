"""One training run of tests/keras/test_step_resume.py: called in the test's process, or run as one rank of a job.

As a script (one rank of a `MultiWorkerMirroredStrategy` job): trains with
`BackupAndRestore(--dir/backup, save_freq=SAVE_FREQ)`, prints `step=N` after
each global step (sleeping `--pause` seconds), raises after step
`--interrupt-at`, and saves its results as `--dir/rank<R>.npz`.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402

SAVE_FREQ = 4
EPOCHS = 3
BATCH = 16
SAMPLES = 96  # 6 steps per epoch: backups land mid-epoch and at an epoch's last step
STEPS_PER_EPOCH = SAMPLES // BATCH


class Interrupted(Exception):
    pass


class InterruptAt(keras.callbacks.Callback):
    """Raises after global step `step` (counted from 1 across epochs); None runs to the end."""

    def __init__(self, step=None, pause=0.0):
        super().__init__()
        self.step, self.pause, self.seen = step, pause, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        print(f"step={self.seen}", flush=True)
        time.sleep(self.pause)
        if self.seen == self.step:
            raise Interrupted(f"interrupted after step {self.seen}")


class Batches(keras.utils.PyDataset):
    """Shuffled by fit; each batch draws noise from NumPy's global generator (augmentation)."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        part = slice(index * BATCH, (index + 1) * BATCH)
        noise = np.random.normal(scale=0.05, size=self.x[part].shape).astype("float32")
        return self.x[part] + noise, self.y[part]


def make_data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(SAMPLES, 1))).astype("float32")
    return x, y


def build_model(dropout):
    layers = [keras.Input((6,)), keras.layers.Dense(16, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(0.25))
    model = keras.Sequential([*layers, keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    return model


def train(strategy, input_kind="arrays", backup_dir=None, interrupt_at=None, seed=0, dropout=True, pause=0.0):
    """Trains for EPOCHS, evaluates and predicts; returns a dict of numpy results (raises `Interrupted`)."""
    seeding.set_random_seed(seed)
    x, y = make_data()
    with strategy.scope():
        model = build_model(dropout)
    callbacks = [keras.callbacks.BackupAndRestore(backup_dir, save_freq=SAVE_FREQ)] if backup_dir else []
    callbacks.append(InterruptAt(interrupt_at, pause))
    if input_kind == "arrays":
        inputs = dict(x=x, y=y, batch_size=BATCH, shuffle=True)
    else:
        inputs = dict(x=Batches(x, y), shuffle=True)
    history = model.fit(**inputs, epochs=EPOCHS, verbose=0, validation_data=(x[:32], y[:32]), callbacks=callbacks)
    results = {f"history/{key}": np.asarray(values, "float64") for key, values in history.history.items()}
    for i, variable in enumerate(model.weights):
        results[f"weight/{i}"] = keras.ops.convert_to_numpy(variable)
    for i, variable in enumerate(model.optimizer.variables):  # iterations first, then the slots
        results[f"optimizer/{i}"] = keras.ops.convert_to_numpy(variable)
    for key, value in model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True).items():
        results[f"evaluate/{key}"] = np.asarray(value, "float64")
    results["predict"] = model.predict(x, batch_size=BATCH, verbose=0)
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--interrupt-at", type=int, default=None)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import kdist

    strategy = kdist.MultiWorkerMirroredStrategy(
        communication_options=kdist.CommunicationOptions(timeout_seconds=30))
    rank = strategy.extended.collectives.rank
    results = train(strategy, backup_dir=os.path.join(args.dir, "backup"), interrupt_at=args.interrupt_at,
                    seed=args.seed + rank, dropout=False, pause=args.pause)
    np.savez(os.path.join(args.dir, f"rank{rank}.npz"), **results)
    print(f"rank {rank} finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
