"""One rank of a multi-worker run that exercises how gradients travel, or (imported) the plain reference.

The paths: reduced during backward (overlap) or after it, compressed or not,
deferred over accumulation micro-steps, and the fallbacks a `train_step` that
changes its gradients or runs backward twice forces. Run as a script under
`tests.harness` (torchrun variables); writes `<out>/rank<r>.npz` (weights,
optimizer variables, history) and `<out>/rank<r>.json`: the collectives'
statistics, why overlap was turned off (if it was), and per step how many
gradient buckets had been started when the first layer's gradient was computed
(the last one backward produces).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

SEED = 7
NUM_SAMPLES = 640
GLOBAL_BATCH = 64
EPOCHS = 2
VOCAB, STEPS, CLASSES = 12, 7, 5
MODELS = ("mlp", "masked", "scaled_gradients", "two_backward", "rank_dependent")


def make_data(kind):
    rng = np.random.default_rng(0)
    if kind == "masked":
        # Padding at the end, lengths 1..STEPS: every shard has its own divisor.
        lengths = rng.integers(1, STEPS + 1, size=NUM_SAMPLES)
        x = rng.integers(1, VOCAB, size=(NUM_SAMPLES, STEPS))
        x[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0
        return x.astype("int64"), ((x + 1) % CLASSES).astype("int64")
    x = rng.normal(size=(NUM_SAMPLES, 12)).astype("float32")
    y = (x[:, :3].sum(axis=1) > 0).astype("int64") + (x[:, 3] > 1).astype("int64")
    return x, y


class ScaledGradients(keras.Sequential):
    """A keras.io-style train_step that halves its gradients between backward and apply."""

    def train_step(self, data):
        x, y = data
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        self.zero_grad()
        loss.backward()
        gradients = [v.value.grad * 0.5 for v in self.trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, self.trainable_weights)
        return self.compute_metrics(x, y, y_pred)


class TwoBackward(keras.Sequential):
    """A train_step whose gradients accumulate over two backward passes."""

    def train_step(self, data):
        x, y = data
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        self.zero_grad()
        (loss * 0.25).backward(retain_graph=True)
        (loss * 0.75).backward()
        gradients = [v.value.grad for v in self.trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, self.trainable_weights)
        return self.compute_metrics(x, y, y_pred)


class RankDependent(keras.Sequential):
    """A train_step whose control flow differs between processes: the last layer is skipped on rank 1."""

    def train_step(self, data):
        x, y = data
        hidden = x
        for layer in self.layers[:-1]:
            hidden = layer(hidden, training=True)
        y_pred = self.layers[-1](hidden) if os.environ.get("RANK", "0") == "0" else hidden[:, :3]
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        self.zero_grad()
        loss.backward()
        gradients = [v.value.grad for v in self.trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, self.trainable_weights)
        return self.compute_metrics(x, y, y_pred)


def build_model(kind, accumulation=None):
    seeding.set_random_seed(SEED)
    if kind == "masked":
        model = keras.Sequential(
            [
                keras.Input((STEPS,), dtype="int64"),
                keras.layers.Embedding(VOCAB, 6, mask_zero=True),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(CLASSES),
            ]
        )
    else:
        cls = {
            "mlp": keras.Sequential,
            "scaled_gradients": ScaledGradients,
            "two_backward": TwoBackward,
            "rank_dependent": RankDependent,
        }[kind]
        # Several layers: with small buckets the gradients travel in several calls.
        model = cls(
            [
                keras.Input((12,)),
                keras.layers.Dense(64, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(3),
            ]
        )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=accumulation),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"],
    )
    return model


def train(kind="mlp", strategy=None, accumulation=None, initial_seed=SEED, callbacks=()):
    """Builds and fits a model; returns `(model, results)` with numpy results."""
    x, y = make_data(kind)
    if strategy is None:
        model = build_model(kind, accumulation)
    else:
        with strategy.scope():
            model = build_model(kind, accumulation)
    seeding.set_random_seed(initial_seed)
    history = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=True, verbose=0, callbacks=list(callbacks)
    )
    results = {}
    for i, v in enumerate(model.weights):
        results[f"weight/{i}"] = np.asarray(keras.ops.convert_to_numpy(v))
    for i, v in enumerate(model.optimizer.variables):
        results[f"optimizer/{i}"] = np.asarray(keras.ops.convert_to_numpy(v))
    for key, values in history.history.items():
        results[f"history/{key}"] = np.asarray(values, dtype="float64")
    return model, results


def checkpoint(directory):
    """Weights and optimizer variables after every epoch (a collective save under kdist)."""
    path = os.path.join(directory, "epoch{epoch}.weights.h5")
    return keras.callbacks.ModelCheckpoint(path, save_weights_only=True)


class BucketProbe(keras.callbacks.Callback):
    """Per step: gradient buckets started before the first layer's gradient was computed."""

    def __init__(self, collectives):
        super().__init__()
        self._collectives = collectives
        self._at_step_start = 0
        self._current = None
        self.started_before_last_gradient = []

    def _calls(self):
        stats = self._collectives.statistics.get("all_reduce(gradients)")
        return 0 if stats is None else stats.calls

    def on_train_begin(self, logs=None):
        # The first layer's kernel: backward computes its gradient last.
        self.model.layers[0].kernel.value.register_hook(self._on_last_gradient)

    def on_train_batch_begin(self, batch, logs=None):
        self._at_step_start = self._calls()

    def on_train_batch_end(self, batch, logs=None):
        self.started_before_last_gradient.append(self._current)

    def _on_last_gradient(self, grad):
        self._current = self._calls() - self._at_step_start
        return grad


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none")
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--accumulation", type=int)
    parser.add_argument("--bucket-bytes", type=int, default=25 * 2**20)
    parser.add_argument("--first-bucket-bytes", type=int, default=2**20)
    parser.add_argument("--checkpoint", action="store_true", help="save weights (with the optimizer) every epoch")
    parser.add_argument("--fault", choices=["overlap_ignores_changed_gradients", "dropped_pending_gradients"])
    args = parser.parse_args()

    import kdist
    from kdist import faults

    if args.fault:
        setattr(faults.ACTIVE, args.fault, True)
    options = kdist.CommunicationOptions(
        timeout_seconds=60,
        compression=getattr(kdist.Compression, args.compression),
        overlap_with_backward=not args.no_overlap,
        bucket_bytes=args.bucket_bytes,
        first_bucket_bytes=args.first_bucket_bytes,
    )
    strategy = kdist.MultiWorkerMirroredStrategy(communication_options=options)
    collectives = strategy.extended.collectives
    callbacks = [BucketProbe(collectives)] if args.model != "masked" else []
    if args.checkpoint:
        callbacks.append(checkpoint(args.out))
    model, results = train(args.model, strategy, args.accumulation, SEED + collectives.rank, callbacks=callbacks)
    probe = callbacks[0] if args.model != "masked" else None
    rank = collectives.rank
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), **results)
    report = {
        "statistics": {op: [s.calls, s.payload_bytes, s.wire_bytes] for op, s in collectives.statistics.items()},
        "overlap_disabled": model._kdist_engine.overlap.disabled_reason,
        "started_before_last_gradient": probe.started_before_last_gradient if probe else None,
        "steps": len(probe.started_before_last_gradient) if probe else None,
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as writer:
        json.dump(report, writer)
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
