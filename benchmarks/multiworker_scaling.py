"""How well `kdist.MultiWorkerMirroredStrategy` scales over processes, against torch DDP.

One invocation starts its own worker processes (this file re-run with `--role`,
torchrun-style environment, a free port per group) and prints one JSON line per
result:

- `scaling_efficiency` (a): one model, one global batch, trained for a number
  of steps by kdist in 1 and 2 processes and by a hand-written torch
  `DistributedDataParallel` loop in 1 and 2 processes. Efficiency is
  `throughput(2 processes) / (2 * throughput(1 process))`; the line's `ratio`
  is kdist's efficiency over DDP's.
- `allreduce_bandwidth` (b): in 2 processes, kdist's gradient sync as the
  replica engine runs it (each rank's batch-weighted gradients written into
  reusable communication buckets by `ReductionBuffers.fill_weighted`, then one
  all-reduce per bucket; `ratio` times the reduction of the filled buckets,
  `ratio_with_weighting` includes the weighting pass that writes them) against one
  `dist.all_reduce` of a pre-flattened buffer of the same bytes, for three
  gradient layouts; also one call per tensor, for information.
- `simulated_scaling` (c): N = 4 and 8 processes on this machine whose compute is
  replaced by `time.sleep` (SIMULATED: a 2-core machine cannot run 8 real
  replicas) and whose gradient sync is real: kdist's reduction against one
  flat all-reduce. Shows how the sync's overhead grows with N.

Every process uses one torch thread in every configuration, 1-process runs
included: otherwise the 1-process run would use every core and the 2-process
runs would compete for them. Worker groups start once and stay up; timed
rounds are interleaved (kdist_1, kdist_2, ddp_1, ddp_2, kdist_1, ...) and
timed inside the workers, so process start-up and model building are never
timed. Every wait has a deadline; on any failure every worker is killed.

Usage:

    python benchmarks/multiworker_scaling.py           # full run, about 3 minutes on 2 cores
    python benchmarks/multiworker_scaling.py --quick   # smoke run, about 40 s
"""

import os

# Keras reads the backend once, at import time.
os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from _report import environment, git_commit  # noqa: E402  (benchmarks/ is on sys.path)
from _workers import WorkerGroup, serve  # noqa: E402
from _workers import step_durations as _step_durations  # noqa: E402

INPUT_FEATURES = 784
HIDDEN_UNITS = 512
NUM_CLASSES = 10
DEFAULT_GLOBAL_BATCH = 2048
# The gradient layouts of part (b): the benchmark MLP's, a ~25M-parameter MLP's
# (larger than one 25 MiB bucket), and many small tensors (where per-call latency rules).
MLP_SHAPES = [(784, 512), (512,), (512, 512), (512,), (512, 10), (10,)]
ALLREDUCE_CASES = {
    "mlp_0.67M": MLP_SHAPES,
    "mlp_25M": [(1024, 4096), (4096,), (4096, 4096), (4096,), (4096, 1024), (1024,)],
    "many_small_200x10k": [(10_000,)] * 200,
}
# Timed calls per layout. Small all-reduces on a 2-core machine vary 4x from call to
# call (the ranks' gloo threads compete with the main threads for the cores), so
# small layouts get many calls; one call per tensor is slow and only informative,
# so it is timed at every PER_TENSOR_EVERY-th repeat only.
ALLREDUCE_REPEATS = {"mlp_0.67M": 150, "mlp_25M": 10, "many_small_200x10k": 60}
PER_TENSOR_EVERY = 5
SCALING_CONFIGS = (("kdist_1", "kdist", 1), ("kdist_2", "kdist", 2), ("ddp_1", "ddp", 1), ("ddp_2", "ddp", 2))
TARGET_RATIO = 0.9
# Deadlines. A worker group that misses one is killed and the benchmark fails.
STARTUP_SECONDS = 240.0
OPERATION_SECONDS = 180.0
COLLECTIVE_TIMEOUT_SECONDS = 60.0


