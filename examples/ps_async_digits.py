"""Train the digit classifier asynchronously with `kdist.ParameterServerStrategy`.

One script for every task of the cluster:

    kdist launch --ps 2 --workers 2 examples/ps_async_digits.py --small

`kdist launch` gives each task its `TF_CONFIG`. Parameter-server tasks serve
variables until the workers are done; each worker builds the model inside
`strategy.scope()` (its variables live on the parameter servers, split in two
when large enough) and calls `fit` on its own shard of the data. Workers never
wait for each other: each step pulls the latest weights, computes gradients on
the worker's batch and pushes them; the servers apply Adam at once. The chief
(worker 0) writes checkpoints and the final model — the servers' state — then
reloads it with plain Keras and prints one JSON line. Exit status is non-zero
when the reloaded model's test accuracy is below `--min-accuracy`.

On several hosts, give every process the same cluster and its own task:

    TF_CONFIG='{"cluster": {"worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222", "p1:2222"]},
                "task": {"type": "ps", "index": 0}}' python examples/ps_async_digits.py

Measured on 2 CPU cores (torch 2.13 CPU, Keras 3.15.1, 2026-11-21):
`--small` (3000 samples over 2 workers, 20 epochs each) reaches a test accuracy
of 0.93 in about 20 s including the start-up of all four processes.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402
import numpy as np  # noqa: E402

from mirrored_digits import build_model, make_digits  # noqa: E402  (same directory)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20, help="epochs on every worker")
    parser.add_argument("--samples", type=int, default=8000, help="training samples, split over the workers")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size of EACH worker")
    parser.add_argument(
        "--out-dir", default=None, help="where the chief writes files (default: a temporary directory, removed at exit)"
    )
    parser.add_argument("--min-accuracy", type=float, default=0.8, help="exit non-zero below this test accuracy")
    parser.add_argument("--small", action="store_true", help="CI size: 3000 samples, at most 20 epochs")
    args = parser.parse_args(argv)
    if args.small:
        args.samples = min(args.samples, 3000)
        args.epochs = min(args.epochs, 20)
    return args


def serve(resolver):
    """A parameter-server task: serve variables until the launcher stops us."""
    server = kdist.distribute.Server(resolver.cluster_spec(), "ps", resolver.task_id)
    server.start()
    print(f"ps {resolver.task_id} serving on {server.target}", flush=True)
    server.join()
    return 0


def train(args, resolver):
    start = time.perf_counter()
    num_ps = resolver.cluster_spec().num_tasks("ps")
    strategy = kdist.ParameterServerStrategy(
        resolver,
        # Split any variable of at least 2 x 16 KiB over the parameter servers.
        variable_partitioner=kdist.partitioners.MinSizePartitioner(min_shard_bytes=16 << 10, max_shards=num_ps),
    )
    worker = resolver.task_id
    num_workers = resolver.cluster_spec().num_tasks("worker")
    keras.utils.set_random_seed(worker)
    x_train, y_train = make_digits(args.samples, seed=1)
    x_train, y_train = x_train[worker::num_workers], y_train[worker::num_workers]
    x_test, y_test = make_digits(max(args.samples // 5, 1), seed=3)
    with strategy.scope():
        model = build_model()

    # The same callbacks on every task: only the chief (worker 0) writes
    # checkpoints and shows progress; kdist drops them on the other workers.
    callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(args.out_dir, "epoch{epoch:02d}.keras"))]
    history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks, verbose=2)
    test_loss, test_accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    print(f"worker {worker}: test accuracy {test_accuracy:.4f} after {len(history.history['loss'])} epochs", flush=True)
    if not strategy.extended.should_checkpoint:
        return 0  # the chief writes the final model and reports

    final_path = os.path.join(args.out_dir, "digits_mlp.keras")
    model.save(final_path)  # the parameter servers' state at this moment
    # Called directly, the model computes with the weights `save` just read.
    local = keras.ops.convert_to_numpy(model(x_test, training=False))
    reloaded = keras.saving.load_model(final_path)
    _, reloaded_accuracy = reloaded.evaluate(x_test, y_test, batch_size=256, verbose=0)
    difference = float(np.max(np.abs(local - reloaded.predict(x_test, batch_size=256, verbose=0))))
    stats = strategy.extended.variable_router.stats()
    metrics = {
        "example": "ps_async_digits",
        "num_workers": num_workers,
        "num_ps": num_ps,
        "epochs": args.epochs,
        "test_accuracy": round(float(test_accuracy), 4),
        "reloaded_test_accuracy": round(float(reloaded_accuracy), 4),
        "reloaded_max_abs_difference": difference,
        "applied_pushes": [s.applied_pushes for s in stats],
        "staleness_mean": round(stats[0].staleness.mean, 3),
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(metrics))
    failures = []
    if metrics["reloaded_test_accuracy"] < args.min_accuracy:
        failures.append(f"reloaded test accuracy {metrics['reloaded_test_accuracy']} < --min-accuracy={args.min_accuracy}")
    if difference > 1e-5:
        failures.append(f"the reloaded model predicts differently (max |difference| {difference:.2e})")
    for failure in failures:
        print(f"ps_async_digits: FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def main(argv=None):
    args = parse_args(argv)
    resolver = kdist.cluster.TFConfigClusterResolver()
    if resolver.task_type == "ps":
        return serve(resolver)
    if args.out_dir is not None:
        return train(args, resolver)
    with tempfile.TemporaryDirectory(prefix="ps_async_digits_") as out_dir:
        args.out_dir = out_dir
        return train(args, resolver)


if __name__ == "__main__":
    sys.exit(main())
