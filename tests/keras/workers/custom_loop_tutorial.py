"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, ported by renames.

The renames: `tf.distribute.X` -> `kdist.X`, `tf.keras` -> `keras`,
`tf.nn.compute_average_loss`/`scale_regularization_loss` -> `kdist.nn.*`,
`tf.add_n` -> `sum`, `tf.data` batches -> a list of global batches. The one
line that is not a rename: torch has no `tf.GradientTape`, so the gradients
come from `loss.backward()` and each variable's `.grad`. `@tf.function` is
dropped (the step runs eagerly). Checkpoints use `model.save_weights`.

`train(strategy, epochs=..., dtype="float64")` is the same program in
float64, for tests that tell float32 summation order from a real difference
(tests/keras/replica/test_custom_loop_equivalence.py). Keras' torch backend
computes `ops.matmul` of two float64 tensors in float32 (its type promotion
maps float64 to float32 off TensorFlow), so in float64 the Dense layers are
the same affine maps written as `EinsumDense`, which stays in float64.

Imported, `train(strategy)` runs it and returns what the tests compare; run as
a script (under `kdist launch`) it trains with `MultiWorkerMirroredStrategy`
and writes `<out>/rank<r>.npz`.
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import kdist  # noqa: E402
import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

GLOBAL_BATCH_SIZE = 60
NUM_TRAIN = 800  # 800 = 13 * 60 + 20: the last batch is partial, as in the tutorial
EPOCHS = 2
SEED = 3


def make_data():
    rng = np.random.default_rng(0)
    images = rng.normal(size=(1000, 8, 8, 1)).astype("float32")
    labels = (images[:, :4, :4, 0].mean(axis=(1, 2)) > 0).astype("int64") + (images[:, 0, 0, 0] > 1)
    return images, labels.astype("int64")


def create_model(dtype="float32"):
    regularizer = keras.regularizers.L2(1e-3)

    def dense(units, activation=None):
        if dtype == "float32":
            return keras.layers.Dense(units, activation=activation, kernel_regularizer=regularizer)
        return keras.layers.EinsumDense(
            "ab,bc->ac", output_shape=units, bias_axes="c", activation=activation, kernel_regularizer=regularizer
        )

    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(8, 3, activation="relu", kernel_regularizer=regularizer),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            dense(16, activation="relu"),
            dense(3),
        ]
    )
    return model


def train(strategy, epochs=EPOCHS, dtype="float32"):
    """The tutorial's program; returns weights, optimizer state and per-epoch logs.

    `dtype="float64"` runs it with `keras.config.floatx()` float64 (restored after).
    """
    previous_floatx, previous_policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(dtype)
    # Keras keeps the global dtype policy it first derived from floatx: set it too,
    # or a layer built earlier in this process leaves it at float32.
    keras.config.set_dtype_policy(dtype)
    try:
        return _train(strategy, epochs, dtype)
    finally:
        keras.config.set_floatx(previous_floatx)
        keras.config.set_dtype_policy(previous_policy)


def _train(strategy, epochs, dtype):
    seeding.set_random_seed(SEED)
    images, labels = make_data()
    images = images.astype(dtype)
    train_dataset = [
        (images[i : min(i + GLOBAL_BATCH_SIZE, NUM_TRAIN)], labels[i : min(i + GLOBAL_BATCH_SIZE, NUM_TRAIN)])
        for i in range(0, NUM_TRAIN, GLOBAL_BATCH_SIZE)
    ]
    test_dataset = [(images[800:900], labels[800:900]), (images[900:], labels[900:])]
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    with strategy.scope():
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = kdist.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
            if model_losses:
                loss += kdist.nn.scale_regularization_loss(sum(model_losses))
            return loss

        test_loss = keras.metrics.Mean(name="test_loss")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")
        model = create_model(dtype)
        optimizer = keras.optimizers.Adam(learning_rate=0.01)

    def train_step(inputs):
        images, labels = inputs
        predictions = model(images, training=True)
        loss = compute_loss(labels, predictions, model.losses)
        # torch in place of tf.GradientTape: backward, then each variable's .grad.
        model.zero_grad()
        loss.backward()
        gradients = [v.value.grad for v in model.trainable_variables]
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss.detach()

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(kdist.ReduceOp.SUM, per_replica_losses, axis=None)

    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    history = []
    for epoch in range(epochs):
        total_loss = 0.0
        num_batches = 0
        for x in train_dist_dataset:
            total_loss += float(distributed_train_step(x))
            num_batches += 1
        train_loss = total_loss / num_batches
        with torch.no_grad():
            for x in test_dist_dataset:
                distributed_test_step(x)
        history.append([train_loss, float(train_accuracy.result()), float(test_loss.result()),
                        float(test_accuracy.result())])
        print(
            f"Epoch {epoch + 1}, Loss: {train_loss:.4f}, Accuracy: {float(train_accuracy.result()) * 100:.2f}, "
            f"Test Loss: {float(test_loss.result()):.4f}, Test Accuracy: {float(test_accuracy.result()) * 100:.2f}"
        )
        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()

    results = {f"weight/{i}": v.numpy() for i, v in enumerate(model.weights)}
    results.update({f"optimizer/{i}": np.asarray(v.numpy()) for i, v in enumerate(optimizer.variables)})
    results["history"] = np.asarray(history)
    results["iterations"] = np.asarray(int(optimizer.iterations.numpy()))
    results["steps"] = np.asarray(epochs * len(train_dataset))
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = kdist.MultiWorkerMirroredStrategy()
    results = train(strategy)
    np.savez(os.path.join(args.out, f"rank{strategy.extended.collectives.rank}.npz"), **results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
