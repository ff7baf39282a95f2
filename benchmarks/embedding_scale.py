"""What a parameter-server step costs as the embedding table grows: kdist against TensorFlow (issue 23).

The model (the issue's): `Input(20 ids) -> Embedding(V, 64) ->
GlobalAveragePooling1D -> Dense(64, relu) -> Dense(1)`, MSE, batch 256, ids
uniform in [0, V), 2 ps with `kdist.partitioners.MinSizePartitioner(256 KiB,
max_shards=2)`. For every V in `--sizes` (10^4 .. 10^7) and optimizer in
`--optimizers` (`sgd`, `adagrad`, `adam`: exact, the default; `adam_lazy`:
`ParameterServerStrategy(..., sparse_updates="lazy")`), these configurations
train, each in its own processes:

| config | processes |
|---|---|
| `plain` | plain single-process Keras (torch), the same model and optimizer |
| `tf_ps_N` | TensorFlow's `ParameterServerStrategy`: in-process cluster, `ClusterCoordinator`, sparse applies (`_embedding_tf_baseline.py`, sgd and adagrad only) |
| `coordinator_N` | a chief running `model.fit` (`kdist.ParameterServerStrategy` + `ClusterCoordinator`), N `kdist server --job worker` processes, 2 ps |
| `between_graph_N` | N workers each running `model.fit` (as under `kdist launch --ps 2 --workers N`), 2 ps |

N in `--workers` (1, 2). Every process has one torch thread (`OMP_NUM_THREADS=1`,
`torch.set_num_threads(1)`); the TensorFlow servers one intra-op thread each.

A configuration's round is one `fit` (TensorFlow: `steps` scheduled closures) of
`--steps` steps; the time from the end of step `--warmup-steps` to the end of the
last step gives its steps/s (per-fit work, such as reading the servers' state
when a worker's `fit` ends, is left out). Rounds are interleaved over the
configurations (order reversed every other round) when all of them fit in memory
together, else each configuration runs its rounds alone (`"interleaved": false`).
Counters come from the servers themselves: each ps process reports its store's
`stats()` (tensor payload bytes received and sent) and `update_counts()`
(sparse and dense applies, rows updated). Per-step figures are the difference
between a round and one short fit of `--warmup-steps + 1` steps, divided by
the difference in steps, so per-fit traffic cancels. CPU per step sums
`/proc/<pid>/stat` user+system time of every process of the configuration,
the same way. Peak RSS is each process's `VmHWM` at the end of its block.

One JSON line per configuration and block (V, optimizer), then one
`embedding_scale_summary` line with the targets (issue 23):
- step time at the largest V at most 1.3x that at the smallest, for sgd,
  adagrad and adam_lazy, in both modes (V = 10^7 against 10^4 in a full run);
- coordinator `fit` at least 1.0x TensorFlow's steps/s at V = 10^6, sgd and adagrad;
- worker and chief peak RSS at the largest V within 200 MB of the smallest.

Usage:

    PYTHONPATH=. python benchmarks/embedding_scale.py                  # full run: hours on 2 cores
    PYTHONPATH=. python benchmarks/embedding_scale.py --quick          # smoke run: V=10^4, sgd, 1 worker
    PYTHONPATH=. python benchmarks/embedding_scale.py --sizes 10000,1000000 --optimizers sgd,adagrad
"""

import os
import secrets

# Keras reads the backend once, at import time.
os.environ.setdefault("KERAS_BACKEND", "torch")
# Every kdist service requires the cluster secret: this run's processes share one.
os.environ.setdefault("KDIST_SECRET", secrets.token_urlsafe(32))
# Children are forked after gRPC is loaded; gRPC's fork handlers can abort them (grpc/grpc#43055).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import argparse  # noqa: E402
import atexit  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from _report import environment, git_commit  # noqa: E402  (benchmarks/ is on sys.path)