# ----- worker side --------------------------------------------------------------
def _synthetic_data(num_samples):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((num_samples, INPUT_FEATURES), dtype=np.float32)
    return x, rng.integers(0, NUM_CLASSES, size=num_samples)



def _kdist_gradient_sync(collectives, gradients, weight=0.5):
    """What `ReplicaEngine` does per `optimizer.apply` call in a multi-worker job."""
    buffers = collectives.reduction_buffers(gradients, key="benchmark")
    combined = buffers.fill_weighted([gradients], [weight])
    collectives.wait(collectives.start_all_reduce(buffers, "gradients"))
    return combined


def _kdist_reduction_only(collectives, gradients):
    """The reduction alone: the engine's buckets are already filled by the weighted combine."""
    buffers = collectives.reduction_buffers(gradients, key="benchmark")
    collectives.wait(collectives.start_all_reduce(buffers, "gradients"))
    return buffers.views


class CollectiveTimer:
    """Counts calls and seconds of one `ProcessCollectives`' collectives, per method and name.

    Wraps the instance's methods (kdist itself is unchanged); a pair of
    `perf_counter` calls per collective is all it adds.
    """

    METHODS = ("all_reduce_sum", "all_reduce_min", "all_true", "broadcast", "broadcast_object", "all_gather_rows")

    def __init__(self, collectives):
        self.totals = {}
        for method in self.METHODS:
            setattr(collectives, method, self._wrap(method, getattr(collectives, method)))

    def _wrap(self, method, call):
        def timed(*args, name="", **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, name=name, **kwargs)
            finally:
                entry = self.totals.setdefault(f"{method}({name})", [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - start

        return timed


class KdistWorker:
    def __init__(self):
        import kdist

        self.strategy = kdist.MultiWorkerMirroredStrategy(
            communication_options=kdist.CommunicationOptions(timeout_seconds=COLLECTIVE_TIMEOUT_SECONDS)
        )
        self.collectives = self.strategy.extended.collectives
        self.rank, self.world_size = self.collectives.rank, self.collectives.world_size
        self.timer = CollectiveTimer(self.collectives)

    def setup_fit(self, steps, warmup, global_batch):
        import keras

        keras.utils.set_random_seed(0)
        with self.strategy.scope():
            self.model = keras.Sequential(
                [
                    keras.Input((INPUT_FEATURES,)),
                    keras.layers.Dense(HIDDEN_UNITS, activation="relu"),
                    keras.layers.Dense(HIDDEN_UNITS, activation="relu"),
                    keras.layers.Dense(NUM_CLASSES),
                ]
            )
            self.model.compile(
                optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        self.x, self.y = _synthetic_data((steps + warmup) * global_batch)
        self.warmup, self.global_batch = warmup, global_batch
        self.fit()  # builds and warms up; not timed by the driver
        return {}

    def fit(self):
        import keras

        step_ends = []
        timer = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: step_ends.append(time.perf_counter()))
        gc.collect()
        self.timer.totals.clear()
        self.model.fit(self.x, self.y, batch_size=self.global_batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
        return {
            "step_seconds": _step_durations(step_ends, self.warmup),
            "collectives": self.timer.totals,
            "num_steps": len(step_ends),
        }

    def allreduce(self, case, repeats, per_tensor_every):
        """Seconds per call of kdist's reduction, one flat all_reduce and one all_reduce per tensor."""
        import torch
        import torch.distributed as dist

        shapes = ALLREDUCE_CASES[case]
        tensors = [torch.randn(shape) for shape in shapes]
        singles = [torch.zeros(shape) for shape in shapes]
        flat = torch.zeros(sum(t.numel() for t in tensors))
        methods = {
            "kdist": lambda: _kdist_reduction_only(self.collectives, tensors),
            "kdist_with_weighting": lambda: _kdist_gradient_sync(self.collectives, tensors),
            "flat": lambda: dist.all_reduce(flat),
            "per_tensor": lambda: [dist.all_reduce(t) for t in singles],
        }
        seconds = {name: [] for name in methods}
        names = list(methods)
        for repeat in range(repeats + 1):  # the first repeat warms up
            # Rotate the order so that no method always runs first after the per-tensor calls.
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                if name == "per_tensor" and repeat % per_tensor_every:
                    continue
                call = methods[name]
                dist.barrier()
                start = time.perf_counter()
                call()
                if repeat:
                    seconds[name].append(time.perf_counter() - start)
        return {"seconds": seconds, "bytes": flat.numel() * flat.element_size()}

    def simulate(self, sleep_seconds, steps, rounds):
        """Steps of `sleep(sleep_seconds)` + a real gradient reduction, kdist's and flat in turn."""
        import torch
        import torch.distributed as dist

        tensors = [torch.randn(shape) for shape in MLP_SHAPES]
        flat = torch.zeros(sum(t.numel() for t in tensors))
        methods = {
            "kdist": lambda: _kdist_gradient_sync(self.collectives, tensors),
            "flat": lambda: dist.all_reduce(flat),
        }
        seconds = {name: [] for name in methods}
        for _ in range(rounds):
            for name, reduce in methods.items():
                step_ends = []
                for _ in range(steps + 1):
                    time.sleep(sleep_seconds)
                    reduce()
                    step_ends.append(time.perf_counter())
                seconds[name].extend(_step_durations(step_ends, 1))
        return {"seconds": seconds}


class DdpWorker:
    """The baseline: plain torch, `DistributedDataParallel` over gloo, each rank its half of the batch."""

    def __init__(self):
        from datetime import timedelta

        import torch.distributed as dist

        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS),
        )

    def setup_fit(self, steps, warmup, global_batch, hidden_units=HIDDEN_UNITS):
        import torch
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        module = torch.nn.Sequential(
            torch.nn.Linear(INPUT_FEATURES, hidden_units),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden_units, hidden_units),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden_units, NUM_CLASSES),
        )
        self.model = DistributedDataParallel(module)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        x, y = _synthetic_data((steps + warmup) * global_batch)
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)
        self.num_steps, self.warmup, self.global_batch = steps + warmup, warmup, global_batch
        self.fit()
        return {}

    def fit(self):
        import torch

        local = self.global_batch // self.world_size
        step_ends = []
        gc.collect()
        for step in range(self.num_steps):
            start = step * self.global_batch + self.rank * local
            x, y = self.x[start : start + local], self.y[start : start + local]
            self.optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            loss.detach().item()  # like Keras, read the loss every step
            step_ends.append(time.perf_counter())
        return {"step_seconds": _step_durations(step_ends, self.warmup)}


