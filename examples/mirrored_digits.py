"""Train a digit classifier with `kdist.MirroredStrategy`, end to end.

The data are synthetic 8x8 "seven-segment" digits (64 features, 10 classes,
ink intensity 0..16 like scikit-learn's digits), drawn with a fixed seed: each
sample is its digit's segments, shifted by up to one pixel, with random stroke
strength, missing ink and noise. Nothing beyond kdist's own dependencies is
needed.

The program builds an MLP with Dropout and BatchNormalization inside
`strategy.scope()`, trains it with `fit` (validation data, `ModelCheckpoint`
keeping the best `.keras` file, `EarlyStopping`), evaluates, predicts, saves
the model, reloads the file with plain `keras.saving.load_model` and checks
that the reloaded model predicts the same. While it trains, it shows Keras'
progress: a bar in a terminal, one line per epoch when stdout is a file or a
pipe. Last, it prints one JSON line of metrics and exits non-zero when the test
accuracy is below `--min-accuracy`.

Replicas: every visible GPU, else two logical CPU replicas (`cpu:0`, `cpu:1`).

The same file runs on every Keras backend kdist supports:

    KERAS_BACKEND=torch      python examples/mirrored_digits.py   # the default here
    KERAS_BACKEND=tensorflow python examples/mirrored_digits.py
    KERAS_BACKEND=jax        python examples/mirrored_digits.py

Measured with `time` on a 2-core machine shared with other jobs (torch 2.13
CPU, Keras 3.15.1, 2 logical replicas, 2026-11-27): the defaults (6000 training
samples, up to 30 epochs; EarlyStopping ends after 16) reach a test accuracy of
0.964 in 20 s wall time, start-up included, while the cores were nearly idle
(load average 1.4), and in 67 s while other jobs kept them busy (load average
2.6 to 3.7). That environment has TensorFlow installed, which Keras imports
for its first `.keras` save (about 3 s); the quick start's does not.
`--small` (2000 samples, 20 epochs) is the size CI runs. The data and seeds
are fixed, so a CPU run repeats these accuracies.

Usage:

    python examples/mirrored_digits.py
    python examples/mirrored_digits.py --small --out-dir /tmp/digits
"""

import os

# Keras reads the backend once, at import time.
os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402
import numpy as np  # noqa: E402

NUM_CLASSES = 10
IMAGE_SIZE = 8
# How hard the task is: share of a digit's pixels left blank, and pixel noise.
MISSING_INK = 0.05
NOISE = 0.1

# Seven-segment layout on an 8x8 grid: (rows, columns) each segment inks.
_SEGMENTS = {
    "a": ([1], range(2, 6)),
    "b": (range(1, 4), [5]),
    "c": (range(3, 7), [5]),
    "d": ([6], range(2, 6)),
    "e": (range(3, 7), [2]),
    "f": (range(1, 4), [2]),
    "g": ([3], range(2, 6)),
}
# Segments of digits 0..9.
_DIGIT_SEGMENTS = (
    "abcdef", "bc", "abged", "abgcd", "fgbc", "afgcd", "afgedc", "abc", "abcdefg", "abcdfg"
)


def digit_prototypes():
    """Returns a `(10, 8, 8)` array: each digit's segments inked at 1.0."""
    prototypes = np.zeros((NUM_CLASSES, IMAGE_SIZE, IMAGE_SIZE), dtype="float32")
    for digit, segments in enumerate(_DIGIT_SEGMENTS):
        for segment in segments:
            rows, columns = _SEGMENTS[segment]
            prototypes[digit][np.ix_(list(rows), list(columns))] = 1.0
    return prototypes


def make_digits(num_samples, seed):
    """Returns `(x, y)`: `x` float32 `(num_samples, 64)` in 0..16, `y` int64 labels."""
    rng = np.random.default_rng(seed)
    prototypes = digit_prototypes()
    y = rng.integers(0, NUM_CLASSES, size=num_samples)
    images = prototypes[y]
    shifts = rng.integers(-1, 2, size=(num_samples, 2))
    images = np.stack(
        [np.roll(image, tuple(shift), axis=(0, 1)) for image, shift in zip(images, shifts)]
    )
    stroke = rng.uniform(0.6, 1.0, size=(num_samples, 1, 1))
    missing_ink = rng.random(images.shape) < MISSING_INK
    images = images * stroke * ~missing_ink + rng.normal(0.0, NOISE, size=images.shape)
    x = np.clip(images * 16.0, 0.0, 16.0).astype("float32").reshape(num_samples, -1)
    return x, y.astype("int64")


