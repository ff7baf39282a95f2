"""What `ClusterCoordinator` adds per scheduled step, and what packing steps into closures saves.

One invocation starts its own cluster (1 `kdist server --job ps` and 4
`kdist server --job worker` processes on loopback), drives it from this
process as the chief, and prints one JSON line per result:

- `coordinator_empty_fn`, per worker count (1, 2, 4): closures per second of
  an empty module-level function (pickled by reference) scheduled K times and
  joined, against calling it K times in a loop here: the dispatch cost alone.
- `coordinator_model_fn`, per worker count: an empty function that takes the
  model as its argument. A closure that references a model starts with one
  pull of its variables (one request per ps): dispatch plus that pull.
- `coordinator_mlp_step`, per worker count: steps per second of one training
  step of an MLP 64-64-64-10 (Adam on the ps, batch 32 from a per-worker
  dataset; one pull and one push per step) scheduled K times, against the
  same step function run here on a plain Keras model and optimizer.
- `coordinator_fit`, per worker count (1, 2) and `steps_per_execution` (1, 10):
  `model.fit` on the chief (arrays; every closure carries its batches) against
  plain Keras `fit` of the same model here.
- `coordinator_summary`: dispatch cost per training step at 10 steps per
  closure, two ways, each against the 0.1 ms target: an empty closure / 10
  (dispatch alone), and from the 1-vs-10 packing difference of `fit` (all
  that a `fit` closure costs: dispatch, carried batches, metric merge,
  callbacks). For information, `fit`'s time per step minus plain Keras': the
  per-step pull and push to the ps, which packing does not remove.

`overhead_ms_per_step = (1 / kdist_rate - 1 / local_rate) * 1000`. With several
workers `kdist_rate` is the whole cluster's rate, so the overhead is per step
of wall time. Every process uses one torch thread; the local baselines run in
this process while the workers are idle. Every wait has a deadline; on any
failure, and at the end, every server process is killed.

Usage:

    PYTHONPATH=. python benchmarks/coordinator_overhead.py           # full run, about 2.5 minutes on 2 cores
    PYTHONPATH=. python benchmarks/coordinator_overhead.py --quick   # smoke run, about 30 s
"""

import os
import secrets

# Keras reads the backend once, at import time.
os.environ.setdefault("KERAS_BACKEND", "torch")
# Every kdist service requires the cluster secret: the processes of this run share
# one, as the tasks of one `kdist launch` job do.
os.environ.setdefault("KDIST_SECRET", secrets.token_urlsafe(32))
# This process forks the server processes after gRPC is loaded; gRPC's fork
# handlers can abort such a child before it execs (grpc/grpc#43055).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import argparse  # noqa: E402
import atexit  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from _report import environment, git_commit  # noqa: E402  (benchmarks/ is on sys.path)

FEATURES, HIDDEN, CLASSES = 64, 64, 10
BATCH_SIZE = 32
POOL_BATCHES = 64  # random batches each data source cycles through
NUM_PS = 1
WORKER_COUNTS = (1, 2, 4)
FIT_WORKER_COUNTS = (1, 2)
PACKED_STEPS = 10
DISPATCH_TARGET_MS = 0.1  # per training step, at PACKED_STEPS steps per closure
MODEL_DESCRIPTION = (f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES} relu, Adam(1e-3) (on the ps for kdist), "
                     f"batch {BATCH_SIZE}, {NUM_PS} ps")

# `open_sessions`: each worker's first closure is held this long, so that every idle
# dispatcher takes one; rounds of that until every worker has run one.
SESSION_HOLD_SECONDS = 0.3
SESSION_ROUNDS = 10

# Deadlines. A miss kills every server process and fails the benchmark.
STARTUP_SECONDS = 180.0
PHASE_SECONDS = 300.0
SERVING_MARKER = "serving"


# ----- run on the workers (module-level: pickled by reference) -------------------------
def empty_function():
    """The scheduled no-op: what dispatch alone costs."""
    return None


def model_function(model):
    """A no-op that references the model: the worker pulls its variables first."""
    return None


def hold_and_name(iterator, seconds):
    """Keeps this worker busy for `seconds` and returns its process id (see `open_sessions`).

    `iterator` is not read: passing it makes the closure reference a resource.
    """
    time.sleep(seconds)
    return os.getpid()


