"""Coordinator training that outlives a worker's restart, for `kdist launch --chief --ps`.

coordinator_restart.py OUTDIR [--epochs E] [--steps S]. ps and worker tasks write
OUTDIR/<task>.<pid>.pid, print "serving" and serve. The chief trains a tiny model
with a custom loop (each step also sleeps a little, so closures are in flight most
of the time), printing "epoch N done" after each epoch. From epoch 2 on it waits
(at most RESTART_DEADLINE_SECONDS) until some worker was started twice, then runs
the remaining epochs and one more, prints one JSON line and exits 0.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

RESTART_DEADLINE_SECONDS = 60.0
STEP_SECONDS = 0.05


def dataset_fn(input_context):
    rng = np.random.default_rng(input_context.input_pipeline_id)
    while True:
        x = rng.normal(size=(16, 4)).astype("float32")
        yield x, x.sum(axis=1, keepdims=True)


def restarted_workers(out_dir):
    tasks = [path.name.split(".")[0] for path in Path(out_dir).glob("worker-*.pid")]
    return sorted({task for task in tasks if tasks.count(task) > 1})


def wait_for_a_restart(out_dir):
    deadline = time.monotonic() + RESTART_DEADLINE_SECONDS
    while not restarted_workers(out_dir):
        # Test script: a file written by another process has nothing to wait on.
        if time.monotonic() > deadline:
            raise TimeoutError("no worker was restarted")
        time.sleep(0.1)


def train(args, resolver):
    strategy = kdist.ParameterServerStrategy(resolver)
    coordinator = kdist.coordinator.ClusterCoordinator(strategy)
    per_worker_dataset = coordinator.create_per_worker_dataset(dataset_fn)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.05)
    loss_fn = keras.losses.MeanSquaredError()

    def worker_fn(iterator):
        def replica_fn(batch):
            x, y = (torch.as_tensor(item) for item in batch)
            loss = loss_fn(y, model(x, training=True))
            model.zero_grad()
            loss.backward()
            variables = model.trainable_variables
            with torch.no_grad():
                optimizer.apply([variable.value.grad for variable in variables], variables)
            time.sleep(STEP_SECONDS)
            return loss.detach()

        return strategy.run(replica_fn, args=(next(iterator),))

    for epoch in range(args.epochs + 1):
        if epoch == 2:
            wait_for_a_restart(args.out_dir)
        iterator = iter(per_worker_dataset)
        losses = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(args.steps)]
        coordinator.join()
        loss = float(np.mean(coordinator.fetch(losses)))
        print(f"epoch {epoch} done: loss {loss:.4f}", flush=True)
    report = {
        "closures": coordinator.stats["closures_done"],
        "restarted": restarted_workers(args.out_dir),
        "loss": loss,
    }
    print(json.dumps(report), flush=True)
    coordinator.shutdown()
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    resolver = kdist.cluster.TFConfigClusterResolver()
    if resolver.task_type in ("ps", "worker"):
        name = f"{resolver.task_type}-{resolver.task_id}"
        Path(args.out_dir, f"{name}.{os.getpid()}.pid").write_text(str(os.getpid()))
        server = kdist.distribute.Server(
            resolver.cluster_spec(), resolver.task_type, resolver.task_id, start=False
        )
        server.start()
        print("serving", flush=True)
        server.join()
        return 0
    return train(args, resolver)


if __name__ == "__main__":
    sys.exit(main())
