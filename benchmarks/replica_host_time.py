"""The host (Python) time kdist's one-process engine spends per replica per step, and how many GPUs one process can feed.

One process driving N GPUs launches every replica's kernels from one Python thread,
one replica after another; PyTorch retired single-process multi-device DDP because
that per-replica Python work serialises under the GIL. This benchmark measures it on
the CPU, for the two models of `gpu_scaling.py` (the ResNet-style convnet and the
transformer block).

Method. The models keep every layer of `gpu_scaling.py`'s full size (so the same
number of ops per step) but their tensors are shrunk (8x8 images with 4 channels,
4 tokens of width 16, 2 samples per replica; `SIZES["tiny"]`), so the arithmetic is
negligible and a step's time is host time: Python, Keras, kdist and torch's dispatch
of each op. One torch thread, and each step is timed in CPU time of this process
(`time.process_time`), which other processes' load barely changes, as well as in wall
time. Configurations, timed side by side:

- `plain`: plain Keras, one step on one replica's batch (2 samples);
- `plain_double_batch`: the same on twice the batch. Its extra time bounds how much of
  `plain` is arithmetic (`compute_share_bound`): near 0 means the step is host-bound;
- `mirrored_N`: `kdist.MirroredStrategy(["cpu:0", ..., f"cpu:{N-1}"])` with a global
  batch of 2N, so every logical replica gets 2 samples (N = 2, 4, 8).

A least-squares line through the `mirrored_N` step times gives the host time per
replica-step (the slope, `host_ms_per_replica_step`) and the fixed host time per step
(the intercept: splitting the batch, combining gradients, one optimizer `apply`,
reconciling state). `kdist_added_ms_per_replica_step` is the slope minus `plain`:
what the engine adds to running Keras' own `train_step` once. From them, for a GPU
step of T ms per replica, one process keeps its GPUs busy while
`fixed + N * slope <= T`, so it feeds about `(T - fixed) / slope` GPUs
(`gpus_one_process_can_feed`, for T = 10, 30 and 100 ms).

What this leaves out: on GPUs each op's host cost is a kernel launch (a few µs, about
what torch's CPU dispatch of a tiny op costs), and replicas on devices other than
the first also copy the weights at step start (one flattened copy per dtype). Logical
CPU replicas copy nothing. `gpu_scaling.py`'s `mirrored/kdist_fp32` ratio on real GPUs
is the check of these estimates.

Each round times one `fit` of `--steps` steps per configuration, interleaved; the
step time of a round is the median of its steps' durations (a step callback's
timestamps), and the reported one the median over rounds. The estimates come from CPU
time; `from_wall_time` repeats them from wall time, which agrees on a quiet machine.

Usage:

    python benchmarks/replica_host_time.py           # full run, about 2 minutes on 2 cores
    python benchmarks/replica_host_time.py --quick   # smoke run, N = 2 and 4, seconds
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
from _workers import step_durations  # noqa: E402
from gpu_scaling import MODELS, SIZES, build_model, synthetic_data  # noqa: E402

import kdist  # noqa: E402  (before keras: kdist checks the backend)
import keras  # noqa: E402
import torch  # noqa: E402

REPLICA_COUNTS = (2, 4, 8)
QUICK_REPLICA_COUNTS = (2, 4)
# GPU step times (ms per replica-step) to state the feeding limit for.
GPU_STEP_MS = (10, 30, 100)


def build_configs(model_name, replica_counts):
    """Name -> `(model, global batch)`, every model starting from the same weights."""
    spec = SIZES["tiny"][model_name]
    batch = spec["per_device_batch"]
    configs = {}
    for name, devices, global_batch in (
        [("plain", None, batch), ("plain_double_batch", None, 2 * batch)]
        + [(f"mirrored_{n}", [f"cpu:{i}" for i in range(n)], n * batch) for n in replica_counts]
    ):
        keras.utils.set_random_seed(0)
        if devices is None:
            configs[name] = (build_model(keras, model_name, spec), global_batch)
            continue
        with kdist.MirroredStrategy(devices=devices).scope():
            configs[name] = (build_model(keras, model_name, spec), global_batch)
    return configs


def median_step_seconds(model, x, y, batch_size, num_warmup):
    """`(cpu, wall)`: the median CPU and wall seconds of the steps of one `fit` epoch after `num_warmup` steps."""
    cpu_ends, wall_ends = [], []

    def on_step_end(batch, logs):
        cpu_ends.append(time.process_time())
        wall_ends.append(time.perf_counter())

    # Collect now so a collection triggered by an earlier config is not billed here.
    gc.collect()
    timer = keras.callbacks.LambdaCallback(on_train_batch_end=on_step_end)
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    return tuple(statistics.median(step_durations(ends, num_warmup)) for ends in (cpu_ends, wall_ends))


def fit_line(points):
    """Least-squares `(intercept, slope)` of `[(x, y), ...]`."""
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope


def estimates(step_ms, replica_counts):
    """Host time per replica-step and per step, what kdist adds, and the GPUs one process feeds."""
    fixed, slope = fit_line([(n, step_ms[f"mirrored_{n}"]) for n in replica_counts])
    return {
        "host_ms_per_replica_step": round(slope, 3),
        "fixed_host_ms_per_step": round(fixed, 3),
        "kdist_added_ms_per_replica_step": round(slope - step_ms["plain"], 3),
        "line_fit_max_residual_ms": round(max(abs(fixed + slope * n - step_ms[f"mirrored_{n}"]) for n in replica_counts), 3),
        "gpus_one_process_can_feed": {f"{t}ms": round(max(0.0, (t - fixed) / slope), 1) for t in GPU_STEP_MS},
    }


def measure(model_name, replica_counts, num_steps, num_rounds, num_warmup):
    """One model's JSON line (without environment and commit)."""
    configs = build_configs(model_name, replica_counts)
    spec = SIZES["tiny"][model_name]
    largest = max(batch for _, batch in configs.values())
    x, y = synthetic_data(model_name, spec, largest * (num_steps + num_warmup))
    cpu_seconds, wall_seconds = {name: [] for name in configs}, {name: [] for name in configs}
    for name, (model, batch) in configs.items():  # builds, compiles the step functions, warms up
        median_step_seconds(model, x[: batch * 3], y[: batch * 3], batch, num_warmup=1)
    for _ in range(num_rounds):
        for name, (model, batch) in configs.items():
            samples = batch * (num_steps + num_warmup)
            cpu, wall = median_step_seconds(model, x[:samples], y[:samples], batch, num_warmup)
            cpu_seconds[name].append(cpu)
            wall_seconds[name].append(wall)
    step_ms = {name: 1000 * statistics.median(values) for name, values in cpu_seconds.items()}
    wall_ms = {name: 1000 * statistics.median(values) for name, values in wall_seconds.items()}
    plain = step_ms["plain"]
    return {
        "model": model_name,
        "spec": {key: list(v) if isinstance(v, tuple) else v for key, v in spec.items()},
        "num_variables": len(configs["plain"][0].variables),
        "step_cpu_ms": {name: round(value, 3) for name, value in step_ms.items()},
        "step_cpu_ms_by_round": {name: [round(1000 * s, 3) for s in v] for name, v in cpu_seconds.items()},
        **estimates(step_ms, replica_counts),
        # The same from wall time: it agrees with CPU time on a quiet machine and grows with other processes' load.
        "step_wall_ms": {name: round(value, 3) for name, value in wall_ms.items()},
        "from_wall_time": estimates(wall_ms, replica_counts),
        # Each mirrored_N step against N plain steps on the same shards: 1.0 = no cost beyond Keras' own.
        "ratio_vs_n_plain_steps": {f"mirrored_{n}": round(step_ms[f"mirrored_{n}"] / (n * plain), 3) for n in replica_counts},
        "compute_share_bound": round(max(0.0, step_ms["plain_double_batch"] / plain - 1), 3),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: N = 2 and 4, 2 rounds of 5 steps")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 7; 2 with --quick)")
    parser.add_argument("--steps", type=int, help="timed steps per round (default 20; 5 with --quick)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated (default %(default)s)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 7)
    args.steps = args.steps or (5 if args.quick else 20)
    args.models = [m for m in args.models.split(",") if m]
    if args.rounds < 1 or args.steps < 2 or not args.models or any(m not in MODELS for m in args.models):
        parser.error(
            f"--rounds must be >= 1, --steps >= 2, --models among {list(MODELS)}. Received: "
            f"--rounds={args.rounds} --steps={args.steps} --models={args.models}."
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    # Host time is one Python thread's; more torch threads would only add noise on tiny tensors.
    torch.set_num_threads(1)
    commit = git_commit()
    replica_counts = QUICK_REPLICA_COUNTS if args.quick else REPLICA_COUNTS
    for model_name in args.models:
        line = measure(model_name, replica_counts, args.steps, args.rounds, num_warmup=2)
        # Sampled after each model: the load it ran under.
        env = environment(torch_num_threads=torch.get_num_threads())
        line.update(rounds=args.rounds, steps_per_round=args.steps, environment=env, commit=commit)
        print(json.dumps({"benchmark": "replica_host_time", **line}), flush=True)


if __name__ == "__main__":
    main()