ALL_SIZES = (10**4, 10**5, 10**6, 10**7)
DIM, IDS_PER_EXAMPLE, HIDDEN, BATCH_SIZE = 64, 20, 64, 256
NUM_PS, MIN_SHARD_BYTES, MAX_SHARDS = 2, 256 << 10, 2
# name -> (Keras optimizer, learning rate, sparse_updates, slots per variable)
OPTIMIZERS = {
    "sgd": ("SGD", 0.01, "exact", 0),
    "adagrad": ("Adagrad", 0.01, "exact", 1),
    "adam": ("Adam", 0.001, "exact", 2),
    "adam_lazy": ("Adam", 0.001, "lazy", 2),
}
TF_OPTIMIZERS = ("sgd", "adagrad")
MODES = ("coordinator", "between_graph")
WORKER_COUNTS = (1, 2)
MODEL_DESCRIPTION = (f"Input({IDS_PER_EXAMPLE} ids) -> Embedding(V, {DIM}) -> GlobalAveragePooling1D -> "
                     f"Dense({HIDDEN}, relu) -> Dense(1), MSE, batch {BATCH_SIZE}, {NUM_PS} ps, "
                     f"MinSizePartitioner({MIN_SHARD_BYTES >> 10} KiB, max_shards={MAX_SHARDS})")

# Targets (issue 23).
STEP_TIME_GROWTH_TARGET = 1.3  # step time at the largest V / at the smallest
STEP_TIME_GROWTH_OPTIMIZERS = ("sgd", "adagrad", "adam_lazy")
TF_RATIO_TARGET, TF_RATIO_ROWS, TF_RATIO_OPTIMIZERS = 1.0, 10**6, ("sgd", "adagrad")
RSS_GROWTH_TARGET_MB = 200.0

# Configurations run together only when their estimated memory is below this share of MemAvailable.
MEMORY_SHARE = 0.7
STARTUP_SECONDS, SETUP_SECONDS, ROUND_SECONDS = 240.0, 1800.0, 3600.0
MESSAGE_MARKER = "@@embedding_scale "  # also _embedding_tf_baseline.py's
SERVING_MARKER = "serving"
HERE = os.path.dirname(os.path.abspath(__file__))


# ----- child processes: this file re-run with --role ---------------------------------------
def _reply(message):
    print(MESSAGE_MARKER + json.dumps(message), flush=True)


def _serve(handler):
    _reply({"event": "hello", "pid": os.getpid()})
    for line in sys.stdin:
        command = json.loads(line)
        if command.pop("op") == "quit":
            return
        method = command.pop("method")
        _reply({"event": "done", **getattr(handler, method)(**command)})


