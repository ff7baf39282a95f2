"""How fast kdist's parameter-server service moves tensors, and how async training on it scales.

One invocation starts its own server and worker processes (this file re-run
with `--role`) and prints one JSON line per result:

- `ps_transfer` (1), one line per tensor size (4 KiB .. 64 MiB, float32): push
  and pull through the variable service (`create_server` in its own process,
  `VariableClient` in this one; a push applies plain `SGD` on the server)
  against bare gRPC moving the same bytes in its own server process: generic
  handlers, identity serializers, messages of the service's chunk size
  prepared before timing (the gRPC ceiling), both directions. `ratio` =
  kdist / bare push+pull throughput. For information: `bare_copy`, the same
  stream plus one copy per message on each side between NumPy buffers and
  gRPC's bytes (the floor of any chunked array transfer in Python gRPC), and
  one unary message of the whole tensor (why tensors are chunked).
- `ps_round_trips` (2): pull and push requests per training step per server
  while `model.fit` runs with `ParameterServerStrategy` against 2 ps, from the
  servers' request counters (the difference of two fits of different lengths,
  so per-fit requests cancel out).
- `ps_async_scaling` (3, 4): steps per second of 1, 2 and 4 asynchronous
  workers against 2 ps, each worker `model.fit`-ing its own data with compute
  SIMULATED by a sleep in `train_step` (a 2-core machine cannot run 4 real
  workers), from the servers' applied-push counters over a window after
  start-up; staleness (mean, p99) over the same window.
- `ps_summary`: every ratio and whether each target is met.

Every child process gets one torch thread, dies with this process, and every
wait on it has a deadline; on any failure every child is killed. The bare
baseline imports `grpc` directly: it is the benchmark's yardstick, not kdist.

Usage:

    PYTHONPATH=. python benchmarks/ps_throughput.py           # full run, about 2 minutes on 2 cores
    PYTHONPATH=. python benchmarks/ps_throughput.py --quick   # smoke run, about 1 minute
"""

import os
import secrets

# Keras reads the backend once, at import time.
os.environ.setdefault("KERAS_BACKEND", "torch")
# Every kdist service requires the cluster secret: the processes of this run share
# one, as the tasks of one `kdist launch` job do.
os.environ.setdefault("KDIST_SECRET", secrets.token_urlsafe(32))

import argparse  # noqa: E402
import atexit  # noqa: E402
import json  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from _report import environment, git_commit  # noqa: E402  (benchmarks/ is on sys.path)

KIB, MIB = 1 << 10, 1 << 20
SIZES = (4 * KIB, 64 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB)
# A timed sample makes enough calls to move about this many bytes (at least one
# call, at most MAX_CALLS_PER_SAMPLE): a single 4 KiB call would time the clock.
SAMPLE_BYTES = 32 * MIB
MAX_CALLS_PER_SAMPLE = 64
TRANSFER_METHODS = ("kdist_push", "kdist_pull", "bare_push", "bare_pull", "bare_copy_push", "bare_copy_pull",
                    "unary_push", "unary_pull")
# The bare server and channel must take a whole 64 MiB tensor in one unary message.
BARE_MAX_MESSAGE_BYTES = 128 * MIB
BARE_SERVICE = "kdistbench.Bare"
SGD_LEARNING_RATE = 1e-3

# Targets.
TRANSFER_RATIO_TARGET = 0.8  # kdist / bare push+pull, tensors of at least RATIO_FROM_BYTES
RATIO_FROM_BYTES = MIB
TRANSFER_GB_PER_S_TARGET = 1.0  # kdist push+pull, 1 MiB .. 64 MiB, on loopback
# "No collapse at 64 MiB": 64 MiB reaches this fraction of the best of 1 .. 16 MiB.
NO_COLLAPSE_FRACTION = 0.8
REQUESTS_PER_STEP_TARGET = 1.0
SCALING_TARGETS = {2: 1.8, 4: 2.8}

