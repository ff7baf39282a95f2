"""The same training under kdist on each Keras backend, with TensorFlow's own strategy as the peer.

One model and one data set train in every configuration: an MLP 784-256-256-10
(relu), Adam(1e-3), sparse categorical cross-entropy from logits, random
float32 inputs and integer labels from a fixed numpy seed, global batch 256
(128 per replica with two replicas), `fit(..., shuffle=False, verbose=0)`.

Configurations (two replicas are two logical CPU devices sharing the cores):

- `torch_kdist` (torch): `kdist.MirroredStrategy(["cpu:0", "cpu:1"])`, the
  baseline of every ratio;
- `tensorflow_kdist` (tensorflow): the same kdist call; kdist delegates to
  `tf.distribute.MirroredStrategy`;
- `jax_kdist` (jax): the same kdist call; kdist delegates to
  `keras.distribution.DataParallel`;
- `tensorflow_native` (tensorflow), the reference peer, no kdist: two logical
  CPUs set with `tf.config.set_logical_device_configuration`, then
  `tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])` used directly;
- `torch_plain`, `tensorflow_plain`, `jax_plain`: plain single-device Keras,
  no strategy, for context.

A Keras process can use only one backend, so every configuration runs in a
child process of its own: this script re-runs itself with `--child CONFIG`.
Each child creates its strategy before anything else (TensorFlow and JAX fix
their number of CPU devices at their first computation), builds and compiles
the model in the strategy's scope, warms up with one short `fit` (tracing and
compilation), then times `--rounds` fits of `--steps` steps each. A round's
rate is `(steps - 1)` divided by the time from the end of the fit's first step
to the return of `fit`: the steady state, without building the input pipeline
or the first step of each `fit`.

The children run one after the other in two passes, the configurations in
order and then in reverse order, so a drift of the machine's load hits the
first and the last configurations alike. Each configuration's rounds from both
passes are pooled and their median reported.

Threads: the script sets no thread count. Every child inherits the parent's
environment unchanged (`OMP_NUM_THREADS`, `TF_NUM_INTRAOP_THREADS`,
`XLA_FLAGS`, ...: whatever the caller set, the same for every configuration;
if unset, each library uses its default, which is every core), plus
`KERAS_BACKEND` and `TF_CPP_MIN_LOG_LEVEL=2` (quieter logs). The values are in
`environment.thread_variables`; each line's `intra_op_threads` is what the
library reports (torch: `torch.get_num_threads()`; TensorFlow:
`tf.config.threading.get_intra_op_parallelism_threads()`, where 0 means its
default; JAX: null, it has no such setting).

Output, one JSON line per configuration, then one summary line:

- `{"benchmark": "backends", "what": "steps_per_sec", "config": ...,
  "backend": ..., "implementation": "kdist" | "tf.distribute" | "plain",
  "num_replicas": 2 | 1, "steps_per_sec": ..., "steps_per_sec_by_round":
  [...], "ratio_to_torch_kdist": ..., ...}`: `steps_per_sec` is the median of
  `steps_per_sec_by_round` (the first pass's rounds, then the second's); one
  step is one global batch of 256. `ratio_to_torch_kdist` is this
  configuration's median over `torch_kdist`'s (null when `--only` left
  `torch_kdist` out): above 1.0 this configuration trains faster than kdist on
  torch, below 1.0 slower. A wide spread in `steps_per_sec_by_round`, or a
  first and second pass that disagree, means the machine's load changed; rerun.
- `{"benchmark": "backends", "what": "summary", "ratios_to_torch_kdist":
  {config: ratio}, "kdist_tensorflow_vs_tf_distribute": ...,
  "kdist_vs_plain": {backend: ratio}, ...}`:
  `kdist_tensorflow_vs_tf_distribute` is `tensorflow_kdist` over
  `tensorflow_native`. TensorFlow's own MirroredStrategy is the reference peer
  of the TensorFlow column: kdist on TensorFlow delegates to it, so the ratio
  should be about 1.0; clearly below means kdist's layer costs time per step.
  `kdist_vs_plain` is each backend's `*_kdist` over its `*_plain`: what two
  logical CPU replicas cost or gain against one device on that backend (on a
  CPU the replicas share the same cores, so above 1.0 only where the backend
  runs them in parallel and one device left cores idle).

Noise: the configurations run at different times in different processes, so
there are no paired per-round ratios; check `load_average_1min` (the script's
own child accounts for about 1-2 of it). With other processes busy on a
2-core machine, torch (both cores for every op) slows down by up to 10x, and
TensorFlow's step rates jump between levels about a factor of 2 apart;
rerun on an idle machine before reading anything into a ratio.

Every line also carries `rounds` (per pass), `steps_per_round`, `passes`,
`environment` (versions, core count, thread variables and the 1-minute load
average sampled after the last child finished) and `commit`.

Usage:

    python benchmarks/backends.py            # full run, about 4 minutes on 2 cores
    python benchmarks/backends.py --quick    # smoke run, about 2 minutes (14 child start-ups)
    python benchmarks/backends.py --rounds 5 --steps 200 --only torch_kdist,tensorflow_kdist

kdist must be importable (`pip install -e .`, or `PYTHONPATH=.` from the
repository root), with torch, TensorFlow and JAX installed.
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time

from _report import environment, git_commit  # benchmarks/ is on sys.path

INPUT_FEATURES = 784
HIDDEN_UNITS = 256
NUM_CLASSES = 10
LEARNING_RATE = 1e-3
# 128 samples per replica with two replicas; even, as JAX's data parallelism needs.
GLOBAL_BATCH_SIZE = 256
DATA_SEED = 0
WEIGHTS_SEED = 0
# Steps of the untimed first fit: the first step traces (TensorFlow) or compiles
# (JAX); a few more let caches and thread pools settle.
WARMUP_STEPS = 5
# Configurations run in this many passes: in order, then in reverse order.
NUM_PASSES = 2
# Time a child may take besides its steps: importing its backend and kdist, and
# tracing or compiling, on a loaded 2-core machine (about 10 s when idle).
CHILD_STARTUP_SECONDS = 240
# The slowest rate a healthy child is allowed before it counts as hung; every
# configuration runs at tens of steps per second on 2 cores.
SLOWEST_STEPS_PER_SEC = 2
# The child's last stderr lines shown when it fails.
STDERR_TAIL_LINES = 40
# The line on a child's stdout that carries its measurements.
CHILD_PREFIX = "CHILD "
# Environment variables that set the libraries' thread counts, reported as passed.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TF_NUM_INTRAOP_THREADS",
    "TF_NUM_INTEROP_THREADS",
    "XLA_FLAGS",
)
REPOSITORY_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration: a backend and how the model is distributed on it."""

    name: str
    backend: str
    implementation: str  # "kdist", "tf.distribute" or "plain"