def _build_model(rows):
    import keras

    inputs = keras.Input((IDS_PER_EXAMPLE,), dtype="int32")
    x = keras.layers.Embedding(rows, DIM)(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(HIDDEN, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def _compile(model, optimizer):
    import keras

    class_name, learning_rate, _, _ = OPTIMIZERS[optimizer]
    model.compile(optimizer=getattr(keras.optimizers, class_name)(learning_rate), loss="mse")


def _data(rows, steps, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.integers(0, rows, size=(steps * BATCH_SIZE, IDS_PER_EXAMPLE), dtype=np.int32)
    return x, rng.standard_normal(len(x)).astype(np.float32)


class _Trainer:
    """A process that trains with `fit`: plain Keras, a kdist chief or a between-graph worker."""

    def setup(self, role, rows, optimizer, spec=None, task_id=0):
        import keras
        import torch

        import kdist
        from kdist.cluster import SimpleClusterResolver

        torch.set_num_threads(1)
        keras.utils.set_random_seed(1)
        self.rows, self.seed = rows, 1000 * (task_id + 1)
        if role == "plain":
            self.model = _build_model(rows)
            _compile(self.model, optimizer)
            return {}
        strategy = kdist.ParameterServerStrategy(
            SimpleClusterResolver(spec, task_type="chief" if role == "chief" else "worker", task_id=task_id),
            variable_partitioner=kdist.partitioners.MinSizePartitioner(MIN_SHARD_BYTES, max_shards=MAX_SHARDS),
            sparse_updates=OPTIMIZERS[optimizer][2])
        if role == "chief":
            self.coordinator = kdist.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            self.model = _build_model(rows)
            _compile(self.model, optimizer)
        return {}

    def fit(self, steps, warmup_steps):
        import keras

        self.seed += 1
        x, y = _data(self.rows, steps, self.seed)

        # A subclass, not a LambdaCallback: the coordinator's fit (like Keras) calls batch
        # hooks only when a callback's class overrides them. On the chief a step "ends"
        # when its closure's result arrives.
        class StepEnds(keras.callbacks.Callback):
            ends = []

            def on_train_batch_end(self, batch, logs=None):
                self.ends.append(time.monotonic())

        callback = StepEnds()
        start = time.monotonic()
        history = self.model.fit(x, y, batch_size=BATCH_SIZE, epochs=1, shuffle=False, verbose=0,
                                 callbacks=[callback])
        ends = callback.ends
        if len(ends) != steps:
            raise RuntimeError(f"fit recorded {len(ends)} step ends for {steps} steps")
        return {"fit_start": start, "fit_end": time.monotonic(), "step_ends": ends[warmup_steps - 1 :],
                "loss": history.history["loss"][-1]}


class _ParameterServer:
    """A kdist variable server that also reports its store's counters (only readable in its process)."""

    def __init__(self, port):
        import torch

        from kdist.ps import create_server

        torch.set_num_threads(1)
        self.server = create_server(f"127.0.0.1:{port}")

    def counters(self):
        stats = self.server.store.stats()
        return {"bytes_received": stats.bytes_received, "bytes_sent": stats.bytes_sent,
                "requests": stats.requests, "update_counts": self.server.store.update_counts()}


# ----- driver side: processes ------------------------------------------------------------
class BenchmarkError(RuntimeError):
    """A child failed or missed a deadline; every child has been killed."""


_children = []


def _kill_all_children():
    for child in list(_children):
        child.kill()


class Child:
    """A child process; with `commanded`, it speaks the JSON-lines protocol on stdin/stdout."""

    def __init__(self, name, argv, env_extra=None, commanded=True):
        from kdist.launch.child import make_preexec

        root = os.path.dirname(HERE)
        env = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
        env.update(KERAS_BACKEND="torch", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([root, HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        env.update(env_extra or {})
        self.name, self.commanded, self._buffer = name, commanded, b""
        self._log = tempfile.NamedTemporaryFile(prefix=f"embedding_scale-{name}-", suffix=".log")
        # preexec: the child is SIGKILLed when this process dies, however it dies.
        self._process = subprocess.Popen(argv, stdin=subprocess.PIPE if commanded else subprocess.DEVNULL,
                                         stdout=subprocess.PIPE if commanded else self._log, stderr=self._log,
                                         env=env, preexec_fn=make_preexec())
        self.pid = self._process.pid
        _children.append(self)

    def wait_serving(self, timeout):
        """For a `kdist server` child: waits until its log says it serves."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self._log.name, "rb") as handle:
                if SERVING_MARKER.encode() in handle.read():
                    return
            if self._process.poll() is not None:
                self.fail(f"exited with code {self._process.returncode}")
            time.sleep(0.2)  # bounded by the deadline
        self.fail(f"did not start serving within {timeout:.0f} s")

    def send(self, **command):
        try:
            self._process.stdin.write((json.dumps(command) + "\n").encode())
            self._process.stdin.flush()
        except OSError as error:
            self.fail(f"could not be sent a command ({error})")

    def receive(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            line, newline, rest = self._buffer.partition(b"\n")
            if newline:
                self._buffer = rest
                text = line.decode(errors="replace")
                if text.startswith(MESSAGE_MARKER):
                    return json.loads(text[len(MESSAGE_MARKER) :])
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._process.stdout], [], [], remaining)[0]:
                self.fail(f"sent nothing within {timeout:.0f} s")
            chunk = os.read(self._process.stdout.fileno(), 65536)
            if not chunk:
                self.fail(f"exited with code {self._process.wait()}")
            self._buffer += chunk

    def call(self, timeout, method, **arguments):
        self.send(op="call", method=method, **arguments)
        return self.receive(timeout)

    def fail(self, reason):
        # The tail first: killing a child also removes its log.
        with open(self._log.name, "rb") as handle:
            tail = handle.read()[-4000:].decode(errors="replace")
        _kill_all_children()
        raise BenchmarkError(f"{self.name} {reason}; every child was killed.\n"
                             f"--- {self.name} output (tail) ---\n{tail}")

    def peak_rss_mb(self):
        return _proc_status_mb(self.pid, "VmHWM")

    def cpu_seconds(self):
        return _cpu_seconds(self.pid)

    def close(self, timeout=20.0):
        if self.commanded:
            try:
                self._process.stdin.write(b'{"op": "quit"}\n')
                self._process.stdin.close()
            except (OSError, ValueError):
                pass
            try:
                self._process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self):
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        if self in _children:
            _children.remove(self)
        self._log.close()


def _proc_status_mb(pid, field):
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return round(int(line.split()[1]) / 1024, 1)  # kB
    except OSError:
        pass
    return None


def _cpu_seconds(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0.0


def _role_argv(role, *extra):
    return [sys.executable, os.path.abspath(__file__), "--role", role, *map(str, extra)]


def _mem_available_bytes():
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# ----- driver side: configurations ------------------------------------------------------------
class Config:
    """One configuration of one block: its processes, a short fit, rounds, counters."""

    servers = ()  # Child list of kdist ps processes (counters)

    def __init__(self, name, mode, rows, optimizer, num_workers):
        self.name, self.mode, self.rows, self.optimizer, self.num_workers = name, mode, rows, optimizer, num_workers
        self.children = []

    def estimated_bytes(self):
        table = self.rows * DIM * 4
        slots = OPTIMIZERS[self.optimizer][3]
        return self._estimate(table, slots) + len(self._process_names()) * 600 * (1 << 20)

    def process_cpu_seconds(self):
        return sum(child.cpu_seconds() for child in self.children)

    def counters(self):
        return [server.call(ROUND_SECONDS, "counters") for server in self.servers]

    def peak_rss_mb(self):
        return {child.name: child.peak_rss_mb() for child in self.children}

    def close(self):
        for child in reversed(self.children):
            child.close()


class PlainConfig(Config):
    def _process_names(self):
        return ["plain"]

    def _estimate(self, table, slots):
        # Variable, torch's dense gradient of `take`, the slots, and the optimizer's temporaries.
        return table * (3 + 2 * slots)

    def start(self, args):
        self.trainer = Child("plain", _role_argv("trainer"))
        self.children = [self.trainer]
        self.trainer.receive(STARTUP_SECONDS)
        self.trainer.call(SETUP_SECONDS, "setup", role="plain", rows=self.rows, optimizer=self.optimizer)

    def fit(self, steps, warmup_steps):
        return [self.trainer.call(ROUND_SECONDS, "fit", steps=steps, warmup_steps=warmup_steps)]


class TfConfig(Config):
    def _process_names(self):
        return ["tf"]

    def _estimate(self, table, slots):
        return table * (1 + slots) * 2

    def start(self, args):
        self.baseline = Child("tf", [sys.executable, os.path.join(HERE, "_embedding_tf_baseline.py")],
                              env_extra={"KERAS_BACKEND": "tensorflow"})
        self.children = [self.baseline]
        self.baseline.receive(STARTUP_SECONDS)
        self.setup_reply = self.baseline.call(
            SETUP_SECONDS, "setup", rows=self.rows, dim=DIM, ids_per_example=IDS_PER_EXAMPLE, hidden=HIDDEN,
            batch_size=BATCH_SIZE, optimizer=self.optimizer, learning_rate=OPTIMIZERS[self.optimizer][1],
            num_workers=self.num_workers, num_ps=NUM_PS, min_shard_bytes=MIN_SHARD_BYTES, max_shards=MAX_SHARDS)

    def fit(self, steps, warmup_steps):
        reply = self.baseline.call(ROUND_SECONDS, "round", steps=steps, warmup_steps=warmup_steps)
        self.apply_kinds = reply["apply_kinds"]
        return [{"timed_steps": reply["timed_steps"], "seconds": reply["seconds"]}]


class KdistConfig(Config):
    """`coordinator_N` or `between_graph_N`: 2 ps processes plus the mode's trainers."""

    def _process_names(self):
        names = [f"ps-{i}" for i in range(NUM_PS)] + [f"worker-{i}" for i in range(self.num_workers)]
        return names + (["chief"] if self.mode == "coordinator" else [])

    def _estimate(self, table, slots):
        # The servers hold the table and slots (the dense path also one gradient buffer and Keras'
        # temporaries); until issue 23 is done, every worker and the chief hold a copy too.
        dense = self.optimizer == "adam"
        servers = table * (1 + slots + (2 if dense else 0))
        trainers = self.num_workers + (1 if self.mode == "coordinator" else 0)
        return servers + trainers * table

    def start(self, args):
        from kdist.launch.ports import free_ports

        ports = free_ports(NUM_PS + self.num_workers + 1)
        spec = {"ps": [f"127.0.0.1:{port}" for port in ports[:NUM_PS]],
                "worker": [f"127.0.0.1:{port}" for port in ports[NUM_PS : NUM_PS + self.num_workers]]}
        self.servers = [Child(f"ps-{i}", _role_argv("ps", ports[i])) for i in range(NUM_PS)]
        self.children = list(self.servers)
        if self.mode == "coordinator":
            spec["chief"] = [f"127.0.0.1:{ports[-1]}"]
            self._directory = tempfile.TemporaryDirectory(prefix="embedding_scale-")
            cluster_file = os.path.join(self._directory.name, "cluster.json")
            with open(cluster_file, "w") as handle:
                json.dump(spec, handle)
            workers = [Child(f"worker-{i}", [sys.executable, "-m", "kdist", "server", "--job", "worker", "--index",
                                             str(i), "--cluster", cluster_file, "--grace", "1"], commanded=False)
                       for i in range(self.num_workers)]
            self.trainers = [Child("chief", _role_argv("trainer"))]
            self.children += workers + self.trainers
            for child in self.servers + self.trainers:
                child.receive(STARTUP_SECONDS)
            for worker in workers:
                worker.wait_serving(STARTUP_SECONDS)
            self.trainers[0].call(SETUP_SECONDS, "setup", role="chief", rows=self.rows, optimizer=self.optimizer,
                                  spec=spec)
        else:
            self.trainers = [Child(f"worker-{i}", _role_argv("trainer")) for i in range(self.num_workers)]
            self.children += self.trainers
            for child in self.servers + self.trainers:
                child.receive(STARTUP_SECONDS)
            # One at a time: the first creates the variables, the others find them.
            for task_id, trainer in enumerate(self.trainers):
                trainer.call(SETUP_SECONDS, "setup", role="worker", rows=self.rows, optimizer=self.optimizer,
                             spec=spec, task_id=task_id)

    def fit(self, steps, warmup_steps):
        for trainer in self.trainers:
            trainer.send(op="call", method="fit", steps=steps, warmup_steps=warmup_steps)
        return [trainer.receive(ROUND_SECONDS) for trainer in self.trainers]

    def close(self):
        super().close()
        if self.mode == "coordinator":
            self._directory.cleanup()


def _timed_rate(replies):
    """Steps per second of a round: steps that ended inside the window every trainer was timing."""
    if "seconds" in replies[0]:
        return replies[0]["timed_steps"] / replies[0]["seconds"]
    start = max(reply["step_ends"][0] for reply in replies)
    end = min(reply["step_ends"][-1] for reply in replies)
    if len(replies) == 1 or end <= start:
        # One trainer, or trainers whose timed steps did not overlap: add up each one's rate.
        return sum((len(r["step_ends"]) - 1) / (r["step_ends"][-1] - r["step_ends"][0]) for r in replies)
    count = sum(1 for reply in replies for t in reply["step_ends"] if start < t <= end)
    return count / (end - start)


def _counter_totals(counters):
    totals = {"bytes_to_servers": 0, "bytes_from_servers": 0, "sparse_applies": 0, "dense_applies": 0,
              "rows_updated": 0, "requests": 0}
    for server in counters:
        totals["bytes_to_servers"] += server["bytes_received"]
        totals["bytes_from_servers"] += server["bytes_sent"]
        totals["requests"] += sum(count for name, count in server["requests"].items() if name != "counters")
        for counts in server["update_counts"].values():
            for key in ("sparse_applies", "dense_applies", "rows_updated"):
                totals[key] += counts[key]
    return totals


def measure(config, args, steps):
    """One fit of `steps` steps per trainer: rate, and totals of counters and CPU over the whole fit."""
    before, cpu_before = _counter_totals(config.counters()), config.process_cpu_seconds()
    replies = config.fit(steps, args.warmup_steps)
    cpu = config.process_cpu_seconds() - cpu_before
    after = _counter_totals(config.counters())
    trained = steps * (len(config.trainers) if isinstance(config, KdistConfig) and config.mode == "between_graph"
                       else 1)
    return {"steps_per_sec": _timed_rate(replies), "steps": trained, "cpu_seconds": cpu,
            "counters": {key: after[key] - before[key] for key in after}}


def run_group(configs, args, interleaved):
    """Starts `configs`, warms them up, runs the short fit and the rounds; returns results by name."""
    results = {}
    try:
        for config in configs:
            config.start(args)
            config.fit(args.warmup_steps + 1, 1)  # builds the train functions (not timed)
            results[config.name] = {"short": measure(config, args, args.warmup_steps + 1), "rounds": []}
        for round_index in range(args.rounds):
            order = configs if round_index % 2 == 0 else list(reversed(configs))
            for config in order:
                results[config.name]["rounds"].append(measure(config, args, args.steps))
        for config in configs:
            results[config.name]["peak_rss_mb"] = config.peak_rss_mb()
            results[config.name]["interleaved"] = interleaved
    finally:
        for config in configs:
            config.close()
    return results


def make_configs(rows, optimizer, args):
    configs = []
    if not args.no_plain:
        configs.append(PlainConfig("plain", "plain", rows, optimizer, 1))
    for num_workers in args.workers:
        if not args.no_tf and optimizer in TF_OPTIMIZERS:
            configs.append(TfConfig(f"tf_ps_{num_workers}", "tf_ps", rows, optimizer, num_workers))
        for mode in args.modes:
            configs.append(KdistConfig(f"{mode}_{num_workers}", mode, rows, optimizer, num_workers))
    return configs


def run_block(rows, optimizer, args):
    """Every configuration at (rows, optimizer): interleaved when they fit in memory together."""
    configs = make_configs(rows, optimizer, args)
    available = _mem_available_bytes() * MEMORY_SHARE
    skipped = {c.name: (f"estimated {c.estimated_bytes() / 1e9:.1f} GB > {MEMORY_SHARE:.0%} of MemAvailable "
                        f"({available / 1e9:.1f} GB)") for c in configs if c.estimated_bytes() > available}
    if importlib.util.find_spec("tensorflow") is None:
        skipped.update({c.name: f"TensorFlow is not installed in {sys.executable}" for c in configs
                        if isinstance(c, TfConfig)})
    runnable = [c for c in configs if c.name not in skipped]
    if sum(c.estimated_bytes() for c in runnable) <= available:
        results = run_group(runnable, args, interleaved=True)
    else:
        results = {}
        for config in runnable:
            results.update(run_group([config], args, interleaved=False))
    return configs, results, skipped


def _per_step(round_result, short):
    steps = round_result["steps"] - short["steps"]
    counters = {key: (value - short["counters"][key]) / steps for key, value in round_result["counters"].items()}
    return counters, (round_result["cpu_seconds"] - short["cpu_seconds"]) / steps


def block_lines(configs, results, skipped, args):
    lines = []
    rates = {name: [r["steps_per_sec"] for r in result["rounds"]] for name, result in results.items()}
    for config in configs:
        line = {"what": "embedding_scale", "config": config.name, "mode": config.mode, "rows": config.rows,
                "optimizer": config.optimizer, "sparse_updates": OPTIMIZERS[config.optimizer][2],
                "num_workers": config.num_workers}
        if config.name in skipped:
            lines.append({**line, "skipped": skipped[config.name]})
            continue
        result = results[config.name]
        rate = statistics.median(rates[config.name])
        per_step = [_per_step(r, result["short"]) for r in result["rounds"]]
        counters = {key: round(statistics.median(c[key] for c, _ in per_step), 1) for key in per_step[0][0]}
        line.update({
            "steps_per_sec": round(rate, 3),
            "ms_per_step": round(1000 / rate, 2),
            "steps_per_sec_by_round": [round(r, 3) for r in rates[config.name]],
            "cpu_ms_per_step_all_processes": round(1000 * statistics.median(cpu for _, cpu in per_step), 2),
            "peak_rss_mb": result["peak_rss_mb"],
            "interleaved": result["interleaved"],
        })
        if isinstance(config, KdistConfig):
            line["servers_per_step"] = counters  # bytes to/from the servers, requests, applies, rows updated
        if isinstance(config, TfConfig):
            line["tf_apply_kinds"] = getattr(config, "apply_kinds", None)
        # TensorFlow's baseline with as many workers as this configuration.
        for key, baseline in (("plain", "plain"), ("tf_ps", f"tf_ps_{config.num_workers}")):
            if baseline != config.name and baseline in rates:
                line[f"ratio_vs_{key}"] = round(rate / statistics.median(rates[baseline]), 3)
                line[f"paired_ratio_median_vs_{key}"] = round(statistics.median(
                    a / b for a, b in zip(rates[config.name], rates[baseline])), 3)
        lines.append(line)
    return lines


def summary(lines, sizes):
    """The issue's targets, each with its value and whether it is met (`met` None: not measured).

    Also, for information, every configuration's step time at the largest size
    over its step time at the smallest (`step_time_growth`).
    """
    measured = {(line["config"], line["rows"], line["optimizer"]): line for line in lines if "steps_per_sec" in line}
    small, large = min(sizes), max(sizes)
    targets, growth = [], {}

    def add(name, value, target, met, why=None):
        targets.append({"name": name, "value": value, "target": target, "met": met,
                        **({"not_measured": why} if why else {})})

    for config, optimizer in sorted({(key[0], key[2]) for key in measured}):
        a, b = measured.get((config, small, optimizer)), measured.get((config, large, optimizer))
        if a and b and large > small:
            growth[f"{config}/{optimizer}"] = round(b["ms_per_step"] / a["ms_per_step"], 3)
    pair = f"rows_{large}_vs_{small}"
    for mode in MODES:
        for num_workers in WORKER_COUNTS:
            config = f"{mode}_{num_workers}"
            for optimizer in OPTIMIZERS:
                a, b = measured.get((config, small, optimizer)), measured.get((config, large, optimizer))
                both = bool(a and b and large > small)
                if optimizer in STEP_TIME_GROWTH_OPTIMIZERS:
                    name = f"step_time_{config}_{optimizer}_{pair}"
                    if both:
                        value = growth[f"{config}/{optimizer}"]
                        add(name, value, f"<= {STEP_TIME_GROWTH_TARGET}", value <= STEP_TIME_GROWTH_TARGET)
                    else:
                        add(name, None, f"<= {STEP_TIME_GROWTH_TARGET}", None, "needs two sizes, both measured")
                roles = (["chief"] if mode == "coordinator" else []) + [f"worker-{i}" for i in range(num_workers)]
                if not both:
                    add(f"peak_rss_growth_mb_{config}_{optimizer}_{pair}", None, f"<= {RSS_GROWTH_TARGET_MB}", None,
                        "needs two sizes, both measured")
                for role in roles if both else ():
                    before, after = a["peak_rss_mb"].get(role), b["peak_rss_mb"].get(role)
                    if before is not None and after is not None:
                        value = round(after - before, 1)
                        add(f"peak_rss_growth_mb_{config}_{optimizer}_{role}_{pair}", value,
                            f"<= {RSS_GROWTH_TARGET_MB}", value <= RSS_GROWTH_TARGET_MB)
            if mode == "coordinator":
                for optimizer in TF_RATIO_OPTIMIZERS:
                    line = measured.get((config, TF_RATIO_ROWS, optimizer))
                    name = f"{config}_vs_tf_ps_{num_workers}_{optimizer}_rows_{TF_RATIO_ROWS}"
                    if line and "ratio_vs_tf_ps" in line:
                        add(name, line["ratio_vs_tf_ps"], f">= {TF_RATIO_TARGET}",
                            line["ratio_vs_tf_ps"] >= TF_RATIO_TARGET)
                    else:
                        add(name, None, f">= {TF_RATIO_TARGET}", None,
                            f"needs rows={TF_RATIO_ROWS} with the TF baseline")
    checked = [target["met"] for target in targets if target["met"] is not None]
    return {"what": "embedding_scale_summary", "all_measured_targets_met": all(checked) if checked else None,
            "targets_measured": len(checked), "targets_not_measured": len(targets) - len(checked),
            "targets": targets, "step_time_growth": growth, "sizes": list(sizes)}


# ----- main ------------------------------------------------------------------------------------
def _csv(kind, choices=None):
    def parse(text):
        values = [kind(item) for item in text.split(",") if item]
        bad = [value for value in values if choices is not None and value not in choices]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list from {choices}; received {text!r}")
        return values
    return parse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("trainer", "ps"), help=argparse.SUPPRESS)
    parser.add_argument("role_arguments", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run: V=10^4, sgd, 1 worker, 2 rounds of 6 steps")
    parser.add_argument("--sizes", type=_csv(int), help="table rows, comma-separated (default 10^4..10^7)")
    parser.add_argument("--optimizers", type=_csv(str, tuple(OPTIMIZERS)), help="default: all four")
    parser.add_argument("--modes", type=_csv(str, MODES), help="default: coordinator,between_graph")
    parser.add_argument("--workers", type=_csv(int, WORKER_COUNTS), help="worker counts (default 1,2)")
    parser.add_argument("--steps", type=int, help="steps per round (default 40; 6 with --quick)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps at the start of each fit")
    parser.add_argument("--rounds", type=int, help="rounds per configuration (default 5; 2 with --quick)")
    parser.add_argument("--no-tf", action="store_true", help="leave out TensorFlow's baseline")
    parser.add_argument("--no-plain", action="store_true", help="leave out plain Keras")
    args = parser.parse_args(argv)
    args.sizes = args.sizes or ([10**4] if args.quick else list(ALL_SIZES))
    args.optimizers = args.optimizers or (["sgd"] if args.quick else list(OPTIMIZERS))
    args.modes = args.modes or list(MODES)
    args.workers = args.workers or ([1] if args.quick else list(WORKER_COUNTS))
    args.steps = args.steps or (6 if args.quick else 40)
    args.rounds = args.rounds or (2 if args.quick else 5)
    if min(args.sizes) < 1 or args.warmup_steps < 1 or args.steps <= args.warmup_steps + 1 or args.rounds < 1:
        parser.error("--sizes must be positive, --warmup-steps >= 1, --steps > --warmup-steps + 1 and --rounds >= 1. "
                     f"Received: --sizes={args.sizes} --warmup-steps={args.warmup_steps} --steps={args.steps} "
                     f"--rounds={args.rounds}.")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.role == "trainer":
        return _serve(_Trainer())
    if args.role == "ps":
        return _serve(_ParameterServer(int(args.role_arguments[0])))
    atexit.register(_kill_all_children)
    # SIGTERM runs atexit too, so children never outlive a stopped benchmark.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    commit = git_commit()
    settings = {"steps_per_round": args.steps, "warmup_steps": args.warmup_steps, "rounds": args.rounds,
                "model": MODEL_DESCRIPTION}

    def emit(line):
        print(json.dumps({"benchmark": "embedding_scale", **line, **settings,
                          "environment": environment(torch_threads_per_process=1, transport="grpc loopback",
                                                     num_ps=NUM_PS),
                          "commit": commit}), flush=True)

    lines = []
    for rows in args.sizes:
        for optimizer in args.optimizers:
            for line in block_lines(*run_block(rows, optimizer, args), args):
                emit(line)
                lines.append(line)
    emit(summary(lines, args.sizes))


if __name__ == "__main__":
    main()
