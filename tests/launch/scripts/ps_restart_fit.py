"""Coordinator `model.fit` that outlives a parameter server's restart, for `kdist launch --chief --ps`.

ps_restart_fit.py OUTDIR. ps and worker tasks write OUTDIR/<task>.<pid>.pid and
serve. The chief trains a small model with `model.fit` (fixed seeds, one
closure in flight, steps_per_execution 1), writes the number of finished
steps to OUTDIR/step after each step (so a test can kill a ps mid-fit), and
at the end prints one line `result {...}` (JSON: weights, History, and the
servers' optimizer iterations and slots).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402

STEP_SECONDS = 0.1  # each step lasts a little, so a kill lands mid-fit


class _Steps(keras.callbacks.Callback):
    def __init__(self, out_dir):
        super().__init__()
        self._path = Path(out_dir, "step")
        self._steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        temporary = self._path.with_suffix(".tmp")
        temporary.write_text(str(self._steps))
        os.replace(temporary, self._path)
        time.sleep(STEP_SECONDS)


def _server_state(strategy):
    """Every trainable variable's optimizer iterations and slots on every ps, by ps and name."""
    state = {}
    for index, client in enumerate(strategy.extended.variable_router.clients):
        for name in sorted(client.stats().variables):
            try:
                [(_, optimizer)] = client.optimizer_state([name]).items()
            except kdist.errors.ParameterServerError:
                continue  # not trainable: no optimizer
            state[f"ps-{index}/{name}"] = {
                "iterations": int(optimizer.iterations),
                "slots": {slot: np.asarray(value).tolist() for slot, value in optimizer.slots.items()},
            }
    return state


def train(out_dir, resolver):
    seeding.set_random_seed(7)
    strategy = kdist.ParameterServerStrategy(resolver)
    kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", steps_per_execution=1)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[_Steps(out_dir)])
    result = {
        "weights": [weight.tolist() for weight in model.get_weights()],
        "history": history.history,
        "servers": _server_state(strategy),
    }
    print("result " + json.dumps(result), flush=True)
    strategy.extended.cluster_coordinator.shutdown()
    return 0


def main():
    out_dir = sys.argv[1]
    resolver = kdist.cluster.TFConfigClusterResolver()
    if resolver.task_type in ("ps", "worker"):
        name = f"{resolver.task_type}-{resolver.task_id}"
        Path(out_dir, f"{name}.{os.getpid()}.pid").write_text(str(os.getpid()))
        server = kdist.distribute.Server(resolver.cluster_spec(), resolver.task_type, resolver.task_id)
        print("serving", flush=True)
        server.join()
        return 0
    return train(out_dir, resolver)


if __name__ == "__main__":
    sys.exit(main())
