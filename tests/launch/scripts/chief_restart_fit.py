"""Coordinator `model.fit` whose chief kills itself once, for `kdist launch --chief --ps --max-restarts 1`.

chief_restart_fit.py OUTDIR [--kill-seed N] [--data arrays|stream] [--fault NAME].
ps and worker tasks serve. The chief trains a small model with `model.fit`
(fixed seeds, one closure in flight, `steps_per_execution=2`, Adam, an extra
metric, validation data) under `BackupAndRestore(OUTDIR/backup, save_freq=SAVE_FREQ)`.
With `--kill-seed`, on its first run only (the file OUTDIR/killed is absent)
it draws a step from `random.Random(N)` and SIGKILLs itself at the end of
that step; the launcher restarts it and the rerun `fit` resumes from the
backup. At the end the chief prints `killed_at K` (first run) and one line
`result {...}` (JSON: weights, optimizer variables read back from the
servers, History, evaluate, predict). `--data stream` reads a `dataset_fn`
(one worker's endless seeded generator) instead of shuffled arrays.
`--fault NAME` turns on `kdist.faults.ACTIVE.NAME` in the chief.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402

EPOCHS, STEPS, BATCH, SAVE_FREQ, PACK = 3, 8, 16, 4, 2


def _arrays(seed, count):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 6)).astype("float32")
    return x, (x @ np.linspace(-1.0, 1.0, 6, dtype="float32").reshape(6, 1) + 0.5).astype("float32")


def dataset_fn():
    rng = np.random.default_rng(3)
    while True:
        x = rng.normal(size=(BATCH, 6)).astype("float32")
        yield x, (x @ np.linspace(-1.0, 1.0, 6, dtype="float32").reshape(6, 1) + 0.5).astype("float32")


class _KillOnce(keras.callbacks.Callback):
    """SIGKILLs this process at the end of global step `step` (after the backup's own hook)."""

    def __init__(self, marker, step):
        super().__init__()
        self._marker, self._step, self._epoch = marker, step, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch * STEPS + batch + 1 >= self._step:
            self._marker.write_text(str(self._step))
            os.kill(os.getpid(), signal.SIGKILL)


def train(args, resolver):
    seeding.set_random_seed(7)
    strategy = kdist.ParameterServerStrategy(resolver)
    # One closure at a time: two sent together may run in either order.
    kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"],
                      steps_per_execution=PACK)
    callbacks = [keras.callbacks.BackupAndRestore(str(Path(args.out_dir, "backup")), save_freq=SAVE_FREQ)]
    marker = Path(args.out_dir, "killed")
    if args.kill_seed is not None and not marker.exists():
        step = random.Random(args.kill_seed).randint(SAVE_FREQ + 1, EPOCHS * STEPS - 1)
        print(f"killed_at {step}", flush=True)
        callbacks.append(_KillOnce(marker, step))
    validation = _arrays(2, 2 * BATCH)
    if args.data == "arrays":
        x, y = _arrays(1, STEPS * BATCH)
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0,
                            validation_data=validation, callbacks=callbacks)
    else:
        history = model.fit(dataset_fn, epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0,
                            validation_data=validation, callbacks=callbacks)
    with tempfile.TemporaryDirectory() as directory:
        model.save_weights(str(Path(directory, "read_back.weights.h5")))  # reads the servers' slots back
    evaluated = model.evaluate(*validation, batch_size=BATCH, verbose=0, return_dict=True)
    predicted = model.predict(validation[0], batch_size=BATCH, verbose=0)
    result = {
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "optimizer": [np.asarray(keras.ops.convert_to_numpy(v)).tolist() for v in model.optimizer.variables],
        "history": history.history,
        "evaluate": evaluated,
        "predict": np.asarray(predicted).tolist(),
    }
    print("result " + json.dumps(result), flush=True)
    strategy.extended.cluster_coordinator.shutdown()
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--kill-seed", type=int, default=None)
    parser.add_argument("--data", choices=["arrays", "stream"], default="arrays")
    parser.add_argument("--fault", default=None)
    args = parser.parse_args()
    resolver = kdist.cluster.TFConfigClusterResolver()
    if resolver.task_type in ("ps", "worker"):
        server = kdist.distribute.Server(resolver.cluster_spec(), resolver.task_type, resolver.task_id)
        print("serving", flush=True)
        server.join()
        return 0
    if args.fault:
        setattr(kdist.faults.ACTIVE, args.fault, True)
    return train(args, resolver)


if __name__ == "__main__":
    sys.exit(main())