def replica_devices():
    """Every visible GPU, else two logical CPU replicas."""
    return kdist.visible_gpus() or ["cpu:0", "cpu:1"]


def build_model():
    model = keras.Sequential(
        [
            keras.Input((IMAGE_SIZE * IMAGE_SIZE,)),
            keras.layers.Rescaling(1.0 / 16.0),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(NUM_CLASSES, activation="softmax"),
        ],
        name="digits_mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--epochs", type=int, default=30, help="most epochs (EarlyStopping may stop sooner)"
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=6000,
        help="training samples; validation and test get a fifth as many each",
    )
    parser.add_argument(
        "--batch-size", type=int, default=128, help="GLOBAL batch size, split across replicas"
    )
    parser.add_argument(
        "--out-dir",
        default=None,
        help="where checkpoints and the saved model go (default: a temporary directory)",
    )
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=0.8,
        help="exit non-zero if the test accuracy is below this",
    )
    parser.add_argument(
        "--small", action="store_true", help="CI size: 2000 samples, at most 20 epochs"
    )
    args = parser.parse_args(argv)
    if args.small:
        args.samples = min(args.samples, 2000)
        args.epochs = min(args.epochs, 20)
    return args


def progress_verbosity():
    """Keras' bar in a terminal; one line per epoch when stdout is a file or a pipe.

    Keras' "auto" means the bar everywhere, and the bar redraws itself with
    carriage returns even in a log file; `verbose=2` is what Keras recommends there.
    """
    return "auto" if sys.stdout.isatty() else 2


def run(args, out_dir):
    # First, as with tf.distribute: on TensorFlow and JAX, several CPU replicas
    # must be configured before the backend's first computation.
    strategy = kdist.MirroredStrategy(devices=replica_devices())
    keras.utils.set_random_seed(0)
    x_train, y_train = make_digits(args.samples, seed=1)
    x_val, y_val = make_digits(max(args.samples // 5, 1), seed=2)
    x_test, y_test = make_digits(max(args.samples // 5, 1), seed=3)

    with strategy.scope():
        model = build_model()

    best_path = os.path.join(out_dir, "best.keras")
    callbacks = [
        keras.callbacks.ModelCheckpoint(best_path, monitor="val_loss", save_best_only=True),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True),
    ]
    history = model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x_val, y_val),
        callbacks=callbacks,
        verbose=progress_verbosity(),
    )
    test_loss, test_accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    predictions = model.predict(x_test, batch_size=args.batch_size, verbose=0)

    final_path = os.path.join(out_dir, "digits_mlp.keras")
    model.save(final_path)
    # Loaded outside any strategy scope: an ordinary single-device Keras model.
    reloaded = keras.saving.load_model(final_path)
    reloaded_predictions = reloaded.predict(x_test, batch_size=args.batch_size, verbose=0)
    max_difference = float(np.max(np.abs(predictions - reloaded_predictions)))

    return {
        "example": "mirrored_digits",
        "devices": list(strategy.extended.worker_devices),
        "num_replicas": strategy.num_replicas_in_sync,
        "train_samples": args.samples,
        "global_batch_size": args.batch_size,
        "epochs_run": len(history.history["loss"]),
        "best_val_loss": round(float(min(history.history["val_loss"])), 4),
        "test_loss": round(float(test_loss), 4),
        "test_accuracy": round(float(test_accuracy), 4),
        "predict_accuracy": round(float(np.mean(predictions.argmax(axis=1) == y_test)), 4),
        "reloaded_max_abs_difference": max_difference,
        "checkpoint_saved": os.path.exists(best_path),
    }


def report_failures(metrics, min_accuracy):
    """Prints why `metrics` fail the example's checks; returns the exit status (0: passed)."""
    failures = []
    if metrics["test_accuracy"] < min_accuracy:
        failures.append(f"test accuracy {metrics['test_accuracy']} is below --min-accuracy={min_accuracy}")
    if metrics["reloaded_max_abs_difference"] > 1e-5:
        failures.append(
            "the reloaded model predicts differently (max |difference| "
            f"{metrics['reloaded_max_abs_difference']:.2e})"
        )
    if not metrics["checkpoint_saved"]:
        failures.append("ModelCheckpoint wrote no file")
    for failure in failures:
        print(f"{metrics['example']}: FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    if args.out_dir is None:
        with tempfile.TemporaryDirectory(prefix="mirrored_digits_") as out_dir:
            metrics = run(args, out_dir)
    else:
        os.makedirs(args.out_dir, exist_ok=True)
        metrics = run(args, args.out_dir)
    metrics["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(metrics))

    return report_failures(metrics, args.min_accuracy)


if __name__ == "__main__":
    sys.exit(main())
