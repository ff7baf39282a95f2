"""Mirrored equivalence on one Keras backend: 2 replicas against plain single-device Keras.

`python tests/backends/equivalence_worker.py` with `KERAS_BACKEND` set trains
the same model from the same weights on the same global batches twice: under
`kdist.MirroredStrategy(["cpu:0", "cpu:1"])` and with plain Keras (no
strategy). It prints one line, `RESULT {...}`, with the largest absolute
difference of every compared quantity:

- weights and optimizer variables (iterations, Adam's moments) after `fit`;
- the History (loss, accuracy, val_loss, val_accuracy per epoch);
- `evaluate` and `predict` of the trained models;
- a negative control: plain Keras with `batch_size` halved (what a strategy
  that took the global batch as a per-replica batch would compute), which must
  differ from the strategy's weights.

Every batch holds a multiple of 2 samples: TensorFlow's rebatching of a
partial batch differs from kdist's (docs/backends.md), and JAX refuses one that
does not split evenly.
"""

import json
import sys

import kdist  # noqa: E402  (first: it settles the backend)

STRATEGY = kdist.MirroredStrategy(["cpu:0", "cpu:1"])

import keras  # noqa: E402
import numpy as np  # noqa: E402

BATCH_SIZE = 32
EPOCHS = 3


def data(num_samples, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_samples, 8)).astype("float32")
    y = (x[:, :3] @ np.array([1.0, -2.0, 0.5]) > 0).astype("int64") + (x[:, 3] > 1).astype("int64")
    return x, y


def build():
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(3),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def numpy(value):
    return np.asarray(keras.ops.convert_to_numpy(value))


def max_difference(first, second):
    return max(float(np.max(np.abs(numpy(a) - numpy(b)))) for a, b in zip(first, second, strict=True))


def train(model, initial, x, y, validation, batch_size):
    model.set_weights(initial)
    history = model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False,
                        validation_data=validation, verbose=0)
    return history.history


def main():
    keras.utils.set_random_seed(0)
    x, y = data(192, seed=1)
    validation = data(64, seed=2)
    plain = build()
    initial = plain.get_weights()
    plain_history = train(plain, initial, x, y, validation, BATCH_SIZE)
    with STRATEGY.scope():
        mirrored = build()
    mirrored_history = train(mirrored, initial, x, y, validation, BATCH_SIZE)
    per_replica_mistake = build()
    train(per_replica_mistake, initial, x, y, validation, BATCH_SIZE // 2)

    x_test, y_test = data(64, seed=3)
    result = {
        "backend": keras.backend.backend(),
        "num_replicas_in_sync": STRATEGY.num_replicas_in_sync,
        "weights": max_difference(mirrored.get_weights(), plain.get_weights()),
        "optimizer_variables": max_difference(mirrored.optimizer.variables, plain.optimizer.variables),
        "iterations": [int(numpy(mirrored.optimizer.iterations)), int(numpy(plain.optimizer.iterations))],
        "history": {key: max_difference(mirrored_history[key], plain_history[key]) for key in plain_history},
        "evaluate": max_difference(
            mirrored.evaluate(x_test, y_test, batch_size=BATCH_SIZE, verbose=0),
            plain.evaluate(x_test, y_test, batch_size=BATCH_SIZE, verbose=0)),
        "predict": max_difference(
            [mirrored.predict(x_test, batch_size=BATCH_SIZE, verbose=0)],
            [plain.predict(x_test, batch_size=BATCH_SIZE, verbose=0)]),
        "negative_control_weights": max_difference(mirrored.get_weights(), per_replica_mistake.get_weights()),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