def batches(input_context=None):
    """An endless stream of random (x, y) batches; a worker's dataset_fn and the local source."""
    import numpy as np

    seed = 0 if input_context is None else 1 + input_context.input_pipeline_id
    rng = np.random.default_rng(seed)
    pool = [(rng.standard_normal((BATCH_SIZE, FEATURES), dtype=np.float32),
             rng.integers(0, CLASSES, size=BATCH_SIZE)) for _ in range(POOL_BATCHES)]
    while True:
        yield from pool


def replica_step(model, optimizer, batch):
    """One training step: forward, loss, backward, `optimizer.apply` (a push to the ps on workers)."""
    import keras
    import torch

    x, y = (torch.as_tensor(item) for item in batch)
    logits = model(x, training=True)
    loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
    model.zero_grad()
    loss.backward()
    variables = model.trainable_variables
    with torch.no_grad():
        optimizer.apply([variable.value.grad for variable in variables], variables)
    return loss.detach()


def scheduled_step(strategy, model, optimizer, iterator):
    """`replica_step` as a scheduled function runs it (TensorFlow's `worker_fn`)."""
    return strategy.run(replica_step, args=(model, optimizer, next(iterator)))


def build_mlp(name, steps_per_execution=1):
    import keras

    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(HIDDEN, activation="relu"),
        keras.layers.Dense(HIDDEN, activation="relu"),
        keras.layers.Dense(CLASSES),
    ], name=name)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    return model


# ----- the cluster's processes ---------------------------------------------------------
class BenchmarkError(RuntimeError):
    """A server process failed or a deadline passed; every server process has been killed."""


class Servers:
    """One `kdist server` process per ps and worker task; `close()` kills them all. Not thread-safe."""

    def __init__(self, num_workers):
        from kdist.launch.ports import free_ports

        ports = free_ports(1 + num_workers + NUM_PS)
        self.spec = {
            "chief": [f"127.0.0.1:{ports[0]}"],
            "worker": [f"127.0.0.1:{port}" for port in ports[1:1 + num_workers]],
            "ps": [f"127.0.0.1:{port}" for port in ports[1 + num_workers:]],
        }
        self._directory = tempfile.TemporaryDirectory(prefix="coordinator_overhead-")
        cluster_file = os.path.join(self._directory.name, "cluster.json")
        with open(cluster_file, "w") as handle:
            json.dump(self.spec, handle)
        here = os.path.dirname(os.path.abspath(__file__))
        # Workers import this module (benchmarks/) to resolve the functions sent by reference.
        path = [os.path.dirname(here), here] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        env = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
        env.update(KERAS_BACKEND="torch", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(path))
        self._processes = {}
        try:
            self._start(cluster_file, num_workers, env)
        except BaseException:
            self.close()
            raise

    def _start(self, cluster_file, num_workers, env):
        from kdist.launch.child import make_preexec

        for job, count in (("ps", NUM_PS), ("worker", num_workers)):
            for index in range(count):
                name = f"{job}-{index}"
                # preexec: SIGKILLed when this process dies, however it dies.
                process = subprocess.Popen(
                    [sys.executable, "-m", "kdist", "server", "--job", job, "--index", str(index),
                     "--cluster", cluster_file, "--grace", "1"],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, preexec_fn=make_preexec())
                output, ready = collections.deque(maxlen=200), threading.Event()
                thread = threading.Thread(target=self._drain, args=(process, output, ready), daemon=True)
                thread.start()
                self._processes[name] = (process, output, ready)
        until = time.monotonic() + STARTUP_SECONDS
        for name, (process, output, ready) in self._processes.items():
            if not ready.wait(max(0.0, until - time.monotonic())) or not any(SERVING_MARKER in line for line in output):
                self.fail(f"{name} did not start serving within {STARTUP_SECONDS:.0f} s")

    @staticmethod
    def _drain(process, output, ready):
        """Keeps the child's pipe empty; `ready` is set once it serves, or when it exits."""
        for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            output.append(line)
            if SERVING_MARKER in line:
                ready.set()
        ready.set()

    def check_alive(self):
        for name, (process, _, _) in self._processes.items():
            if process.poll() is not None:
                self.fail(f"{name} exited with code {process.returncode}")

    def fail(self, reason):
        outputs = "\n".join(f"[{name}] {line}" for name, (_, output, _) in self._processes.items() for line in output)
        self.close()
        raise BenchmarkError(f"{reason}. Server output:\n{outputs}")

    def close(self):
        for process, _, _ in self._processes.values():
            if process.poll() is None:
                process.kill()
        for process, _, _ in self._processes.values():
            process.wait(timeout=30)
            process.stdout.close()
        self._processes = {}
        self._directory.cleanup()


