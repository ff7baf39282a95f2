"""What synchronized BatchNormalization costs per step on top of ordinary BatchNormalization.

Both configurations run under the same `kdist.MirroredStrategy(["cpu:0",
"cpu:1"])` (two logical CPU replicas) on one small conv net (two Conv2D +
BatchNormalization blocks, global pooling, Dense; Adam), with the same data
and global batch:

- `batchnorm`: `BatchNormalization()` (per-replica statistics);
- `sync_batchnorm`: `BatchNormalization(synchronized=True)` (global statistics:
  one merge per layer in the forward and one in the backward pass, and the
  engine's merge mode, one thread per replica).

Two paths are measured: `fit` (the replica engine) and `custom_loop`
(`strategy.run` with gradients summed over replicas). Rounds of each
configuration run interleaved, so machine load hits both alike; the line gives
the median seconds per step of each and SyncBN's extra milliseconds per step.

Usage:

    python benchmarks/syncbn_overhead.py           # about half a minute on 2 cores
    python benchmarks/syncbn_overhead.py --quick   # smoke run, seconds
"""

import os

# Keras reads the backend once, at import time.
os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from _report import environment, git_commit  # noqa: E402  (benchmarks/ is on sys.path)

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

GLOBAL_BATCH = 64
IMAGE_SHAPE = (16, 16, 3)
NUM_CLASSES = 10
DEVICES = ["cpu:0", "cpu:1"]
CONFIGS = (("batchnorm", False), ("sync_batchnorm", True))
WARMUP_STEPS = 6


def build_model(synchronized):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input(IMAGE_SHAPE),
            keras.layers.Conv2D(16, 3, use_bias=False),
            keras.layers.BatchNormalization(synchronized=synchronized),
            keras.layers.ReLU(),
            keras.layers.Conv2D(16, 3, use_bias=False),
            keras.layers.BatchNormalization(synchronized=synchronized),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(NUM_CLASSES),
        ]
    )
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit_timer(model, x, y):
    def run(num_steps):
        model.fit(x[: num_steps * GLOBAL_BATCH], y[: num_steps * GLOBAL_BATCH],
                  batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)

    return run


def custom_loop_timer(model, strategy, x, y):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    per_replica = GLOBAL_BATCH // len(DEVICES)

    def replica_step(inputs, labels):
        variables = [v.value for v in model.trainable_variables]
        loss = torch.sum(loss_fn(labels, model(inputs, training=True))) / GLOBAL_BATCH
        return list(torch.autograd.grad(loss, variables))

    def run(num_steps):
        for step in range(num_steps):
            start = step * GLOBAL_BATCH
            inputs = strategy.experimental_distribute_values_from_function(
                lambda ctx, start=start: tuple(
                    torch.as_tensor(a[start + ctx.replica_id_in_sync_group * per_replica :][:per_replica])
                    for a in (x, y)
                )
            )
            grads = strategy.run(lambda pair: replica_step(*pair), args=(inputs,))
            with torch.no_grad():
                for variable, grad in zip(model.trainable_variables, grads):
                    variable.assign(variable.value - 0.01 * strategy.reduce("sum", grad, axis=None))

    return run


def measure(path, num_steps, num_rounds):
    rng = np.random.default_rng(0)
    num_rows = max(num_steps, WARMUP_STEPS) * GLOBAL_BATCH
    x = rng.standard_normal((num_rows, *IMAGE_SHAPE), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, size=num_rows)
    # A throwaway model first: on this machine the first model's fit stayed
    # several times slower for the whole run, whichever configuration it was.
    strategy = kdist.MirroredStrategy(DEVICES)
    with strategy.scope():
        throwaway = build_model(False)
    fit_timer(throwaway, x, y)(WARMUP_STEPS)
    timers = {}
    for name, synchronized in CONFIGS:
        strategy = kdist.MirroredStrategy(DEVICES)
        with strategy.scope():
            model = build_model(synchronized)
        timers[name] = fit_timer(model, x, y) if path == "fit" else custom_loop_timer(model, strategy, x, y)
        # Warm-up: the first few steps build oneDNN kernels (hundreds of ms each on
        # CPU) and, for fit, switch the engine to merge mode.
        timers[name](WARMUP_STEPS)
    seconds = {name: [] for name, _ in CONFIGS}
    for _ in range(num_rounds):
        for name, _ in CONFIGS:
            gc.collect()
            start = time.perf_counter()
            timers[name](num_steps)
            seconds[name].append((time.perf_counter() - start) / num_steps)
    plain = statistics.median(seconds["batchnorm"])
    synced = statistics.median(seconds["sync_batchnorm"])
    return {
        "path": path,
        "seconds_per_step": {name: round(statistics.median(values), 5) for name, values in seconds.items()},
        "extra_ms_per_step": round((synced - plain) * 1e3, 3),
        "ratio_sync_vs_plain": round(synced / plain, 3),
        "paired_ratio_median": round(
            statistics.median(s / p for s, p in zip(seconds["sync_batchnorm"], seconds["batchnorm"])), 3
        ),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 steps, 2 rounds")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (default 5; 2 with --quick)")
    parser.add_argument("--steps", type=int, help="steps per round (default 20; 4 with --quick)")
    parser.add_argument("--paths", nargs="+", choices=["fit", "custom_loop"], default=["fit", "custom_loop"])
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.steps = args.steps or (4 if args.quick else 20)
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps must be at least 1. Received: --rounds={args.rounds} --steps={args.steps}.")
    return args


def main(argv=None):
    args = parse_args(argv)
    commit = git_commit()
    for path in args.paths:
        result = measure(path, args.steps, args.rounds)
        line = {
            "what": "syncbn_overhead",
            **result,
            "num_replicas": len(DEVICES),
            "global_batch": GLOBAL_BATCH,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
            "environment": environment(torch_num_threads=torch.get_num_threads()),
            "commit": commit,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
