"""Torch BatchNorm inside `TorchModuleWrapper`: scenarios imported by the tests, or run as one rank.

As a script (under `torchrun`-like environments from `tests.harness`): fits
the wrapped model under `MultiWorkerMirroredStrategy` and writes its buffers
and weights to `<out>/rank<r>.npz`. The test compares them with the same
function run in one process (plain Keras, or `MirroredStrategy` over 2 CPUs).
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

SEED = 5
GLOBAL_BATCH = 8
NUM_SAMPLES = 32  # 4 steps of 8: every shard of 2 replicas holds 4 samples
TORCH_MOMENTUM = 0.3  # torch's momentum m is Keras' momentum 1 - m
LEARNING_RATE = 0.1
NUM_FEATURES, NUM_HIDDEN, NUM_CLASSES = 4, 6, 3


class GhostBatchNorm1d(torch.nn.BatchNorm1d):
    """Plain-Keras reference of the documented multi-replica rule, on one device.

    In training, each of `num_shards` contiguous chunks of the batch is
    normalised with its own statistics (as each replica normalises its shard),
    the running statistics move by the mean of the chunks' updates from the
    same starting point, and `num_batches_tracked` advances once.
    """

    def __init__(self, num_features, num_shards, **kwargs):
        super().__init__(num_features, **kwargs)
        self.num_shards = num_shards

    def forward(self, inputs):
        if not self.training:
            return super().forward(inputs)
        outputs, means, variances = [], [], []
        for chunk in torch.chunk(inputs, self.num_shards):
            running_mean, running_var = self.running_mean.clone(), self.running_var.clone()
            outputs.append(
                torch.nn.functional.batch_norm(
                    chunk, running_mean, running_var, self.weight, self.bias, True, self.momentum, self.eps
                )
            )
            means.append(running_mean)
            variances.append(running_var)
        with torch.no_grad():
            self.running_mean.copy_(torch.stack(means).mean(0))
            self.running_var.copy_(torch.stack(variances).mean(0))
            self.num_batches_tracked.add_(1)
        return torch.cat(outputs)


def data(num_samples=NUM_SAMPLES):
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(num_samples, NUM_FEATURES)).astype("float32") * 2.0 + 1.5
    y = rng.integers(0, NUM_CLASSES, size=(num_samples,))
    return x, y


def torch_layers(ghost_shards=None):
    torch.manual_seed(SEED)
    first, last = torch.nn.Linear(NUM_FEATURES, NUM_HIDDEN), torch.nn.Linear(NUM_HIDDEN, NUM_CLASSES)
    if ghost_shards:
        norm = GhostBatchNorm1d(NUM_HIDDEN, ghost_shards, momentum=TORCH_MOMENTUM)
    else:
        norm = torch.nn.BatchNorm1d(NUM_HIDDEN, momentum=TORCH_MOMENTUM)
    return first, norm, last


def torch_model(ghost_shards=None):
    """`TorchModuleWrapper(Sequential(Linear, BatchNorm1d, ReLU, Linear))` in a Keras model."""
    first, norm, last = torch_layers(ghost_shards)
    module = torch.nn.Sequential(first, norm, torch.nn.ReLU(), last)
    inputs = keras.Input((NUM_FEATURES,))
    outputs = keras.layers.TorchModuleWrapper(module, name="wrapped", output_shape=(None, NUM_CLASSES))(inputs)
    return keras.Model(inputs, outputs)


def keras_model():
    """The same network with Keras' own `BatchNormalization` (torch's initial weights)."""
    first, _, last = torch_layers()
    model = keras.Sequential(
        [
            keras.Input((NUM_FEATURES,)),
            keras.layers.Dense(NUM_HIDDEN),
            keras.layers.BatchNormalization(momentum=1 - TORCH_MOMENTUM, epsilon=1e-5),
            keras.layers.Activation("relu"),
            keras.layers.Dense(NUM_CLASSES),
        ]
    )
    for dense, linear in ((model.layers[0], first), (model.layers[3], last)):
        dense.set_weights([linear.weight.detach().numpy().T, linear.bias.detach().numpy()])
    return model


def fit(strategy=None, kind="torch", ghost_shards=None, epochs=1, num_samples=NUM_SAMPLES):
    """Fits one model; returns its buffers (or moving statistics) and weights as numpy arrays."""
    build = keras_model if kind == "keras" else (lambda: torch_model(ghost_shards))
    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    model.compile(
        optimizer=keras.optimizers.SGD(LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = data(num_samples)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    results = {f"weight_{i}": np.asarray(keras.ops.convert_to_numpy(v)) for i, v in enumerate(model.weights)}
    if kind == "keras":
        layer = model.layers[1]
        results["running_mean"] = np.asarray(keras.ops.convert_to_numpy(layer.moving_mean))
        results["running_var"] = np.asarray(keras.ops.convert_to_numpy(layer.moving_variance))
    else:
        norm = model.get_layer("wrapped").module[1]
        for name, buffer in norm.named_buffers():
            results[name] = buffer.detach().cpu().numpy().copy()
    results["evaluate_loss"] = np.asarray(model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0))
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--fault", choices=["unsynced_torch_buffers"])
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()

    import kdist
    from kdist import faults

    if args.fault:
        setattr(faults.ACTIVE, args.fault, True)
    strategy = kdist.MultiWorkerMirroredStrategy(
        communication_options=kdist.CommunicationOptions(timeout_seconds=args.timeout)
    )
    rank = strategy.extended.collectives.rank
    results = fit(strategy, epochs=args.epochs)
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), **results)
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