# Parts 2-4: a small MLP, Adam on the servers, 2 parameter servers.
NUM_PS = 2
WORKER_COUNTS = (1, 2, 4)
FEATURES, HIDDEN, CLASSES = 32, 64, 10
BATCH_SIZE = 32
DATA_BATCHES = 400  # per worker; an epoch boundary every 400 steps
SIMULATED_COMPUTE_MS = 50.0
WARMUP_FIT_STEPS = 5
ROUND_TRIP_FITS = (10, 40)  # steps of the two fits whose difference gives per-step requests

# Deadlines. A child that misses one is killed and the benchmark fails.
STARTUP_SECONDS = 180.0
OPERATION_SECONDS = 180.0
RPC_SECONDS = 60.0
MESSAGE_MARKER = "@@ps_throughput "


def _reply(message):
    print(MESSAGE_MARKER + json.dumps(message), flush=True)


def _commands():
    """Yields the driver's commands; EOF (the driver died) ends the child."""
    for line in sys.stdin:
        command = json.loads(line)
        if command.pop("op") == "quit":
            return
        yield command


# ----- child processes ------------------------------------------------------------
def run_kdist_server():
    import torch

    from kdist.ps import create_server

    torch.set_num_threads(1)
    server = create_server("127.0.0.1:0")
    _reply({"event": "hello", "port": server.port})
    for _ in _commands():
        pass
    server.stop(0)


def run_bare_server():
    """A minimal gRPC server: raw bytes in and out (identity serializers).

    `Push`/`Pull` are the ceiling: pulled chunks are built once and reused,
    pushed messages are dropped. `PushCopy`/`PullCopy` add what any array
    transfer needs at least: one copy of each message into, or out of, a
    NumPy buffer that is reused from call to call.
    """
    from concurrent import futures

    import grpc
    import numpy as np

    payload = np.random.default_rng(1).bytes(max(SIZES))
    buffer = np.frombuffer(bytearray(payload), np.uint8)  # writable; PushCopy's target, PullCopy's source
    cache = {}

    def chunks(size, chunk_bytes):
        if (size, chunk_bytes) not in cache:
            cache[size, chunk_bytes] = [payload[o : min(o + chunk_bytes, size)] for o in range(0, size, chunk_bytes)]
        return cache[size, chunk_bytes]

    def push(messages, context):
        return struct.pack("<Q", sum(len(message) for message in messages))

    def pull(request, context):
        return iter(chunks(*struct.unpack("<QQ", request)))

    def push_copy(messages, context):
        offset = 0
        for message in messages:
            buffer[offset : offset + len(message)] = np.frombuffer(message, np.uint8)
            offset += len(message)
        return struct.pack("<Q", offset)

    def pull_copy(request, context):
        size, chunk_bytes = struct.unpack("<QQ", request)
        return (buffer[o : min(o + chunk_bytes, size)].tobytes() for o in range(0, size, chunk_bytes))

    def push_unary(message, context):
        return struct.pack("<Q", len(message))

    def pull_unary(request, context):
        size, _ = struct.unpack("<QQ", request)
        return chunks(size, size)[0]

    # No (de)serializers: gRPC hands the handlers raw bytes and sends the bytes they return.
    handler = grpc.method_handlers_generic_handler(BARE_SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(push),
        "Pull": grpc.unary_stream_rpc_method_handler(pull),
        "PushCopy": grpc.stream_unary_rpc_method_handler(push_copy),
        "PullCopy": grpc.unary_stream_rpc_method_handler(pull_copy),
        "PushUnary": grpc.unary_unary_rpc_method_handler(push_unary),
        "PullUnary": grpc.unary_unary_rpc_method_handler(pull_unary),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[handler], options=_bare_options())
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    _reply({"event": "hello", "port": port})
    for _ in _commands():
        pass
    server.stop(0)


