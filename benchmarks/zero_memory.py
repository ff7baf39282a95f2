"""Optimizer-state sharding (ZeRO-1): memory per process and step time, against the unsharded strategy.

A keras-hub-style decoder (token embedding, pre-norm transformer blocks of
`MultiHeadAttention` and a GELU feed-forward, a vocabulary head; about 204 M
parameters in `--size full`) trains with AdamW (weight decay 0.01) under
`kdist.MultiWorkerMirroredStrategy` in N processes on this machine (gloo,
loopback), once with `shard_optimizer_state=False` (`whole`, the baseline) and
once with `True` (`sharded`), for each N of `--processes`. Each configuration is
one `kdist launch --nproc N --no-warm` job (`--size quick` forks its processes from warm
ones: a smoke run, whose peak RSS includes what they share); each rank reports:

- `optimizer_state_bytes`: the bytes of the optimizer slots it holds (Adam's
  two moments; the step count and learning rate are not counted);
- `peak_rss_bytes`: its peak resident memory (`getrusage`, whole process);
- its step times (`fit`, after `--warmup` untimed steps).

One JSON line per N: per-rank figures of both configurations and
`state_ratio` (sharded bytes per rank / (whole bytes / N); the target is 1
within one alignment unit of 64 elements per variable and slot), and
`step_time_ratio` (whole's median step time / sharded's; the target is at
least 0.95). benchmarks/README.md explains the fields and records runs.

Usage:

    python benchmarks/zero_memory.py                        # ~204 M parameters, 2 and 4 processes
    python benchmarks/zero_memory.py --size half --processes 4    # ~99 M parameters
    python benchmarks/zero_memory.py --size quick --processes 2   # smoke run, seconds
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from _report import environment, git_commit  # noqa: E402  (benchmarks/ is on sys.path)
from _workers import kdist_root  # noqa: E402

CONFIGS = ("whole", "sharded")
SIZES = {
    # 32000 x 1024 embedding and head (65.5 M) + 11 blocks of 12.6 M: about 204 M parameters.
    "full": dict(vocabulary=32000, model_dim=1024, num_heads=16, num_blocks=11, sequence=32, batch=4),
    # 32000 x 768 embedding and head (49.2 M) + 7 blocks of 7.1 M: about 99 M parameters. Four
    # processes of "full" need about 32 GB unsharded: more than a 24 GiB machine holds.
    "half": dict(vocabulary=32000, model_dim=768, num_heads=12, num_blocks=7, sequence=32, batch=4),
    "quick": dict(vocabulary=512, model_dim=64, num_heads=4, num_blocks=2, sequence=16, batch=8),
}
WEIGHT_DECAY = 0.01
ALIGN_ELEMENTS = 64  # kdist.keras.replica.optimizer_shards.ALIGN


# ----- one rank ---------------------------------------------------------------------
def build_model(keras, vocabulary, model_dim, num_heads, num_blocks, sequence, **_):
    tokens = keras.Input((sequence,), dtype="int32")
    x = keras.layers.Embedding(vocabulary, model_dim)(tokens)
    for _ in range(num_blocks):
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.MultiHeadAttention(num_heads, model_dim // num_heads)(h, h, use_causal_mask=True)
        x = keras.layers.Add()([x, h])
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.Dense(4 * model_dim, activation="gelu")(h)
        x = keras.layers.Add()([x, keras.layers.Dense(model_dim)(h)])
    x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    return keras.Model(tokens, keras.layers.Dense(vocabulary)(x))


class StepClock:
    """Records `time.perf_counter()` at the end of every training step."""

    def __init__(self, keras):
        self.ends = []
        outer = self

        class Callback(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                outer.ends.append(time.perf_counter())

        self.callback = Callback()


def run_rank(args):
    import resource

    import keras
    import numpy as np

    import kdist
    from kdist.keras.replica import sharded_optimizer

    spec = SIZES[args.size]
    strategy = kdist.MultiWorkerMirroredStrategy(shard_optimizer_state=args.config == "sharded")
    collectives = strategy.extended.collectives
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = build_model(keras, **spec)
        model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-4, weight_decay=WEIGHT_DECAY),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    steps = args.warmup + args.steps
    batch = spec["batch"] * collectives.world_size  # each process trains on `batch` samples per step
    rng = np.random.default_rng(0)
    x = rng.integers(0, spec["vocabulary"], size=(steps * batch, spec["sequence"]), dtype="int32")
    y = np.roll(x, -1, axis=1)
    clock = StepClock(keras)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[clock.callback])
    state = sharded_optimizer.state_of(model.optimizer)
    if state is not None:
        slots = [v for v in state.shard.slot_variables if len(v.shape)]
    else:
        slots = [v for v in model.optimizer.variables if len(v.shape)]
    report = {
        "rank": collectives.rank,
        "parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        "trainable_variables": len(model.trainable_variables),
        "slot_variables": len(slots),
        "optimizer_state_bytes": int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in slots)),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_seconds": [b - a for a, b in zip(clock.ends[args.warmup - 1:-1], clock.ends[args.warmup:])],
    }
    with open(os.path.join(args.report_dir, f"{args.config}-rank{collectives.rank}.json"), "w") as file:
        json.dump(report, file)


# ----- the driver -------------------------------------------------------------------------
def run_job(args, config, processes, report_dir):
    # Cold processes, so that peak RSS is the process's own; the smoke size forks from warm ones.
    warm = [] if args.size == "quick" else ["--no-warm"]
    command = [sys.executable, "-m", "kdist", "launch", "--nproc", str(processes), *warm,
               "--timeout", str(args.job_timeout), os.path.abspath(__file__), "--role", "rank",
               "--config", config, "--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--report-dir", report_dir]
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // processes)))
    env["PYTHONPATH"] = os.pathsep.join([kdist_root()] + [p for p in [env.get("PYTHONPATH")] if p])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.job_timeout + 60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    reports = []
    for rank in range(processes):
        with open(os.path.join(report_dir, f"{config}-rank{rank}.json")) as file:
            reports.append(json.load(file))
    return reports


def summary(processes, results):
    whole, sharded = results["whole"], results["sharded"]
    whole_bytes = whole[0]["optimizer_state_bytes"]
    share = whole_bytes / processes
    bytes_per_element = whole_bytes / max(1, sum(r["parameters"] for r in whole[:1]) * 2)
    # One alignment unit per variable and slot: how far a rank's share may be from 1/N.
    slack = ALIGN_ELEMENTS * whole[0]["slot_variables"] * bytes_per_element

    def median_step(reports):  # the slowest rank's median: a step ends when every rank's does
        return max(statistics.median(r["step_seconds"]) for r in reports)

    whole_step, sharded_step = median_step(whole), median_step(sharded)
    state_ratio = max(r["optimizer_state_bytes"] for r in sharded) / share
    return {
        "what": "zero_memory",
        "processes": processes,
        "parameters": whole[0]["parameters"],
        "whole": {key: [r[key] for r in whole] for key in ("optimizer_state_bytes", "peak_rss_bytes")},
        "sharded": {key: [r[key] for r in sharded] for key in ("optimizer_state_bytes", "peak_rss_bytes")},
        "state_ratio": round(state_ratio, 4),
        "state_within_one_unit": all(abs(r["optimizer_state_bytes"] - share) <= slack for r in sharded),
        "rss_saved_bytes_per_rank": [w["peak_rss_bytes"] - s["peak_rss_bytes"] for w, s in zip(whole, sharded)],
        "step_seconds": {"whole": round(whole_step, 4), "sharded": round(sharded_step, 4)},
        "step_time_ratio": round(whole_step / sharded_step, 4),
        "target_step_time_ratio": 0.95,
        "meets_target": whole_step / sharded_step >= 0.95 and all(
            abs(r["optimizer_state_bytes"] - share) <= slack for r in sharded),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--processes", default="2,4", help="comma-separated numbers of processes")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--job-timeout", type=int, default=1500)
    parser.add_argument("--role", choices=["driver", "rank"], default="driver")
    parser.add_argument("--config", choices=CONFIGS)
    parser.add_argument("--report-dir")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error(f"--warmup and --steps must be at least 1. Received: --warmup {args.warmup} --steps {args.steps}.")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.role == "rank":
        run_rank(args)
        return 0
    for processes in [int(p) for p in args.processes.split(",")]:
        with tempfile.TemporaryDirectory(prefix="kdist-zero-") as report_dir:
            results = {config: run_job(args, config, processes, report_dir) for config in CONFIGS}
        line = summary(processes, results)
        line.update(size=args.size, steps=args.steps, warmup=args.warmup, commit=git_commit(),
                    environment=environment())
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