CONFIGS = {
    config.name: config
    for config in (
        Config("torch_kdist", "torch", "kdist"),
        Config("tensorflow_kdist", "tensorflow", "kdist"),
        Config("jax_kdist", "jax", "kdist"),
        Config("tensorflow_native", "tensorflow", "tf.distribute"),
        Config("torch_plain", "torch", "plain"),
        Config("tensorflow_plain", "tensorflow", "plain"),
        Config("jax_plain", "jax", "plain"),
    )
}
BASELINE = "torch_kdist"
REPLICA_DEVICES = ["cpu:0", "cpu:1"]


class ChildFailedError(RuntimeError):
    """A configuration's child process exited non-zero, timed out or printed no result."""


# ---------------------------------------------------------------- child process
# Keras, kdist and TensorFlow are imported inside these functions: the parent
# never trains, and in a child the strategy must exist before Keras computes.


def create_strategy(config):
    """The configuration's strategy, or None for plain Keras; call before any computation."""
    if config.implementation == "kdist":
        import kdist

        return kdist.MirroredStrategy(devices=REPLICA_DEVICES)
    if config.implementation == "tf.distribute":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * len(REPLICA_DEVICES)
        )
        return tf.distribute.MirroredStrategy([f"/{device}" for device in REPLICA_DEVICES])
    return None


def intra_op_threads(backend):
    """The intra-op thread count the backend reports, or None where it has no such setting."""
    if backend == "torch":
        import torch

        return torch.get_num_threads()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.config.threading.get_intra_op_parallelism_threads()
    return None


def library_version(backend):
    """The version of the backend's library (torch, tensorflow or jax)."""
    module = __import__(backend)
    return module.__version__