def _bare_options():
    return [("grpc.max_send_message_length", BARE_MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", BARE_MAX_MESSAGE_BYTES),
            ("grpc.enable_http_proxy", 0)]


# Seconds `train_step` sleeps before computing: simulated compute, set per command.
_simulated_compute_seconds = [0.0]


def _mlp():
    import keras

    class SimulatedComputeMLP(keras.Model):
        def train_step(self, data):
            time.sleep(_simulated_compute_seconds[0])
            return super().train_step(data)

    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(HIDDEN, activation="relu")(inputs)
    hidden = keras.layers.Dense(HIDDEN, activation="relu")(hidden)
    model = SimulatedComputeMLP(inputs, keras.layers.Dense(CLASSES)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class Worker:
    """One `ParameterServerStrategy` worker, driven by commands."""

    def setup(self, spec, task_id):
        import keras
        import numpy as np

        import kdist
        from kdist.cluster import SimpleClusterResolver

        self.strategy = kdist.ParameterServerStrategy(SimpleClusterResolver(spec, task_type="worker", task_id=task_id))
        keras.utils.set_random_seed(task_id)
        with self.strategy.scope():
            self.model = _mlp()
        rng = np.random.default_rng(task_id)  # every worker trains on its own data
        self.x = rng.standard_normal((DATA_BATCHES * BATCH_SIZE, FEATURES), dtype=np.float32)
        self.y = rng.integers(0, CLASSES, size=len(self.x))
        return self.fit(WARMUP_FIT_STEPS, 0.0)  # builds the train function; not timed

    def fit(self, steps, sleep_ms):
        _simulated_compute_seconds[0] = sleep_ms / 1000
        samples = steps * BATCH_SIZE
        history = self.model.fit(self.x[:samples], self.y[:samples], batch_size=BATCH_SIZE, epochs=1,
                                 shuffle=False, verbose=0)
        return {"steps": steps, "loss": history.history["loss"][-1]}

    def run(self, until, sleep_ms):
        """Trains until `time.monotonic()` passes `until`; returns when each step ended."""
        import keras

        _simulated_compute_seconds[0] = sleep_ms / 1000
        step_ends = []

        def on_train_batch_end(batch, logs):
            step_ends.append(time.monotonic())
            if step_ends[-1] >= until:
                self.model.stop_training = True

        self.model.fit(self.x, self.y, batch_size=BATCH_SIZE, epochs=1_000_000, verbose=0,
                       callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=on_train_batch_end)])
        return {"step_ends": step_ends}


def run_worker():
    import torch

    torch.set_num_threads(1)
    worker = Worker()
    _reply({"event": "hello"})
    for command in _commands():
        operation = command.pop("method")
        _reply({"event": "done", **getattr(worker, operation)(**command)})


# ----- driver side: children --------------------------------------------------------
class ChildError(RuntimeError):
    """A child failed or missed a deadline; every child has been killed."""


_children = []


def _kill_all_children():
    for child in _children:
        child.kill()