def run_worker(role):
    import torch

    torch.set_num_threads(1)
    worker = KdistWorker() if role == "kdist" else DdpWorker()
    serve(worker)  # until "quit", or EOF when the driver died
    if role == "kdist":
        worker.collectives.shutdown()


# ----- driver side ----------------------------------------------------------------
def _group(name, role, world_size):
    """A `WorkerGroup` of this script re-run with `--role role`."""
    return WorkerGroup(name, [sys.executable, os.path.abspath(__file__), "--role", role], world_size)


def measure_scaling(groups, args):
    """Part (a): interleaved rounds; returns the JSON line and kdist_1's median step seconds."""
    for group in groups.values():
        group.request(STARTUP_SECONDS, op="setup_fit", steps=args.steps, warmup=args.warmup, global_batch=args.global_batch)
    step_seconds = {name: [] for name in groups}
    collectives, num_fit_steps = {}, 0  # kdist_2 rank 0's collectives over every timed round
    for _ in range(args.rounds):
        for name, group in groups.items():
            replies = group.request(OPERATION_SECONDS, op="fit")
            # Ranks finish each step together (the reduction syncs them); rank 0 speaks for all.
            step_seconds[name].append(statistics.median(replies[0]["step_seconds"]))
            if name == "kdist_2":
                num_fit_steps += replies[0]["num_steps"]
                for key, (calls, seconds) in replies[0]["collectives"].items():
                    total = collectives.setdefault(key, [0, 0.0])
                    total[0], total[1] = total[0] + calls, total[1] + seconds
    # Samples per second per round, each from that round's median step time.
    throughput = {name: [args.global_batch / s for s in values] for name, values in step_seconds.items()}
    med = {name: statistics.median(values) for name, values in throughput.items()}
    kdist_efficiency = med["kdist_2"] / (2 * med["kdist_1"])
    ddp_efficiency = med["ddp_2"] / (2 * med["ddp_1"])
    paired = [
        (k2 / (2 * k1)) / (d2 / (2 * d1))
        for k1, k2, d1, d2 in zip(*(throughput[n] for n in ("kdist_1", "kdist_2", "ddp_1", "ddp_2")))
    ]
    line = {
        "what": "scaling_efficiency",
        "ratio": round(kdist_efficiency / ddp_efficiency, 3),
        "target": TARGET_RATIO,
        "meets_target": kdist_efficiency / ddp_efficiency >= TARGET_RATIO,
        "kdist_efficiency": round(kdist_efficiency, 3),
        "ddp_efficiency": round(ddp_efficiency, 3),
        "paired_ratio_median": round(statistics.median(paired), 3),
        "samples_per_sec": {name: round(value, 1) for name, value in med.items()},
        "step_ms": {name: round(1000 * statistics.median(values), 2) for name, values in step_seconds.items()},
        "step_ms_by_round": {name: [round(1000 * s, 2) for s in values] for name, values in step_seconds.items()},
        # Where kdist_2's steps wait for the other rank: calls and milliseconds per step, by collective.
        "kdist_2_collectives_per_step": {
            key: {"calls": round(calls / num_fit_steps, 3), "ms": round(1000 * seconds / num_fit_steps, 3)}
            for key, (calls, seconds) in sorted(collectives.items())
        },
        "model": f"MLP {INPUT_FEATURES}-{HIDDEN_UNITS}-{HIDDEN_UNITS}-{NUM_CLASSES} relu, Adam, sparse CE from logits",
        "global_batch": args.global_batch,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "warmup_steps_per_round": args.warmup,
    }
    return line, statistics.median(step_seconds["kdist_1"])