def build_model(keras):
    """The compiled MLP, in whatever strategy scope is active."""
    model = keras.Sequential(
        [
            keras.Input((INPUT_FEATURES,)),
            keras.layers.Dense(HIDDEN_UNITS, activation="relu"),
            keras.layers.Dense(HIDDEN_UNITS, activation="relu"),
            keras.layers.Dense(NUM_CLASSES),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def make_data(num_samples):
    """Random inputs and labels, the same in every configuration."""
    import numpy as np

    rng = np.random.default_rng(DATA_SEED)
    x = rng.standard_normal((num_samples, INPUT_FEATURES), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, size=num_samples, dtype=np.int32)
    return x, y


def timed_fit(keras, model, x, y, num_steps):
    """Steps per second of one `fit` epoch of `num_steps` steps, after its first step."""

    class FirstStepEnd(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.time = None

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.time = time.perf_counter()

    first_step_end = FirstStepEnd()
    # Collect now so garbage of the previous round is not billed to this one.
    gc.collect()
    fit_options = dict(batch_size=GLOBAL_BATCH_SIZE, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, callbacks=[first_step_end], **fit_options)
    # `fit` returns once every step has finished (JAX included: it syncs the state back).
    seconds = time.perf_counter() - first_step_end.time
    return (num_steps - 1) / seconds


def run_child(config, num_steps, num_rounds):
    """Trains `config`'s model and prints its rates as one `CHILD {...}` line."""
    # Ordering: the strategy first, before Keras' first computation (seeding included).
    strategy = create_strategy(config)
    import keras

    keras.utils.set_random_seed(WEIGHTS_SEED)
    x, y = make_data(num_steps * GLOBAL_BATCH_SIZE)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = build_model(keras)
    warmup_samples = min(WARMUP_STEPS, num_steps) * GLOBAL_BATCH_SIZE
    warmup_data = (x[:warmup_samples], y[:warmup_samples])
    model.fit(*warmup_data, batch_size=GLOBAL_BATCH_SIZE, epochs=1, shuffle=False, verbose=0)
    rates = [timed_fit(keras, model, x, y, num_steps) for _ in range(num_rounds)]
    result = {
        "config": config.name,
        "num_replicas": 1 if strategy is None else strategy.num_replicas_in_sync,
        "steps_per_sec_by_round": rates,
        "intra_op_threads": intra_op_threads(config.backend),
        "library_version": library_version(config.backend),
    }
    print(CHILD_PREFIX + json.dumps(result), flush=True)


# ---------------------------------------------------------------- parent process


def child_environment(backend):
    """The parent's environment, the same for every config except `KERAS_BACKEND`."""
    env = dict(os.environ)
    env["KERAS_BACKEND"] = backend
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = os.pathsep.join(
        path for path in (REPOSITORY_ROOT, env.get("PYTHONPATH")) if path
    )
    return env


def stderr_tail(stderr):
    """The last lines of a child's stderr, for the failure message."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    lines = (stderr or "").rstrip().splitlines()
    return "\n".join(lines[-STDERR_TAIL_LINES:]) or "(empty)"


def run_config(config, num_steps, num_rounds):
    """Runs one child for `config` and returns its parsed result.

    Raises:
        ChildFailedError: the child failed, timed out or printed no result.
    """
    script = os.path.abspath(__file__)
    command = [sys.executable, script, "--child", config.name]
    command += ["--steps", str(num_steps), "--rounds", str(num_rounds)]
    total_steps = WARMUP_STEPS + num_rounds * num_steps
    timeout = CHILD_STARTUP_SECONDS + total_steps / SLOWEST_STEPS_PER_SEC
    try:
        completed = subprocess.run(
            command,
            env=child_environment(config.backend),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as error:
        raise ChildFailedError(
            f"Config {config.name} did not finish within its deadline of {timeout:.0f} s "
            f"and was killed. Last lines of its stderr:\n{stderr_tail(error.stderr)}"
        ) from None
    if completed.returncode != 0:
        raise ChildFailedError(
            f"Config {config.name} failed with exit code {completed.returncode}. "
            f"Last lines of its stderr:\n{stderr_tail(completed.stderr)}"
        )
    for line in completed.stdout.splitlines():
        if line.startswith(CHILD_PREFIX):
            return json.loads(line[len(CHILD_PREFIX) :])
    raise ChildFailedError(
        f"Config {config.name} exited without printing a '{CHILD_PREFIX.strip()}' line. "
        f"Last lines of its stderr:\n{stderr_tail(completed.stderr)}"
    )


def ratio(numerator, denominator):
    """`numerator / denominator` rounded, or None when either config did not run."""
    if numerator is None or denominator is None:
        return None
    return round(numerator / denominator, 3)


def run_parent(configs, num_steps, num_rounds):
    """Runs every config in both passes and prints the JSON lines."""
    results = {config.name: None for config in configs}
    pass_orders = (configs, tuple(reversed(configs)))[:NUM_PASSES]
    for pass_index, order in enumerate(pass_orders):
        for config in order:
            progress = f"backends.py: pass {pass_index + 1}/{NUM_PASSES}: {config.name}"
            print(progress, file=sys.stderr, flush=True)
            child = run_config(config, num_steps, num_rounds)
            if results[config.name] is None:
                results[config.name] = child
            else:
                results[config.name]["steps_per_sec_by_round"] += child["steps_per_sec_by_round"]

    medians = {
        name: statistics.median(result["steps_per_sec_by_round"])
        for name, result in results.items()
    }
    versions = {
        CONFIGS[name].backend: result["library_version"] for name, result in results.items()
    }
    # The parent only reads versions; torch keeps it from importing TensorFlow for that.
    os.environ.setdefault("KERAS_BACKEND", "torch")
    env = environment(
        **{name: version for name, version in versions.items() if name != "torch"},
        thread_variables={name: os.environ.get(name) for name in THREAD_VARIABLES},
    )
    commit = git_commit()
    common = {
        "rounds": num_rounds,
        "steps_per_round": num_steps,
        "passes": NUM_PASSES,
        "environment": env,
        "commit": commit,
    }
    baseline = medians.get(BASELINE)
    for config in configs:
        result = results[config.name]
        line = {
            "benchmark": "backends",
            "what": "steps_per_sec",
            "config": config.name,
            "backend": config.backend,
            "implementation": config.implementation,
            "num_replicas": result["num_replicas"],
            "steps_per_sec": round(medians[config.name], 2),
            "steps_per_sec_by_round": [
                round(value, 2) for value in result["steps_per_sec_by_round"]
            ],
            "ratio_to_torch_kdist": ratio(medians[config.name], baseline),
            "intra_op_threads": result["intra_op_threads"],
            **common,
        }
        print(json.dumps(line), flush=True)
    summary = {
        "benchmark": "backends",
        "what": "summary",
        "ratios_to_torch_kdist": {
            config.name: ratio(medians[config.name], baseline) for config in configs
        },
        "kdist_tensorflow_vs_tf_distribute": ratio(
            medians.get("tensorflow_kdist"), medians.get("tensorflow_native")
        ),
        "kdist_vs_plain": {
            backend: ratio(medians.get(f"{backend}_kdist"), medians.get(f"{backend}_plain"))
            for backend in ("torch", "tensorflow", "jax")
        },
        **common,
    }
    print(json.dumps(summary), flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 10 steps, 1 round per pass"
    )
    parser.add_argument(
        "--rounds", type=int, help="timed fits per config and pass (default 3; 1 with --quick)"
    )
    parser.add_argument(
        "--steps", type=int, help="steps per timed fit, at least 2 (default 150; 10 with --quick)"
    )
    parser.add_argument(
        "--only",
        metavar="CONFIG[,CONFIG]",
        help=f"run only these configs (default all: {','.join(CONFIGS)})",
    )
    # Internal: the parent runs each config as `backends.py --child CONFIG`.
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.steps is None:
        args.steps = 10 if args.quick else 150
    if args.rounds < 1 or args.steps < 2:
        parser.error(
            "--rounds must be at least 1 and --steps at least 2 (a rate is timed from the end "
            f"of a fit's first step). Received: --rounds={args.rounds} --steps={args.steps}."
        )
    if args.child is not None and args.child not in CONFIGS:
        parser.error(
            f"Unknown config. Received: --child={args.child!r}. Expected one of: "
            f"{', '.join(CONFIGS)}."
        )
    names = list(CONFIGS) if args.only is None else [
        name.strip() for name in args.only.split(",") if name.strip()
    ]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown or not names:
        parser.error(
            f"--only takes config names separated by commas. Received: --only={args.only!r} "
            f"(unknown: {', '.join(unknown) or 'no names'}). Expected some of: "
            f"{', '.join(CONFIGS)}."
        )
    # In the order of CONFIGS, each once, whatever order --only named them in.
    args.configs = tuple(config for name, config in CONFIGS.items() if name in names)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.child is not None:
        run_child(CONFIGS[args.child], args.steps, args.rounds)
        return 0
    try:
        run_parent(args.configs, args.steps, args.rounds)
    except ChildFailedError as error:
        print(f"backends.py: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
