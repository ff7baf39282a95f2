"""Data and functions that coordinator tests send to their workers.

Module-level functions travel by reference: workers import this module (the
repository root is on their `PYTHONPATH`). Closures made in tests travel by
value.
"""

import os
import sys

import numpy as np

import kdist  # noqa: F401  (sets KERAS_BACKEND before keras is imported)
import keras
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from mirrored_digits import NUM_CLASSES, make_digits  # noqa: E402

BATCH = 32


def build_model():
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Rescaling(1.0 / 16.0),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(NUM_CLASSES, activation="softmax"),
    ], name="digits")


def dataset_fn(input_context):
    """An endless shuffled stream of (x, y) batches, different on every worker."""
    seed = 100 + input_context.input_pipeline_id
    x, y = make_digits(1024, seed=seed)

    def batches():
        rng = np.random.default_rng(seed)
        while True:
            order = rng.permutation(len(x))
            for start in range(0, len(x) - BATCH + 1, BATCH):
                rows = order[start:start + BATCH]
                yield x[rows], y[rows]

    return batches()


def train_state(strategy):
    """A model, Adam, an accuracy metric (all created in scope) and the seed's `worker_fn` over them."""
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.Adam(0.02)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    return model, optimizer, accuracy, make_train_step(strategy, model, optimizer, accuracy, loss_fn)


def make_train_step(strategy, model, optimizer, accuracy, loss_fn):
    """The seed's `worker_fn`: one step of a custom training loop through `strategy.run`."""

    def worker_fn(iterator):
        def replica_fn(batch):
            x, y = (torch.as_tensor(item) for item in batch)
            y_pred = model(x, training=True)
            loss = loss_fn(y, y_pred)
            model.zero_grad()
            loss.backward()
            variables = model.trainable_variables
            with torch.no_grad():
                optimizer.apply([variable.value.grad for variable in variables], variables)
            accuracy.update_state(y, y_pred)
            return loss.detach()

        return strategy.run(replica_fn, args=(next(iterator),))

    return worker_fn


def accuracy_of(model, x, y):
    predictions = keras.ops.convert_to_numpy(model(x)).argmax(axis=1)
    return float((predictions == y).mean())


def predict_shape(model, x):
    return tuple(model(x).shape)


def fail(message):
    raise ValueError(message)


def write_marker(path):
    with open(path, "w") as handle:
        handle.write("ran")
    return path