class Child:
    """This file re-run with `--role role`, commanded by JSON lines. Not thread-safe."""

    def __init__(self, name, role):
        from kdist.launch.child import make_preexec

        kdist_root = os.path.dirname(os.path.dirname(os.path.abspath(__import__("kdist").__file__)))
        env = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
        env.update(KERAS_BACKEND="torch", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([kdist_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        self.name = name
        self._log = tempfile.TemporaryFile()
        self._buffer = b""
        # preexec: the child is SIGKILLed when this process dies, however it dies.
        self._process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--role", role],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
            preexec_fn=make_preexec(),
        )
        _children.append(self)

    def send(self, **command):
        try:
            self._process.stdin.write((json.dumps(command) + "\n").encode())
            self._process.stdin.flush()
        except OSError as error:
            self._fail(f"could not be sent a command ({error})")

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
                self._fail(f"sent nothing within {timeout:.0f} s")
            chunk = os.read(self._process.stdout.fileno(), 65536)
            if not chunk:
                self._fail(f"exited with code {self._process.wait()}")
            self._buffer += chunk

    def request(self, timeout, **command):
        self.send(**command)
        return self.receive(timeout)

    def _fail(self, reason):
        _kill_all_children()
        self._log.seek(0)
        tail = self._log.read()[-4000:].decode(errors="replace")
        raise ChildError(f"{self.name} {reason}; every child was killed.\n--- {self.name} stderr (tail) ---\n{tail}")

    def close(self, timeout=15.0):
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


# ----- part 1: transfer ----------------------------------------------------------------
class BareClient:
    """The driver's end of the bare gRPC server (see `run_bare_server`)."""

    def __init__(self, address, chunk_bytes):
        import grpc
        import numpy as np

        self.chunk_bytes = chunk_bytes
        self._buffer = np.empty(max(SIZES), np.uint8)  # PullCopy's target, reused
        self._channel = grpc.insecure_channel(address, options=_bare_options())
        self._calls = {
            name: factory(f"/{BARE_SERVICE}/{name}")
            for name, factory in (("Push", self._channel.stream_unary), ("Pull", self._channel.unary_stream),
                                  ("PushCopy", self._channel.stream_unary), ("PullCopy", self._channel.unary_stream),
                                  ("PushUnary", self._channel.unary_unary), ("PullUnary", self._channel.unary_unary))
        }
        self._calls["PullUnary"](struct.pack("<QQ", 1, 1), timeout=STARTUP_SECONDS, wait_for_ready=True)

    def push(self, chunks):
        """Sends messages built before the call."""
        self._calls["Push"](iter(chunks), timeout=RPC_SECONDS)

    def pull(self, size):
        """Receives `size` bytes in chunks and drops them."""
        for _ in self._calls["Pull"](struct.pack("<QQ", size, self.chunk_bytes), timeout=RPC_SECONDS):
            pass

    def push_copy(self, view):
        """Sends the uint8 `view`, copying each chunk into its message as it is sent."""
        chunk = self.chunk_bytes
        self._calls["PushCopy"]((view[o : o + chunk].tobytes() for o in range(0, len(view), chunk)),
                                timeout=RPC_SECONDS)

    def pull_copy(self, size):
        """Receives `size` bytes in chunks, each copied into a reused buffer."""
        import numpy as np

        offset = 0
        for message in self._calls["PullCopy"](struct.pack("<QQ", size, self.chunk_bytes), timeout=RPC_SECONDS):
            self._buffer[offset : offset + len(message)] = np.frombuffer(message, np.uint8)
            offset += len(message)

    def push_unary(self, message):
        self._calls["PushUnary"](message, timeout=RPC_SECONDS)

    def pull_unary(self, size):
        self._calls["PullUnary"](struct.pack("<QQ", size, size), timeout=RPC_SECONDS)

    def close(self):
        self._channel.close()


def _calls_per_sample(size):
    return max(1, min(MAX_CALLS_PER_SAMPLE, SAMPLE_BYTES // size))


def measure_transfer(args):
    """Part 1: seconds per call of every method and size, interleaved over repetitions."""
    import keras
    import numpy as np

    from kdist.ps import DenseGradient, VariableClient, VariableInit

    servers = {"kdist": Child("kdist_server", "kdist_server"), "bare": Child("bare_server", "bare_server")}
    ports = {name: child.receive(STARTUP_SECONDS)["port"] for name, child in servers.items()}
    client = VariableClient(f"127.0.0.1:{ports['kdist']}")
    bare = BareClient(f"127.0.0.1:{ports['bare']}", client.options.chunk_bytes)
    try:
        rng = np.random.default_rng(0)
        tensors = {size: rng.standard_normal(size // 4, dtype=np.float32) for size in SIZES}
        names = {size: f"tensor_{size}" for size in SIZES}
        client.create([VariableInit(names[size], np.zeros_like(tensor)) for size, tensor in tensors.items()])
        client.configure_optimizer(keras.optimizers.serialize(keras.optimizers.SGD(SGD_LEARNING_RATE)),
                                   list(names.values()))
        destinations = {size: np.empty_like(tensor) for size, tensor in tensors.items()}
        raw = {size: tensor.tobytes() for size, tensor in tensors.items()}
        views = {size: tensor.view(np.uint8) for size, tensor in tensors.items()}
        chunks = {size: [data[o : o + bare.chunk_bytes] for o in range(0, size, bare.chunk_bytes)]
                  for size, data in raw.items()}
        operations = {
            "kdist_push": lambda size: client.push([DenseGradient(names[size], tensors[size], None)]),
            # As a worker does: straight into the memory of its local copy.
            "kdist_pull": lambda size: client.pull([names[size]], out={names[size]: destinations[size]}),
            "bare_push": lambda size: bare.push(chunks[size]),
            "bare_pull": bare.pull,
            "bare_copy_push": lambda size: bare.push_copy(views[size]),
            "bare_copy_pull": bare.pull_copy,
            "unary_push": lambda size: bare.push_unary(raw[size]),
            "unary_pull": bare.pull_unary,
        }
        seconds = {method: {size: [] for size in SIZES} for method in TRANSFER_METHODS}
        for repeat in range(args.repeats + 1):  # repeat 0 warms up (one call each)
            for size in SIZES:
                calls = _calls_per_sample(size) if repeat else 1
                shift = repeat % len(TRANSFER_METHODS)  # no method always runs first
                for method in TRANSFER_METHODS[shift:] + TRANSFER_METHODS[:shift]:
                    start = time.perf_counter()
                    for _ in range(calls):
                        operations[method](size)
                    if repeat:
                        seconds[method][size].append((time.perf_counter() - start) / calls)
    finally:
        client.close()
        bare.close()
        for child in servers.values():
            child.close()
    return seconds, client.options.chunk_bytes


def transfer_lines(seconds, chunk_bytes):
    """Part 1's JSON lines, one per size: medians over repetitions, ratios against bare gRPC."""
    lines = []
    for size in SIZES:
        s = {method: seconds[method][size] for method in TRANSFER_METHODS}
        gb = size / 1e9

        def rate(method):
            return statistics.median(gb / t for t in s[method])

        def round_trip(kind):  # push then pull of the tensor, per repetition
            return [2 * gb / (push + pull) for push, pull in zip(s[f"{kind}_push"], s[f"{kind}_pull"])]

        both = {kind: round_trip(kind) for kind in ("kdist", "bare", "bare_copy", "unary")}
        kdist_rate, bare_rate = statistics.median(both["kdist"]), statistics.median(both["bare"])
        ratio = kdist_rate / bare_rate
        checked = size >= RATIO_FROM_BYTES
        lines.append({
            "what": "ps_transfer",
            "size_bytes": size,
            "size": f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB",
            "ratio": round(ratio, 3),
            "target": TRANSFER_RATIO_TARGET if checked else None,
            "meets_target": ratio >= TRANSFER_RATIO_TARGET if checked else None,
            "paired_ratio_median": round(statistics.median(k / b for k, b in zip(both["kdist"], both["bare"])), 3),
            # Against the floor of any chunked array transfer in Python (one copy per side):
            # what is left is kdist's own cost; the rest of the gap is Python gRPC's copies.
            "ratio_vs_bare_copy": round(kdist_rate / statistics.median(both["bare_copy"]), 3),
            "push_ratio": round(rate("kdist_push") / rate("bare_push"), 3),
            "pull_ratio": round(rate("kdist_pull") / rate("bare_pull"), 3),
            "gb_per_s": {
                "kdist_push_pull": round(kdist_rate, 3),
                "bare_push_pull": round(bare_rate, 3),
                "bare_copy_push_pull": round(statistics.median(both["bare_copy"]), 3),
                "unary_push_pull": round(statistics.median(both["unary"]), 3),
                **{method: round(rate(method), 3) for method in TRANSFER_METHODS},
            },
            "gb_per_s_target": TRANSFER_GB_PER_S_TARGET if checked else None,
            "ms_per_call": {method: round(1000 * statistics.median(s[method]), 3) for method in TRANSFER_METHODS},
            "calls_per_sample": _calls_per_sample(size),
            "repeats": len(s["kdist_push"]),
            "chunk_bytes": chunk_bytes,
        })
    return lines


# ----- parts 2-4: training against 2 parameter servers ----------------------------------
class Cluster:
    """`NUM_PS` kdist servers and `max(WORKER_COUNTS)` workers, each in its own process."""

    def __init__(self):
        from kdist.launch.ports import free_ports
        from kdist.ps import VariableClient

        self.servers = [Child(f"ps-{index}", "kdist_server") for index in range(NUM_PS)]
        self.workers = [Child(f"worker-{index}", "worker") for index in range(max(WORKER_COUNTS))]
        addresses = [f"127.0.0.1:{server.receive(STARTUP_SECONDS)['port']}" for server in self.servers]
        self.clients = [VariableClient(address) for address in addresses]
        # Worker addresses are only names here: workers serve nothing.
        self.spec = {"ps": addresses, "worker": [f"127.0.0.1:{port}" for port in free_ports(len(self.workers))]}
        for worker in self.workers:
            worker.receive(STARTUP_SECONDS)
        # One at a time: the first creates the variables, the others find them.
        for task_id, worker in enumerate(self.workers):
            worker.request(OPERATION_SECONDS, op="call", method="setup", spec=self.spec, task_id=task_id)

    def stats(self):
        return [client.stats() for client in self.clients]

    def close(self):
        for client in self.clients:
            client.close()
        for child in self.workers + self.servers:
            child.close()


def measure_round_trips(cluster):
    """Part 2: requests per step per server, from two fits of worker 0 (sleep 0)."""
    short, long = ROUND_TRIP_FITS
    snapshots = [cluster.stats()]
    for steps in (short, long):
        cluster.workers[0].request(OPERATION_SECONDS, op="call", method="fit", steps=steps, sleep_ms=0.0)
        snapshots.append(cluster.stats())
    servers, worst = [], 0.0
    for index in range(NUM_PS):
        before, after_short, after_long = (snapshot[index].requests for snapshot in snapshots)
        per_fit = {method: {"short": after_short.get(method, 0) - before.get(method, 0),
                            "long": after_long.get(method, 0) - after_short.get(method, 0)}
                   for method in sorted(set(after_long) - {"stats"})}
        per_step = {method: (count["long"] - count["short"]) / (long - short) for method, count in per_fit.items()}
        worst = max([worst] + [per_step.get(method, 0.0) for method in ("pull", "push")])
        servers.append({
            "ps": index,
            "requests_per_step": {method: round(value, 3) for method, value in per_step.items()},
            "requests_per_fit_besides_steps": {
                method: round(count["short"] - short * per_step[method], 3) for method, count in per_fit.items()
            },
            "requests_by_fit": per_fit,
        })
    return {
        "what": "ps_round_trips",
        "max_pull_or_push_requests_per_step": round(worst, 3),
        "target": REQUESTS_PER_STEP_TARGET,
        "meets_target": worst <= REQUESTS_PER_STEP_TARGET,
        "servers": servers,
        "fits_steps": list(ROUND_TRIP_FITS),
        "model": _model_description(),
    }


def _model_description():
    return (f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES} relu, Adam(1e-3) on the servers, batch {BATCH_SIZE}, "
            f"{NUM_PS} ps, variables placed round-robin")


def _histogram_delta(before, after):
    return {key: count - before.get(key, 0) for key, count in after.items() if count - before.get(key, 0)}


def measure_scaling_window(cluster, num_workers, args):
    """Parts 3-4, one window: `num_workers` workers train; the servers' counters are read twice."""
    from kdist.ps import StalenessStats

    workers = cluster.workers[:num_workers]
    start = time.monotonic()
    window_start, window_end = start + args.warmup_seconds, start + args.warmup_seconds + args.window_seconds
    for worker in workers:
        worker.send(op="call", method="run", until=window_end + 0.5, sleep_ms=SIMULATED_COMPUTE_MS)
    # Not a polling loop: the window's edges are fixed times.
    time.sleep(max(0.0, window_start - time.monotonic()))
    first, t0 = cluster.stats(), time.monotonic()
    time.sleep(max(0.0, window_end - time.monotonic()))
    last, t1 = cluster.stats(), time.monotonic()
    replies = [worker.receive(OPERATION_SECONDS) for worker in workers]
    seconds = t1 - t0
    applied = [b.applied_pushes - a.applied_pushes for a, b in zip(first, last)]
    histogram = {}
    for a, b in zip(first, last):
        for key, count in _histogram_delta(a.staleness.histogram, b.staleness.histogram).items():
            histogram[key] = histogram.get(key, 0) + count
    worker_steps = sum(t0 <= end <= t1 for reply in replies for end in reply["step_ends"])
    return {
        # Every step pushes once to each server holding trainable variables: a step is
        # one applied push on every server; the servers' mean counts it.
        "steps_per_sec": statistics.mean(applied) / seconds,
        "worker_steps_per_sec": worker_steps / seconds,
        "applied_pushes_per_ps": applied,
        "staleness": StalenessStats.from_histogram(histogram),
        "window_seconds": seconds,
    }


def measure_scaling(cluster, args):
    from kdist.ps import StalenessStats

    windows = {count: [] for count in WORKER_COUNTS}
    for round_index in range(args.rounds):
        order = WORKER_COUNTS if round_index % 2 == 0 else tuple(reversed(WORKER_COUNTS))
        for count in order:
            windows[count].append(measure_scaling_window(cluster, count, args))
    baseline = statistics.median(w["steps_per_sec"] for w in windows[1])
    lines = []
    for count, results in windows.items():
        rate = statistics.median(w["steps_per_sec"] for w in results)
        ratio = rate / baseline
        target = SCALING_TARGETS.get(count)
        merged = {}  # the staleness histogram of every window of this worker count
        for window in results:
            for key, value in window["staleness"].histogram.items():
                merged[key] = merged.get(key, 0) + value
        total = StalenessStats.from_histogram(merged)
        lines.append({
            "what": "ps_async_scaling",
            "num_workers": count,
            "simulated_compute": True,
            "ratio_vs_1_worker": round(ratio, 3),
            "target": target,
            "meets_target": ratio >= target if target else None,
            "steps_per_sec": round(rate, 2),
            "steps_per_sec_by_round": [round(w["steps_per_sec"], 2) for w in results],
            "worker_steps_per_sec_by_round": [round(w["worker_steps_per_sec"], 2) for w in results],
            "ideal_steps_per_sec_per_worker": round(1000 / SIMULATED_COMPUTE_MS, 2),
            "staleness": {"mean": round(total.mean, 3), "p99": total.p99, "max": total.max, "count": total.count,
                          "histogram": {str(k): v for k, v in sorted(total.histogram.items())}},
            "applied_pushes_per_ps_by_round": [w["applied_pushes_per_ps"] for w in results],
            "simulated_compute_ms": SIMULATED_COMPUTE_MS,
            "window_seconds": round(statistics.mean(w["window_seconds"] for w in results), 2),
            "rounds": args.rounds,
            "model": _model_description(),
        })
    return lines


# ----- summary and main ---------------------------------------------------------------
def summary(transfer, round_trips, scaling):
    targets = []
    by_size = {line["size_bytes"]: line for line in transfer}
    for line in transfer:
        if line["size_bytes"] >= RATIO_FROM_BYTES:
            targets.append({"name": f"transfer_ratio_{line['size']}", "value": line["ratio"],
                            "target": f">= {TRANSFER_RATIO_TARGET}", "met": line["meets_target"]})
            rate = line["gb_per_s"]["kdist_push_pull"]
            targets.append({"name": f"transfer_gb_per_s_{line['size']}", "value": rate,
                            "target": f">= {TRANSFER_GB_PER_S_TARGET}", "met": rate >= TRANSFER_GB_PER_S_TARGET})
    best = max(line["gb_per_s"]["kdist_push_pull"] for size, line in by_size.items() if MIB <= size < 64 * MIB)
    fraction = by_size[64 * MIB]["gb_per_s"]["kdist_push_pull"] / best
    targets.append({"name": "transfer_no_collapse_64MiB_vs_best_1_to_16MiB", "value": round(fraction, 3),
                    "target": f">= {NO_COLLAPSE_FRACTION}", "met": fraction >= NO_COLLAPSE_FRACTION})
    targets.append({"name": "pull_or_push_requests_per_step_per_server",
                    "value": round_trips["max_pull_or_push_requests_per_step"],
                    "target": f"<= {REQUESTS_PER_STEP_TARGET}", "met": round_trips["meets_target"]})
    for line in scaling:
        if line["target"]:
            targets.append({"name": f"async_scaling_{line['num_workers']}_workers", "value": line["ratio_vs_1_worker"],
                            "target": f">= {line['target']}", "met": line["meets_target"]})
    return {
        "what": "ps_summary",
        "all_targets_met": all(target["met"] for target in targets),
        "targets": targets,
        "transfer_ratio_by_size": {line["size"]: line["ratio"] for line in transfer},
        "transfer_gb_per_s_by_size": {line["size"]: line["gb_per_s"]["kdist_push_pull"] for line in transfer},
        "scaling_ratio_by_workers": {line["num_workers"]: line["ratio_vs_1_worker"] for line in scaling},
        "staleness_by_workers": {line["num_workers"]: {"mean": line["staleness"]["mean"], "p99": line["staleness"]["p99"]}
                                 for line in scaling},
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("kdist_server", "bare_server", "worker"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run, about a minute")
    parser.add_argument("--repeats", type=int, help="transfer repetitions (default 9; 2 with --quick)")
    parser.add_argument("--rounds", type=int, help="scaling rounds (default 2; 1 with --quick)")
    parser.add_argument("--window-seconds", type=float, help="scaling window (default 8; 3 with --quick)")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 9
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.window_seconds is None:
        args.window_seconds = 3.0 if args.quick else 8.0
    args.warmup_seconds = 2.0 if args.quick else 3.0
    if args.repeats < 1 or args.rounds < 1 or args.window_seconds <= 0:
        parser.error("--repeats and --rounds must be >= 1 and --window-seconds > 0. Received: "
                     f"--repeats={args.repeats} --rounds={args.rounds} --window-seconds={args.window_seconds}.")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.role:
        {"kdist_server": run_kdist_server, "bare_server": run_bare_server, "worker": run_worker}[args.role]()
        return
    atexit.register(_kill_all_children)
    # SIGTERM runs atexit too, so children never outlive a stopped benchmark.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    commit = git_commit()

    def emit(line):
        print(json.dumps({"benchmark": "ps_throughput", **line,
                          "environment": environment(torch_threads_per_process=1, transport="grpc loopback"),
                          "commit": commit}), flush=True)

    seconds, chunk_bytes = measure_transfer(args)
    transfer = transfer_lines(seconds, chunk_bytes)
    for line in transfer:
        emit(line)
    cluster = Cluster()
    try:
        round_trips = measure_round_trips(cluster)
        emit(round_trips)
        scaling = measure_scaling(cluster, args)
        for line in scaling:
            emit(line)
    finally:
        cluster.close()
    emit(summary(transfer, round_trips, scaling))


if __name__ == "__main__":
    main()
