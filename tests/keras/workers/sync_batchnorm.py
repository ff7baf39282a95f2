"""SyncBatchNorm scenarios: imported by the tests (reference and in-process runs) or run as one rank.

As a script (under `kdist launch`/`torchrun`): trains with
`MultiWorkerMirroredStrategy` — `--mode custom` a `strategy.run` loop, `--mode
fit` `model.fit`/`evaluate`/`predict` — and writes the results to
`<out>/rank<r>.npz`. The test compares them with the same function run with no
strategy (plain Keras, `synchronized=False`, one device).
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

SEED = 7
# Global batch sizes of the custom loop: uneven over 2 and 3 replicas, and the
# last one leaves a replica without samples when there are 3 or more.
CUSTOM_BATCHES = (7, 5, 8, 2)
LEARNING_RATE = 0.1
NUM_SAMPLES = 200
GLOBAL_BATCH = 64  # 200 = 3 * 64 + 8: the last batch splits unevenly
EPOCHS = 2


# ----- models ---------------------------------------------------------------------
def dense_model(synchronized):
    seeding.set_random_seed(SEED)
    return keras.Sequential(
        [
            keras.Input((6,)),
            # No bias before BatchNormalization: its gradient is rounding noise
            # that Adam would amplify into visible, meaningless differences.
            keras.layers.Dense(8, use_bias=False),
            keras.layers.BatchNormalization(synchronized=synchronized, momentum=0.8),
            keras.layers.Activation("relu"),
            keras.layers.Dense(3),
        ]
    )


def conv_model(synchronized):
    seeding.set_random_seed(SEED)
    return keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(4, 3, use_bias=False),
            keras.layers.BatchNormalization(synchronized=synchronized, momentum=0.8),
            keras.layers.Activation("relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3),
        ]
    )


def masked_model(synchronized):
    """Embedding(mask_zero=True) feeds BatchNormalization a mask (padding must not count)."""
    seeding.set_random_seed(SEED)
    return keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(10, 4, mask_zero=True),
            keras.layers.BatchNormalization(synchronized=synchronized, momentum=0.8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )


BUILDERS = {"dense": dense_model, "conv": conv_model, "masked": masked_model}


def compile_model(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def make_data(kind, num_samples=NUM_SAMPLES):
    rng = np.random.default_rng(0)
    if kind == "masked":
        x = rng.integers(0, 10, size=(num_samples, 5)).astype("int32")
        x[rng.random(x.shape) < 0.4] = 0  # padding the statistics must skip
    elif kind == "conv":
        x = (rng.normal(size=(num_samples, 6, 6, 2)) * 2 + 1).astype("float32")
    else:
        x = (rng.normal(size=(num_samples, 6)) * 3 + 1).astype("float32")
    y = rng.integers(0, 3, size=(num_samples,)).astype("int64")
    return x, y


def build(kind, strategy):
    """Plain Keras with `synchronized=False` when `strategy` is None, else SyncBN inside its scope."""
    if strategy is None:
        return BUILDERS[kind](False)
    with strategy.scope():
        return BUILDERS[kind](True)


# ----- a tf.distribute-style custom loop ---------------------------------------------
def custom_loop(kind, strategy=None):
    """Trains with per-example losses scaled by the global batch and summed gradients (SGD).

    Returns every model variable (weights, moving statistics) as numpy arrays.
    """
    x, y = make_data(kind)
    model = build(kind, strategy)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    start = 0
    for size in CUSTOM_BATCHES:
        xs, ys = torch.as_tensor(x[start : start + size]), torch.as_tensor(y[start : start + size])
        start += size

        def replica_step(inputs, labels, global_size=size):
            variables = [v.value for v in model.trainable_variables]
            loss = torch.sum(loss_fn(labels, model(inputs, training=True))) / global_size
            return list(torch.autograd.grad(loss, variables, allow_unused=True))

        if strategy is None:
            gradients = replica_step(xs, ys)
        else:
            inputs = strategy.experimental_distribute_values_from_function(
                lambda ctx, xs=xs, ys=ys: _replica_slice((xs, ys), ctx)
            )
            per_replica = strategy.run(lambda pair: replica_step(*pair), args=(inputs,))
            gradients = [strategy.reduce("sum", g, axis=None) for g in per_replica]
        with torch.no_grad():
            for variable, gradient in zip(model.trainable_variables, gradients):
                variable.assign(variable.value - LEARNING_RATE * gradient.to(variable.value.device))
    return {f"variable/{i}": np.asarray(keras.ops.convert_to_numpy(v)) for i, v in enumerate(model.variables)}


def _replica_slice(batch, ctx):
    from kdist.distribute.batching import split_sizes

    total = batch[0].shape[0]
    sizes = split_sizes(total, ctx.num_replicas_in_sync)
    start = sum(sizes[: ctx.replica_id_in_sync_group])
    end = start + sizes[ctx.replica_id_in_sync_group]
    return tuple(part[start:end] for part in batch)


# ----- model.fit -------------------------------------------------------------------------
def fit(kind, strategy=None, num_samples=NUM_SAMPLES):
    """fit (with validation), evaluate and predict; returns every compared value as numpy arrays."""
    x, y = make_data(kind, num_samples)
    model = compile_model(build(kind, strategy))
    seeding.set_random_seed(11)  # the same shuffle order with and without a strategy
    history = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=True, verbose=0,
        validation_data=(x[:50], y[:50]),
    )
    results = {}
    for group, variables in (
        ("weight", model.weights),
        ("optimizer", model.optimizer.variables),
        ("metric", model.metrics_variables),
    ):
        for i, v in enumerate(variables):
            results[f"{group}/{i}"] = np.asarray(keras.ops.convert_to_numpy(v))
    for key, values in history.history.items():
        results[f"history/{key}"] = np.asarray(values, dtype="float64")
    evaluation = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    for key, value in evaluation.items():
        results[f"evaluate/{key}"] = np.asarray(value, dtype="float64")
    results["predict"] = np.asarray(model.predict(x[:77], batch_size=GLOBAL_BATCH, verbose=0))
    return results


def largest_differences(reference, results):
    assert set(reference) == set(results), set(reference) ^ set(results)
    return {
        key: float(np.max(np.abs(np.asarray(value, dtype="float64") - results[key]))) if np.size(value) else 0.0
        for key, value in reference.items()
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["custom", "fit"], required=True)
    parser.add_argument("--kind", choices=sorted(BUILDERS), default="dense")
    parser.add_argument("--local-devices", type=int, default=1)
    parser.add_argument("--fault", choices=["local_statistics"])
    parser.add_argument("--num-samples", type=int, default=NUM_SAMPLES)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()

    import kdist
    from kdist import faults

    if args.fault:
        setattr(faults.ACTIVE, args.fault, True)
    devices = [f"cpu:{i}" for i in range(args.local_devices)] if args.local_devices > 1 else None
    strategy = kdist.MultiWorkerMirroredStrategy(
        communication_options=kdist.CommunicationOptions(timeout_seconds=args.timeout), devices=devices
    )
    rank = strategy.extended.collectives.rank
    if args.mode == "custom":
        results = custom_loop(args.kind, strategy)
    else:
        results = fit(args.kind, strategy, num_samples=args.num_samples)
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), **results)
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
