"""What `kdist.MirroredStrategy` costs on top of plain Keras, measured side by side.

For each global batch size, three copies of one model (MLP 784-256-256-10,
relu, Adam, sparse categorical cross-entropy from logits, accuracy) train on
the same synthetic data with the same global batch:

- `plain`: ordinary Keras, no strategy;
- `mirrored_1`: `kdist.MirroredStrategy(["cpu:0"])`, one replica;
- `mirrored_2`: `kdist.MirroredStrategy(["cpu:0", "cpu:1"])`, two logical CPU
  replicas that take turns on the one CPU device;
- `plain_half_batches`: plain Keras doing the same epoch in batches of half the
  size, i.e. two ordinary Keras steps on half a batch per global step. That is
  the work any engine must do that runs the model's own `train_step` once per
  replica, with no kdist code at all (slightly pessimistic: it also runs the
  optimizer twice). `mirrored_2`'s `ratio_vs_floor` compares against it, which
  separates kdist's own cost from the cost of a second Keras step.

All models are built and warmed up first; then rounds of one timed `fit`
epoch each run interleaved (plain, mirrored_1, mirrored_2, plain, ...), so a
change in machine load hits every configuration alike. The median steps/s of
each configuration is compared with plain Keras' median.

Output: one JSON line per (batch size, configuration). See
`benchmarks/README.md` for how to read it.

Usage:

    python benchmarks/mirrored_overhead.py           # full run, about a minute on 2 cores
    python benchmarks/mirrored_overhead.py --quick   # smoke run, seconds
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

BATCH_SIZES = (128, 1024)
INPUT_FEATURES = 784
NUM_CLASSES = 10

# Lowest acceptable steps/s relative to plain Keras, by replica count. Two logical
# CPU replicas run one after the other on the same cores, so they do the same
# arithmetic as one replica plus a second pass of Python overhead per step.
TARGET_RATIO = {1: 0.95, 2: 0.85}

CONFIGS = (
    ("plain", None),
    ("mirrored_1", ["cpu:0"]),
    ("mirrored_2", ["cpu:0", "cpu:1"]),
    ("plain_half_batches", None),
)
# Configurations that run plain Keras with this fraction of the global batch.
BATCH_FRACTION = {"plain_half_batches": 2}


def build_model():
    model = keras.Sequential(
        [
            keras.Input((INPUT_FEATURES,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(NUM_CLASSES),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def build_models():
    """One `(model, num_replicas)` per configuration, all starting from the same weights."""
    models = {}
    for name, devices in CONFIGS:
        keras.utils.set_random_seed(0)
        if devices is None:
            models[name] = (build_model(), 1)
            continue
        strategy = kdist.MirroredStrategy(devices=devices)
        with strategy.scope():
            models[name] = (build_model(), strategy.num_replicas_in_sync)
    reference = models["plain"][0].get_weights()
    for model, _ in models.values():
        model.set_weights(reference)
    return models


def time_one_epoch(model, x, y, batch_size):
    """Seconds for one `fit` epoch over `x` (no shuffling: only the step path is timed)."""
    # Collect now so a collection triggered by an earlier config is not billed here.
    gc.collect()
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def run_batch_size(batch_size, num_steps, num_rounds, num_warmup_steps):
    rng = np.random.default_rng(batch_size)
    x = rng.standard_normal((num_steps * batch_size, INPUT_FEATURES), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, size=num_steps * batch_size)
    models = build_models()

    warmup_samples = num_warmup_steps * batch_size
    for name, (model, _) in models.items():
        step_batch = batch_size // BATCH_FRACTION.get(name, 1)
        time_one_epoch(model, x[:warmup_samples], y[:warmup_samples], step_batch)

    steps_per_sec = {name: [] for name, _ in CONFIGS}
    for _ in range(num_rounds):
        for name, _ in CONFIGS:
            step_batch = batch_size // BATCH_FRACTION.get(name, 1)
            seconds = time_one_epoch(models[name][0], x, y, step_batch)
            steps_per_sec[name].append(num_steps / seconds)

    plain_median = statistics.median(steps_per_sec["plain"])
    results = []
    for name, _ in CONFIGS:
        num_replicas = models[name][1]
        median = statistics.median(steps_per_sec[name])
        ratio = median / plain_median
        paired = [s / p for s, p in zip(steps_per_sec[name], steps_per_sec["plain"])]
        target = None if name in ("plain", "plain_half_batches") else TARGET_RATIO[num_replicas]
        results.append(
            {
                "config": name,
                "batch_size": batch_size,
                "num_replicas": num_replicas,
                "steps_per_sec": round(median, 2),
                "ratio_vs_plain": round(ratio, 3),
                "paired_ratio_median": round(statistics.median(paired), 3),
                "target": target,
                "meets_target": None if target is None else ratio >= target,
                "steps_per_sec_by_round": [round(value, 2) for value in steps_per_sec[name]],
            }
        )
        if name == "mirrored_2":
            floor = statistics.median(steps_per_sec["plain_half_batches"])
            results[-1]["ratio_vs_floor"] = round(median / floor, 3)
    return results


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 steps, 2 rounds")
    parser.add_argument(
        "--rounds", type=int, help="interleaved timing rounds (default 9; 2 with --quick)"
    )
    parser.add_argument(
        "--steps", type=int, help="steps per timed epoch (default 100; 8 with --quick)"
    )
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 9
    if args.steps is None:
        args.steps = 8 if args.quick else 100
    if args.rounds < 1 or args.steps < 1:
        parser.error(
            "--rounds and --steps must be at least 1. Received: "
            f"--rounds={args.rounds} --steps={args.steps}."
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    commit = git_commit()
    for batch_size in BATCH_SIZES:
        results = run_batch_size(
            batch_size, args.steps, args.rounds, num_warmup_steps=max(2, args.steps // 10)
        )
        # Sampled after each batch size: the load this batch size ran under.
        env = environment(torch_num_threads=torch.get_num_threads())
        for result in results:
            line = {"what": "mirrored_overhead", **result}
            line.update(
                rounds=args.rounds,
                steps_per_round=args.steps,
                environment=env,
                commit=commit,
            )
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
