"""A chief that trains with `model.fit` and `BackupAndRestore`: run it, kill the ps, run it again.

Usage (from `test_failures.py`):

    python tests/coordinator/_fit_chief.py --cluster cluster.json --backup-dir DIR --epochs 4 \
        [--pause-after-epoch 2 --pause-port PORT]

After each epoch it prints `epoch N done loss=...`. With `--pause-after-epoch`,
after that epoch (and its backup) it connects to `127.0.0.1:PORT`, says so,
and waits until the test closes the connection: the test kills the parameter
server in between, so the next epoch meets a dead parameter server. At the
end it prints one line `history {...}` (JSON: the epochs this run trained and
their losses).
"""

import argparse
import json
import socket

import kdist
import keras
from kdist.cluster import ClusterSpec, SimpleClusterResolver
from tests.coordinator import _functions

# How long the paused chief waits for the test; a test that never answers
# fails on its own timeout first.
PAUSE_SECONDS = 120.0


class _Announce(keras.callbacks.Callback):
    def __init__(self, pause_after_epoch, pause_port):
        super().__init__()
        self._pause_after_epoch = pause_after_epoch
        self._pause_port = pause_port

    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch + 1} done loss={logs['loss']:.4f}", flush=True)
        if epoch + 1 == self._pause_after_epoch:
            with socket.create_connection(("127.0.0.1", self._pause_port), timeout=30.0) as connection:
                connection.sendall(f"epoch {epoch + 1} done\n".encode())
                connection.settimeout(PAUSE_SECONDS)
                connection.recv(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--backup-dir", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--ps-unavailable-seconds", type=float, default=5.0)
    parser.add_argument("--pause-after-epoch", type=int, default=0)
    parser.add_argument("--pause-port", type=int, default=0)
    args = parser.parse_args()

    with open(args.cluster) as handle:
        spec = ClusterSpec(json.load(handle))
    strategy = kdist.ParameterServerStrategy(SimpleClusterResolver(spec, task_type="chief", task_id=0))
    kdist.coordinator.ClusterCoordinator(strategy, ps_unavailable_seconds=args.ps_unavailable_seconds)
    with strategy.scope():
        model = _functions.build_model()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=2)
    x, y = _functions.make_digits(512, seed=1)
    history = model.fit(
        x, y, batch_size=32, epochs=args.epochs, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(args.backup_dir),
                   _Announce(args.pause_after_epoch, args.pause_port)])
    print("history " + json.dumps({"epochs": history.epoch, "loss": history.history["loss"]}), flush=True)


if __name__ == "__main__":
    main()