@contextlib.contextmanager
def deadline(seconds, what):
    """Raises BenchmarkError in the main thread if the block runs longer than `seconds`."""

    def expire(signum, frame):
        raise BenchmarkError(f"{what} did not finish within {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ----- timing ---------------------------------------------------------------------------
def open_sessions(coordinator, num_workers, remote):
    """Has every worker run a closure before timing starts (warm-up).

    A worker's first closure opens the coordinator's session there (a Define
    round trip) and defines the per-worker iterator it references; neither
    belongs in the timed rounds. The iterator defines no model, so the empty
    closures that follow still measure dispatch alone.
    """
    iterator = iter(coordinator.create_per_worker_dataset(remote.batches))
    seen = set()
    for _ in range(SESSION_ROUNDS):
        values = [coordinator.schedule(remote.hold_and_name, args=(iterator, SESSION_HOLD_SECONDS))
                  for _ in range(num_workers)]
        seen.update(value.get(timeout=PHASE_SECONDS) for value in values)
        if len(seen) == num_workers:
            return
    raise BenchmarkError(f"Only {len(seen)} of {num_workers} workers ran a closure in {SESSION_ROUNDS} rounds.")


def time_scheduled(coordinator, function, args, count):
    """Seconds to schedule `count` closures and join them."""
    start = time.perf_counter()
    values = [coordinator.schedule(function, args=args) for _ in range(count)]
    for value in values:
        value.get(timeout=PHASE_SECONDS)
    coordinator.join()
    return time.perf_counter() - start


def time_loop(function, args, count):
    start = time.perf_counter()
    for _ in range(count):
        function(*args)
    return time.perf_counter() - start


def time_fit(model, x, y, steps):
    start = time.perf_counter()
    model.fit(x, y, batch_size=BATCH_SIZE, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)
    return time.perf_counter() - start


def interleaved(rounds, configs):
    """`{name: [seconds per round]}`; the order alternates per round so load drift hits all alike."""
    seconds = {name: [] for name in configs}
    for round_index in range(rounds):
        order = list(configs) if round_index % 2 == 0 else list(reversed(configs))
        for name in order:
            seconds[name].append(configs[name]())
    return seconds


def rate_line(what, num_workers, count, seconds, kdist_name, local_name, unit, coordinator, with_ratio=True):
    """Medians over rounds; `ratio` = kdist rate / local rate (left out where local is a no-op loop)."""
    kdist_rates = [count / s for s in seconds[kdist_name]]
    local_rates = [count / s for s in seconds[local_name]]
    kdist_rate, local_rate = statistics.median(kdist_rates), statistics.median(local_rates)
    ratios = {}
    if with_ratio:
        ratios = {"ratio": round(kdist_rate / local_rate, 4),
                  "paired_ratio_median": round(statistics.median(k / b for k, b in zip(kdist_rates, local_rates)), 4)}
    return {
        "what": what,
        "num_workers": num_workers,
        f"kdist_{unit}_per_sec": round(kdist_rate, 1),
        f"local_{unit}_per_sec": round(local_rate, 1),
        **ratios,
        "overhead_ms_per_step": round((1 / kdist_rate - 1 / local_rate) * 1000, 4),
        "kdist_ms_per_closure": round(1000 / kdist_rate, 4),
        f"kdist_{unit}_per_sec_by_round": [round(r, 1) for r in kdist_rates],
        f"local_{unit}_per_sec_by_round": [round(r, 1) for r in local_rates],
        "count_per_round": count,
        "rounds": len(kdist_rates),
        # Non-zero means a worker was lost or a session redefined while timing: rerun.
        "closures_retried_so_far": coordinator.stats["closures_retried"],
    }


# ----- one worker count -------------------------------------------------------------------
def measure_workers(servers, num_workers, args, remote):
    """Every line for a chief that sees the first `num_workers` workers (a fresh strategy and coordinator)."""
    import keras
    import numpy as np

    import kdist
    from kdist.cluster import SimpleClusterResolver

    spec = dict(servers.spec, worker=servers.spec["worker"][:num_workers])
    strategy = kdist.ParameterServerStrategy(SimpleClusterResolver(spec, task_type="chief", task_id=0))
    coordinator = kdist.coordinator.ClusterCoordinator(strategy)
    lines = []
    try:
        # Empty closures first: the workers' session holds no model yet.
        with deadline(PHASE_SECONDS, f"empty closures, {num_workers} workers"):
            open_sessions(coordinator, num_workers, remote)
            for warmup in (5 * num_workers, args.empty_count):
                time_scheduled(coordinator, remote.empty_function, (), warmup)
            seconds = interleaved(args.rounds, {
                "kdist": lambda: time_scheduled(coordinator, remote.empty_function, (), args.empty_count),
                "local": lambda: time_loop(remote.empty_function, (), args.empty_count),
            })
        lines.append(rate_line("coordinator_empty_fn", num_workers, args.empty_count, seconds, "kdist", "local",
                               "closures", coordinator, with_ratio=False))
        servers.check_alive()

        with deadline(PHASE_SECONDS, f"scheduled MLP steps, {num_workers} workers"):
            with strategy.scope():
                model = build_mlp("mlp_scheduled")
                optimizer = keras.optimizers.Adam(1e-3)
            iterator = iter(coordinator.create_per_worker_dataset(remote.batches))
            step_args = (strategy, model, optimizer, iterator)
            local_model, local_optimizer = build_mlp("mlp_local"), keras.optimizers.Adam(1e-3)
            local_batches = remote.batches()

            def local_steps():
                start = time.perf_counter()
                for _ in range(args.step_count):
                    remote.replica_step(local_model, local_optimizer, next(local_batches))
                return time.perf_counter() - start

            for warmup in (5 * num_workers, args.step_count):
                time_scheduled(coordinator, remote.scheduled_step, step_args, warmup)
            local_steps()
            seconds = interleaved(args.rounds, {
                "kdist": lambda: time_scheduled(coordinator, remote.scheduled_step, step_args, args.step_count),
                "local": local_steps,
            })
        lines.append({**rate_line("coordinator_mlp_step", num_workers, args.step_count, seconds, "kdist", "local",
                                  "steps", coordinator), "model": MODEL_DESCRIPTION})
        servers.check_alive()

        # A closure that carries the model: the worker pulls its variables first.
        with deadline(PHASE_SECONDS, f"closures reading a model, {num_workers} workers"):
            time_scheduled(coordinator, remote.model_function, (model,), args.empty_count)
            seconds = interleaved(args.rounds, {
                "kdist": lambda: time_scheduled(coordinator, remote.model_function, (model,), args.empty_count),
                "local": lambda: time_loop(remote.model_function, (local_model,), args.empty_count),
            })
        lines.append(rate_line("coordinator_model_fn", num_workers, args.empty_count, seconds,
                               "kdist", "local", "closures", coordinator, with_ratio=False))
        servers.check_alive()

        if num_workers in FIT_WORKER_COUNTS:
            with deadline(PHASE_SECONDS, f"fit, {num_workers} workers"):
                rng = np.random.default_rng(7)
                x = rng.standard_normal((args.fit_steps * BATCH_SIZE, FEATURES), dtype=np.float32)
                y = rng.integers(0, CLASSES, size=len(x))
                with strategy.scope():
                    models = {pack: build_mlp(f"mlp_fit_{pack}", steps_per_execution=pack)
                              for pack in (1, PACKED_STEPS)}
                local_fit_model = build_mlp("mlp_fit_local")
                for fit_model in (*models.values(), local_fit_model):
                    for _ in range(2):  # defines the model on every worker, builds the train functions
                        time_fit(fit_model, x, y, 2 * PACKED_STEPS * num_workers)
                seconds = interleaved(args.rounds, {
                    "local": lambda: time_fit(local_fit_model, x, y, args.fit_steps),
                    **{f"kdist_{pack}": (lambda m=m: time_fit(m, x, y, args.fit_steps)) for pack, m in models.items()},
                })
            for pack in models:
                line = rate_line("coordinator_fit", num_workers, args.fit_steps, seconds, f"kdist_{pack}", "local",
                                 "steps", coordinator)
                line.pop("kdist_ms_per_closure")
                lines.append({**line, "steps_per_execution": pack,
                              "kdist_ms_per_step": round(1000 / line["kdist_steps_per_sec"], 4),
                              "local_ms_per_step": round(1000 / line["local_steps_per_sec"], 4),
                              "model": MODEL_DESCRIPTION})
            servers.check_alive()
    finally:
        coordinator.shutdown()
    return lines


def summary(lines):
    def find(what, num_workers, pack=None):
        for line in lines:
            if line["what"] == what and line["num_workers"] == num_workers and line.get("steps_per_execution") == pack:
                return line
        return None

    targets, per_workers = [], {}
    for num_workers in FIT_WORKER_COUNTS:
        empty = find("coordinator_empty_fn", num_workers)
        with_model = find("coordinator_model_fn", num_workers)
        fit_1 = find("coordinator_fit", num_workers, 1)
        fit_10 = find("coordinator_fit", num_workers, PACKED_STEPS)
        from_empty = empty["kdist_ms_per_closure"] / PACKED_STEPS
        from_fit = fit_10["kdist_ms_per_step"] - fit_10["local_ms_per_step"]
        # Per-step time t(p) = c + d / p with d the cost of one closure: d / 10 = (t(1) - t(10)) / 9.
        # Taken per round (the two fits ran back to back) and the median of those, so
        # a load change between rounds does not enter the difference.
        from_packing = statistics.median(
            (1000 / rate_1 - 1000 / rate_10) / (PACKED_STEPS - 1)
            for rate_1, rate_10 in zip(fit_1["kdist_steps_per_sec_by_round"], fit_10["kdist_steps_per_sec_by_round"]))
        from_packing_medians = (fit_1["kdist_ms_per_step"] - fit_10["kdist_ms_per_step"]) / (PACKED_STEPS - 1)
        per_workers[num_workers] = {
            "empty_closure_ms": empty["kdist_ms_per_closure"],
            "model_closure_ms": with_model["kdist_ms_per_closure"],
            "dispatch_ms_per_step_at_10_from_empty_closure": round(from_empty, 4),
            "dispatch_ms_per_step_at_10_from_model_closure":
                round(with_model["kdist_ms_per_closure"] / PACKED_STEPS, 4),
            "dispatch_ms_per_step_at_10_from_packing": round(from_packing, 4),
            "dispatch_ms_per_step_at_10_from_packing_of_medians": round(from_packing_medians, 4),
            # Not dispatch: every step's pull and push to the ps, which packing cannot remove.
            "fit_minus_local_ms_per_step_at_10": round(from_fit, 4),
            "fit_ms_per_step": {"local": fit_10["local_ms_per_step"], "spe_1": fit_1["kdist_ms_per_step"],
                                f"spe_{PACKED_STEPS}": fit_10["kdist_ms_per_step"]},
        }
        for name, value in (("from_empty_closure", from_empty), ("from_packing", from_packing)):
            targets.append({"name": f"dispatch_ms_per_step_at_10_{name}_{num_workers}_workers",
                            "value": round(value, 4), "target": f"<= {DISPATCH_TARGET_MS}",
                            "target_met": value <= DISPATCH_TARGET_MS})
    return {
        "what": "coordinator_summary",
        "all_targets_met": all(target["target_met"] for target in targets),
        "targets": targets,
        "by_workers": per_workers,
        "overhead_ms_per_step": {
            what: {line["num_workers"]: line["overhead_ms_per_step"] for line in lines if line["what"] == what}
            for what in ("coordinator_empty_fn", "coordinator_model_fn", "coordinator_mlp_step")
        },
    }


# ----- main -------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, under a minute")
    parser.add_argument("--rounds", type=int, help="timed rounds per measurement (default 7; 2 with --quick)")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 7
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1. Received: --rounds={args.rounds}.")
    args.empty_count = 100 if args.quick else 400
    args.step_count = 40 if args.quick else 200
    args.fit_steps = 40 if args.quick else 400
    return args


def main(argv=None):
    args = parse_args(argv)
    import torch

    import kdist  # noqa: F401

    torch.set_num_threads(1)
    # The functions scheduled on workers, from this file imported as a module (run as
    # a script, its functions belong to __main__ and cloudpickle would send them by value).
    remote = importlib.import_module(os.path.splitext(os.path.basename(__file__))[0])
    commit = git_commit()

    def emit(line):
        print(json.dumps({"benchmark": "coordinator_overhead", **line,
                          "environment": environment(torch_threads_per_process=1, transport="grpc loopback",
                                                     num_ps=NUM_PS),
                          "commit": commit}), flush=True)

    servers = Servers(max(WORKER_COUNTS))
    atexit.register(servers.close)
    # SIGTERM runs atexit too, so no server outlives a stopped benchmark.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    lines = []
    try:
        for num_workers in WORKER_COUNTS:
            for line in measure_workers(servers, num_workers, args, remote):
                emit(line)
                lines.append(line)
    finally:
        servers.close()
        atexit.unregister(servers.close)
    emit(summary(lines))


if __name__ == "__main__":
    main()
