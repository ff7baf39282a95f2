"""One asynchronous between-graph worker of `test_async_row_convergence`, and the models it trains.

The test imports this module for the data and the models, so that the test
process and the workers create the same variables in the same order (the
servers name variables by creation index). Run as a script, it is worker
`--index` of one or more parameter-server clusters: for every `--cluster
NAME=SPEC_FILE`, it builds a `ParameterServerStrategy` on that cluster and
trains the models of `PLANS[NAME]` one after another on its half of the data,
starting each together with the other worker; it prints their Histories (the
test reads the results from the servers).

The two models of a pair are the same function of the same initial weights:
`Embedding(ROWS, DIM)` (a table the servers update by rows) and
`OneHotTable` (`one_hot(ids) @ table`, a table read whole and updated densely).
"""

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import kdist  # noqa: E402
from kdist.cluster import SimpleClusterResolver  # noqa: E402
from kdist.distribute.parameter_server.partitioners import MinSizePartitioner  # noqa: E402

ROWS, DIM, IDS_PER_EXAMPLE = 256, 8, 2
# 256 pushes per model, both workers together. Small batches: a push touches
# about 8 rows per shard, so a server that drops one of them loses about 1/8
# of the table's gradient (the negative control).
NUM_EXAMPLES, BATCH, EPOCHS = 512, 8, 4
NUM_WORKERS = 2
# How long a worker waits at the start of a model for the other one.
BARRIER_TIMEOUT = datetime.timedelta(seconds=90)
TOTAL_STEPS = EPOCHS * NUM_EXAMPLES // BATCH
# y = the mean of the ids' hidden values (standard deviation HIDDEN_SCALE) plus
# noise: the loss has a floor near NOISE**2 that converged runs reach.
HIDDEN_SCALE, NOISE = 2.0, 0.2
# Decayed to 0 over the job's pushes (the servers count them in `iterations`), so
# the final loss is that of a converged model rather than of the last few noisy
# steps: with a constant rate, SGD's final loss varied by 40-60% with the order
# of the batches alone. SGD at 0.5 oscillated with two workers' stale pushes
# (the bias' step is then a full Newton step, applied twice); the Dense kernel
# starts large so that the rows still learn fast at 0.3.
LEARNING_RATES = {"sgd": 0.3, "adagrad": 0.3, "adam": 0.1}
# (optimizer, table) per model, trained in this order on each cluster.
PLANS = {
    "exact": (("sgd", "embedding"), ("sgd", "one_hot"), ("adagrad", "embedding"), ("adagrad", "one_hot")),
    "lazy": (("adam", "embedding"),),
    "fault": (("sgd", "embedding"),),
}
SPARSE_UPDATES = {"exact": "exact", "lazy": "lazy", "fault": "exact"}


def data():
    """`(ids, y)`: y is the mean of the examples' ids' hidden values, plus noise."""
    rng = np.random.default_rng(0)
    hidden = (HIDDEN_SCALE * rng.normal(size=ROWS)).astype("float32")
    ids = rng.integers(0, ROWS, size=(NUM_EXAMPLES, IDS_PER_EXAMPLE)).astype("int64")
    noise = NOISE * rng.normal(size=(NUM_EXAMPLES, 1))
    return ids, (hidden[ids].mean(axis=1, keepdims=True) + noise).astype("float32")


def partitioner():
    """Splits each table (8 KiB) over the two servers; the Dense weights stay whole."""
    return MinSizePartitioner(min_shard_bytes=2 << 10, max_shards=2)


def _table_initializer():
    # A fresh seeded initializer per table: both models of a pair start equal.
    return keras.initializers.RandomUniform(-0.05, 0.05, seed=1)


