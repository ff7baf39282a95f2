"""`model.fit` on the chief drives parameter-server training; a sidecar evaluator watches it.

One script for every task of the cluster:

    kdist launch --ps 1 --workers 2 --chief --evaluator examples/ps_coordinator_fit.py --small --out-dir /tmp/run

- `ps` and `worker` tasks only serve (`kdist.distribute.Server(...).join()`);
- the chief builds and compiles the model in `strategy.scope()` and calls
  `model.fit(dataset_fn, steps_per_epoch=...)`. Each worker builds its own
  dataset with `dataset_fn`; the chief schedules closures of
  `steps_per_execution` steps onto the workers, adds up their metrics, and
  runs the callbacks: `BackupAndRestore` (rerun the same command after a crash
  and training resumes from the last epoch) and `ModelCheckpoint`, which both
  save the parameter servers' state. The final model is reloaded with plain
  Keras and checked;
- the `evaluator` task (optional: leave out `--evaluator` and nothing waits
  for it) runs `kdist.SidecarEvaluator`, which evaluates every checkpoint the
  chief writes, once, and writes the metrics next to it.

The chief prints one JSON line and exits non-zero below `--min-accuracy`.

Measured on 2 CPU cores (torch 2.13 CPU, Keras 3.15.1, 2026-11-25): `--small`
(8 epochs of 60 steps, 10 steps per closure, 2 workers) reaches a test accuracy
of 0.89-0.93 over 5 runs (asynchronous training: runs differ; 6 epochs gave
0.82-0.90, too close to the 0.8 floor); the chief's part takes about 3 s, and
the evaluator reports each of the 8 checkpoints once.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402

from mirrored_digits import NUM_CLASSES, make_digits  # noqa: E402  (same directory)
# Each worker's endless stream of batches (workers import it from that module).
from ps_coordinator_custom_loop import dataset_fn  # noqa: E402

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--steps-per-epoch", type=int, default=100)
    parser.add_argument("--steps-per-execution", type=int, default=10, help="training steps per scheduled closure")
    parser.add_argument(
        "--out-dir", default=None,
        help="checkpoints and the final model, read by the evaluator too (default: a directory under the "
        "system's temporary directory named after the cluster, so every task of one cluster finds it)")
    parser.add_argument("--min-accuracy", type=float, default=0.8, help="exit non-zero below this test accuracy")
    parser.add_argument("--small", action="store_true", help="CI size: 8 epochs of 60 steps")
    args = parser.parse_args(argv)
    if args.small:
        args.epochs, args.steps_per_epoch = min(args.epochs, 8), min(args.steps_per_epoch, 60)
    return args


def build_model():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Rescaling(1.0 / 16.0),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(NUM_CLASSES, activation="softmax"),
    ], name="digits")
    return model


def compile_model(model, steps_per_execution=1):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], steps_per_execution=steps_per_execution)
    return model


def train(args, resolver):
    start = time.perf_counter()
    strategy = kdist.ParameterServerStrategy(
        resolver, variable_partitioner=kdist.partitioners.MinSizePartitioner(min_shard_bytes=16 << 10))
    with strategy.scope():
        model = compile_model(build_model(), args.steps_per_execution)
    checkpoints = os.path.join(args.out_dir, "checkpoints")
    history = model.fit(
        dataset_fn, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, verbose=1,
        callbacks=[
            keras.callbacks.BackupAndRestore(os.path.join(args.out_dir, "backup")),
            keras.callbacks.ModelCheckpoint(os.path.join(checkpoints, "epoch-{epoch}.keras")),
        ],
    )
    final_path = os.path.join(args.out_dir, "digits.keras")
    model.save(final_path)
    # Plain Keras on torch runs one step per execution: recompile the reloaded
    # model instead of using the saved steps_per_execution.
    reloaded = compile_model(keras.saving.load_model(final_path, compile=False))
    x_test, y_test = make_digits(1000, seed=3)
    test_accuracy = float(reloaded.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"])
    stats = strategy.extended.cluster_coordinator.stats
    report = {
        "epochs_run": len(history.history.get("loss", [])),
        "final_loss": round(history.history["loss"][-1], 4) if history.history.get("loss") else None,
        "test_accuracy": round(test_accuracy, 4),
        "out_dir": args.out_dir,
        "closures": stats["closures_done"],
        "closures_retried": stats["closures_retried"],
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(report), flush=True)
    return 0 if test_accuracy >= args.min_accuracy else 1


def evaluate_checkpoints(args):
    """The evaluator task: evaluate each checkpoint the chief writes, once."""
    model = compile_model(build_model())
    x_val, y_val = make_digits(500, seed=4)
    evaluator = kdist.SidecarEvaluator(
        model, (x_val, y_val), os.path.join(args.out_dir, "checkpoints"),
        max_evaluations=args.epochs, timeout=120)
    records = evaluator.start()
    print(json.dumps({"evaluations": len(records)}), flush=True)
    return 0


def cluster_directory(resolver):
    """The default --out-dir: under the system's temporary directory, one per cluster.

    The chief writes checkpoints there and the evaluator, another process, reads
    them, so both must derive the same path: it is named after the cluster's
    addresses. Rerunning with the same TF_CONFIG resumes from its backup;
    `kdist launch` picks new ports, hence a new directory, for every launch.
    """
    cluster = json.dumps(resolver.cluster_spec().as_dict(), sort_keys=True)
    digest = hashlib.sha256(cluster.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"ps_coordinator_fit-{digest}")


def main(argv=None):
    args = parse_args(argv)
    resolver = kdist.cluster.TFConfigClusterResolver()
    if args.out_dir is None:
        args.out_dir = cluster_directory(resolver)
    if resolver.task_type in ("ps", "worker"):
        kdist.distribute.Server(resolver.cluster_spec(), resolver.task_type, resolver.task_id).join()
        return 0
    if resolver.task_type == "evaluator":
        return evaluate_checkpoints(args)
    return train(args, resolver)


if __name__ == "__main__":
    sys.exit(main())
