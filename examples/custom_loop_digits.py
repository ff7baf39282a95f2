"""A custom training loop with `kdist.MirroredStrategy`: `strategy.run` + `apply_gradients`.

TensorFlow's "Custom training with tf.distribute.Strategy" pattern on the
synthetic digits of `mirrored_digits.py`: each replica computes the loss of its
shard scaled by the global batch (`kdist.nn.compute_average_loss`), takes its
gradients and calls `optimizer.apply_gradients` inside the replica function.
kdist then does what TensorFlow does: the replicas' gradients are summed and
applied once per step, so `optimizer.iterations` counts steps. Keras metrics
updated in the replica function count every replica's samples.

Replicas: every visible GPU, else two logical CPU replicas. Under `kdist
launch --nproc N` use `--multi-worker`: the same loop then all-reduces the
gradients across processes.

Prints one JSON line; exits non-zero when the test accuracy is below
`--min-accuracy` or the step count is off.

Usage:

    python examples/custom_loop_digits.py
    python examples/custom_loop_digits.py --small
    kdist launch --nproc 2 examples/custom_loop_digits.py --small --multi-worker
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402
import torch  # noqa: E402

from mirrored_digits import make_digits, replica_devices  # noqa: E402  (same directory)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="2000 samples, 8 epochs (CI size)")
    parser.add_argument("--multi-worker", action="store_true", help="MultiWorkerMirroredStrategy (under kdist launch)")
    parser.add_argument("--min-accuracy", type=float, default=0.85)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    num_samples, epochs = (2000, 8) if args.small else (6000, 12)
    x, y = make_digits(num_samples, seed=0)
    x_test, y_test = make_digits(1000, seed=1)
    x, x_test = x / 16.0, x_test / 16.0

    strategy = kdist.MultiWorkerMirroredStrategy() if args.multi_worker else kdist.MirroredStrategy(replica_devices())
    GLOBAL_BATCH_SIZE = 128
    train_batches = [(x[i : i + GLOBAL_BATCH_SIZE], y[i : i + GLOBAL_BATCH_SIZE]) for i in range(0, len(x), GLOBAL_BATCH_SIZE)]
    train_dist_dataset = strategy.experimental_distribute_dataset(train_batches)

    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(128, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-4)),
                keras.layers.Dense(10),
            ]
        )
        optimizer = keras.optimizers.Adam(learning_rate=1e-2)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")

    def train_step(inputs, global_batch_size):
        images, labels = inputs
        predictions = model(images, training=True)
        per_example_loss = loss_object(labels, predictions)
        loss = kdist.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)
        loss += kdist.nn.scale_regularization_loss(sum(model.losses))
        # torch's autograd in place of tf.GradientTape.
        model.zero_grad()
        loss.backward()
        gradients = [v.value.grad for v in model.trainable_variables]
        # Inside the replica function: kdist sums every replica's gradients and applies once.
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss.detach()

    is_chief = getattr(strategy.extended, "should_checkpoint", True)  # one printer per job
    steps = 0
    for epoch in range(epochs):
        total_loss = 0.0
        for (images, labels), (_, batch_labels) in zip(train_dist_dataset, train_batches):
            # The partial last batch is divided by its real size.
            per_replica_loss = strategy.run(train_step, args=((images, labels), len(batch_labels)))
            total_loss += float(strategy.reduce("sum", per_replica_loss, axis=None))
            steps += 1
        if is_chief:
            print(f"epoch {epoch + 1}: loss {total_loss / len(train_batches):.4f}, "
                  f"accuracy {float(train_accuracy.result()):.4f}")
        train_accuracy.reset_state()

    with torch.no_grad():
        logits = model.predict(x_test, batch_size=256, verbose=0)
    test_accuracy = float((logits.argmax(axis=1) == y_test).mean())
    metrics = {
        "example": "custom_loop_digits",
        "replicas": strategy.num_replicas_in_sync,
        "steps": steps,
        "iterations": int(optimizer.iterations.numpy()),
        "test_accuracy": round(test_accuracy, 4),
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(metrics))
    failures = []
    if metrics["iterations"] != steps:
        failures.append(f"optimizer.iterations is {metrics['iterations']} after {steps} steps")
    if test_accuracy < args.min_accuracy:
        failures.append(f"test accuracy {test_accuracy} is below --min-accuracy={args.min_accuracy}")
    for failure in failures:
        print(f"custom_loop_digits: FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