class OneHotTable(keras.layers.Layer):
    """`one_hot(ids) @ table`: the same function as an `Embedding`, but a dense read of its table."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=(ROWS, DIM), initializer=_table_initializer(), name="table")

    def call(self, ids):
        return keras.ops.matmul(keras.ops.one_hot(ids, ROWS), self.table)


def build(optimizer, table, steps_per_execution=1):
    """The compiled model `ids -> table -> GlobalAveragePooling1D -> Dense(1)`, MSE.

    Args:
        optimizer: "sgd", "adagrad" or "adam" (see `LEARNING_RATES`).
        table: "embedding" (`keras.layers.Embedding`) or "one_hot" (`OneHotTable`).
        steps_per_execution: passed to `compile`.
    """
    ids = keras.Input((IDS_PER_EXAMPLE,), dtype="int64")
    if table == "embedding":
        lookup = keras.layers.Embedding(ROWS, DIM, embeddings_initializer=_table_initializer(), name="table")
    else:
        lookup = OneHotTable(name="table")
    pooled = keras.layers.GlobalAveragePooling1D()(lookup(ids))
    output = keras.layers.Dense(1, kernel_initializer=keras.initializers.RandomUniform(-1.5, 1.5, seed=2))(pooled)
    model = keras.Model(ids, output, name=f"{optimizer}_{table}")
    made = {"sgd": keras.optimizers.SGD, "adagrad": keras.optimizers.Adagrad, "adam": keras.optimizers.Adam}
    schedule = keras.optimizers.schedules.CosineDecay(LEARNING_RATES[optimizer], TOTAL_STEPS)
    model.compile(made[optimizer](schedule), "mse", steps_per_execution=steps_per_execution)
    return model


def build_models(strategy, plan, steps_per_execution=1):
    """The models of `PLANS[plan]`, created in `strategy`'s scope in their order."""
    with strategy.scope():
        return [build(optimizer, table, steps_per_execution) for optimizer, table in PLANS[plan]]


def strategy_for(spec, plan, index=0):
    """The `ParameterServerStrategy` of worker `index` of the cluster `spec` for `plan`."""
    return kdist.ParameterServerStrategy(SimpleClusterResolver(spec, task_type="worker", task_id=index),
                                         variable_partitioner=partitioner(), sparse_updates=SPARSE_UPDATES[plan])


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--cluster", action="append", required=True, help="PLAN=SPEC_FILE")
    parser.add_argument("--barrier-port", type=int, required=True, help="worker 0 serves a TCPStore there")
    args = parser.parse_args(argv)
    x, y = data()
    x, y = x[args.index :: NUM_WORKERS], y[args.index :: NUM_WORKERS]
    # The workers start each model together: a model takes a few seconds, and a worker
    # that started it late would train its half of the data alone, at a learning rate
    # the other's pushes already decayed.
    store = torch.distributed.TCPStore("127.0.0.1", args.barrier_port, NUM_WORKERS, is_master=args.index == 0,
                                       timeout=BARRIER_TIMEOUT)
    for item in args.cluster:
        plan, spec_file = item.split("=", 1)
        strategy = strategy_for(json.loads(Path(spec_file).read_text()), plan, args.index)
        histories = []
        for number, model in enumerate(build_models(strategy, plan)):
            store.set(f"{plan}/{number}/{args.index}", "ready")
            store.wait([f"{plan}/{number}/{index}" for index in range(NUM_WORKERS)], BARRIER_TIMEOUT)
            seeding.set_random_seed(100 + args.index)  # each worker shuffles its own way
            start = time.monotonic()
            history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
            histories.append({"model": model.name, "loss": history.history["loss"],
                              "seconds": round(time.monotonic() - start, 2)})
        print(f"worker {args.index} trained {plan}: {histories}", flush=True)
    # Worker 0 serves the store: it leaves last, so no other worker's call finds it gone.
    store.set(f"done/{args.index}", "done")
    if args.index == 0:
        store.wait([f"done/{index}" for index in range(NUM_WORKERS)], BARRIER_TIMEOUT)


if __name__ == "__main__":
    main(sys.argv[1:])