def measure_allreduce(group, args):
    """Part (b): one JSON line per gradient layout, from 2 processes."""
    lines = []
    for case, shapes in ALLREDUCE_CASES.items():
        repeats = max(PER_TENSOR_EVERY * 2, ALLREDUCE_REPEATS[case] // (10 if args.quick else 1))
        replies = group.request(
            OPERATION_SECONDS, op="allreduce", case=case, repeats=repeats, per_tensor_every=PER_TENSOR_EVERY
        )
        num_bytes, world_size = replies[0]["bytes"], len(replies)
        seconds = {}
        for method in replies[0]["seconds"]:
            # A call lasts until the slowest rank has its result.
            per_call = [max(values) for values in zip(*(reply["seconds"][method] for reply in replies))]
            seconds[method] = statistics.median(per_call)
        bus_bandwidth = {m: num_bytes * 2 * (world_size - 1) / world_size / s for m, s in seconds.items()}
        ratio = bus_bandwidth["kdist"] / bus_bandwidth["flat"]
        lines.append(
            {
                "what": "allreduce_bandwidth",
                "case": case,
                "ratio": round(ratio, 3),
                "target": TARGET_RATIO,
                "meets_target": ratio >= TARGET_RATIO,
                "ratio_with_weighting": round(bus_bandwidth["kdist_with_weighting"] / bus_bandwidth["flat"], 3),
                "per_tensor_ratio": round(bus_bandwidth["per_tensor"] / bus_bandwidth["flat"], 3),
                "bus_bandwidth_gb_per_s": {m: round(bw / 1e9, 3) for m, bw in bus_bandwidth.items()},
                "ms_per_call": {m: round(1000 * s, 3) for m, s in seconds.items()},
                "num_tensors": len(shapes),
                "bytes": num_bytes,
                "world_size": world_size,
                "repeats": repeats,
            }
        )
    return lines


def measure_simulated(world_size, compute_seconds, args):
    """Part (c): N processes sleeping for 1/N of the 1-process compute, then really reducing."""
    group = _group(f"simulated_{world_size}", "kdist", world_size)
    try:
        group.receive(STARTUP_SECONDS)
        sleep_seconds = compute_seconds / world_size
        replies = group.request(
            OPERATION_SECONDS, op="simulate", sleep_seconds=sleep_seconds, steps=args.simulated_steps, rounds=args.rounds
        )
    finally:
        group.close()
    step = {method: statistics.median(values) for method, values in replies[0]["seconds"].items()}
    efficiency = {method: sleep_seconds / s for method, s in step.items()}
    ratio = efficiency["kdist"] / efficiency["flat"]
    return {
        "what": "simulated_scaling",
        "simulated": True,
        "world_size": world_size,
        "ratio": round(ratio, 3),
        "target": None,
        "meets_target": None,
        "kdist_efficiency": round(efficiency["kdist"], 3),
        "flat_efficiency": round(efficiency["flat"], 3),
        "sleep_ms_per_step": round(1000 * sleep_seconds, 2),
        "step_ms": {method: round(1000 * s, 2) for method, s in step.items()},
        "gradient_layout": "mlp_0.67M",
        "steps": args.simulated_steps * args.rounds,
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("kdist", "ddp"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run, about 40 s")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 7; 2 with --quick)")
    parser.add_argument("--steps", type=int, help="timed steps per round (default 40; 6 with --quick)")
    parser.add_argument("--global-batch", type=int, default=DEFAULT_GLOBAL_BATCH, help="global batch size (default %(default)s)")
    parser.add_argument("--no-simulated", action="store_true", help="skip part (c)")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 7
    if args.steps is None:
        args.steps = 6 if args.quick else 40
    if args.rounds < 1 or args.steps < 2 or args.global_batch < 2 or args.global_batch % 2:
        parser.error(
            "--rounds must be >= 1, --steps >= 2 and --global-batch even. Received: "
            f"--rounds={args.rounds} --steps={args.steps} --global-batch={args.global_batch}."
        )
    args.warmup = 3 if args.quick else 5
    args.simulated_steps = 6 if args.quick else 20
    args.simulated_sizes = () if args.no_simulated else ((4,) if args.quick else (4, 8))
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.role:
        run_worker(args.role)
        return
    import kdist  # noqa: F401  (the driver only orchestrates; imported for free_port and versions)

    commit = git_commit()

    def emit(line):
        print(json.dumps({"benchmark": "multiworker_scaling", **line, "environment": environment(torch_threads_per_process=1, backend="gloo"), "commit": commit}), flush=True)

    groups = {}
    try:
        # All groups start together (start-up is not timed), then stay up for every round.
        for name, role, world_size in SCALING_CONFIGS:
            groups[name] = _group(name, role, world_size)
        for group in groups.values():
            group.receive(STARTUP_SECONDS)
        scaling_line, compute_seconds = measure_scaling(groups, args)
        emit(scaling_line)
        for line in measure_allreduce(groups["kdist_2"], args):
            emit(line)
    finally:
        for group in groups.values():
            group.close()
    for world_size in args.simulated_sizes:
        emit(measure_simulated(world_size, compute_seconds, args))


if __name__ == "__main__":
    main()
