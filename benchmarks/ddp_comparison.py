"""kdist's `MultiWorkerMirroredStrategy` against Keras 3.16's own DDP `fit` and a hand-written torch DDP loop.

Issue 16's side-by-side benchmark. Roles, each a group of 2 gloo processes
with one torch thread, the same MLP and global batch, interleaved rounds:
`kdist_fp32` (MultiWorkerMirroredStrategy `fit`, gradients reduced during
backward), `kdist_bf16` (the same with `Compression.bf16`), `keras316_ddp` (a plain Keras 3.16 model after
`init_process_group("gloo")`, which Keras wraps in DDP itself; each rank fits
its slice of every global batch) and `torch_ddp` (the loop of
`multiworker_scaling.py`). The Keras and kdist roles run under
`--keras316-python`. Configurations `compute_bound` and `comm_bound`, on
plain loopback and on loopback throttled to 2 Gbit/s in a private network
namespace. One JSON line per (config, link); benchmarks/README.md explains
every field.

Usage:

    python benchmarks/ddp_comparison.py            # full run, about 4 minutes on 2 cores
    python benchmarks/ddp_comparison.py --quick    # smoke run, about 1 minute
"""

import os

# Keras reads the backend once, at import time.
os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from _report import environment, git_commit  # noqa: E402  (benchmarks/ is on sys.path)
from _workers import WorkerGroup, kdist_root, serve, step_durations  # noqa: E402
from multiworker_scaling import COLLECTIVE_TIMEOUT_SECONDS, INPUT_FEATURES, NUM_CLASSES  # noqa: E402
from multiworker_scaling import DdpWorker, _synthetic_data  # noqa: E402

CONFIGS = {
    "compute_bound": {"hidden_units": 1024, "global_batch": 512},
    "comm_bound": {"hidden_units": 2048, "global_batch": 64},
}
LINKS = {"plain": "plain_loopback", "throttled": "throttled_2gbit"}
THROTTLE = "ip link set lo up && tc qdisc add dev lo root tbf rate 2gbit burst 256kb latency 50ms"
WORLD_SIZE = 2
ROLES = ("kdist_fp32", "kdist_bf16", "keras316_ddp", "torch_ddp")
KDIST_ROLES = {"kdist_fp32": "none", "kdist_bf16": "bf16"}
KERAS_316 = "3.16.0"
# Deadlines. A worker group that misses one is killed and the benchmark fails.
STARTUP_SECONDS = 240.0
OPERATION_SECONDS = 300.0
PROBE_SECONDS = 30.0
CHECK_SECONDS = 180.0


# ----- worker side --------------------------------------------------------------
def _mlp(keras, hidden_units):
    dense = keras.layers.Dense
    return keras.Sequential([keras.Input((INPUT_FEATURES,)), dense(hidden_units, activation="relu"),
                             dense(hidden_units, activation="relu"), dense(NUM_CLASSES)])


class _KerasFit:
    """A Keras `fit` of the benchmark MLP, each step's end time taken by a callback."""

    def setup_fit(self, steps, warmup, global_batch, hidden_units):
        import keras

        keras.utils.set_random_seed(0)
        with self._scope():
            self.model = _mlp(keras, hidden_units)
            self.model.compile(
                optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        x, y = _synthetic_data((steps + warmup) * global_batch)
        self.x, self.y, self.batch_size = self._my_data(x, y, global_batch)
        self.warmup = warmup
        self.fit()  # builds and warms up; not timed by the driver
        return self._setup_facts()

    def fit(self):
        import keras

        step_ends = []
        timer = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: step_ends.append(time.perf_counter()))
        gc.collect()
        sent_before = self._gradient_wire_bytes()
        self.model.fit(self.x, self.y, batch_size=self.batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
        return {
            "step_seconds": step_durations(step_ends, self.warmup),
            "num_steps": len(step_ends),
            "gradient_wire_bytes": self._gradient_wire_bytes() - sent_before,
        }

    def _gradient_wire_bytes(self):
        return 0


class KdistRole(_KerasFit):
    def __init__(self, compression="none"):
        import kdist

        self.strategy = kdist.MultiWorkerMirroredStrategy(
            communication_options=kdist.CommunicationOptions(
                timeout_seconds=COLLECTIVE_TIMEOUT_SECONDS, compression=getattr(kdist.Compression, compression)
            )
        )
        self.collectives = self.strategy.extended.collectives
        self.rank = self.collectives.rank

    def _scope(self):
        return self.strategy.scope()

    def _my_data(self, x, y, global_batch):
        return x, y, global_batch  # every rank reads the global batch; kdist trains this rank's part

    def _gradient_wire_bytes(self):
        stats = self.collectives.statistics
        return sum(s.wire_bytes for key, s in stats.items() if key.startswith("all_reduce(gradients"))

    def _setup_facts(self):
        import keras

        options = self.collectives.options
        return {
            "keras": keras.version(),
            "bucket_bytes": options.bucket_bytes,
            "first_bucket_bytes": options.first_bucket_bytes,
            "overlap_with_backward": options.overlap_with_backward,
            "compression": options.compression.name,
        }

    def close(self):
        self.collectives.shutdown()


class KerasDdpRole(_KerasFit):
    """Keras' own multi-process `fit`: Keras 3.16 wraps the model in DDP once a process group exists."""

    __init__ = DdpWorker.__init__  # init_process_group("gloo") from the torchrun variables, with a timeout

    def _scope(self):
        return contextlib.nullcontext()

    def _my_data(self, x, y, global_batch):
        local = global_batch // self.world_size
        x = x.reshape(-1, self.world_size, local, x.shape[-1])[:, self.rank].reshape(-1, x.shape[-1])
        y = y.reshape(-1, self.world_size, local)[:, self.rank].reshape(-1)
        return x, y, local

    def _setup_facts(self):
        import keras

        # Proof that Keras' DDP path ran, not an unsynchronised plain fit.
        return {"keras": keras.version(), "ddp_wrapped": getattr(self.model, "ddp_model", None) is not None}

    def close(self):
        import torch.distributed as dist

        dist.destroy_process_group()


def run_worker(role):
    import torch

    torch.set_num_threads(1)
    if role in KDIST_ROLES:
        worker = KdistRole(KDIST_ROLES[role])
    else:
        worker = {"keras316_ddp": KerasDdpRole, "torch_ddp": DdpWorker}[role]()
    serve(worker)  # until "quit", or EOF when the driver died
    if hasattr(worker, "close"):
        worker.close()


# ----- driver side ----------------------------------------------------------------
def check_keras316(python):
    """Returns None if `python` runs Keras 3.16.0 on torch, else the reason it cannot be used."""
    if not os.path.exists(python):
        return f"{python} does not exist (create the venv: see shared/wheels/README.md)"
    try:
        result = subprocess.run(
            [python, "-c", "import keras; print(keras.version())"], env={**os.environ, "KERAS_BACKEND": "torch"},
            capture_output=True, text=True, timeout=CHECK_SECONDS,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"{python} could not import keras ({type(error).__name__}: {error})"
    if result.returncode:
        last = (result.stderr.strip().splitlines() or [""])[-1]
        return f"{python} could not import keras (exit code {result.returncode}: {last})"
    version = (result.stdout.strip().splitlines() or [""])[-1]
    return None if version == KERAS_316 else f"{python} has Keras {version!r}, not {KERAS_316}"


def _lo_tx_bytes():
    """Bytes sent on this network namespace's `lo` (`/proc/net/dev` is per namespace, /sys is not)."""
    with open("/proc/net/dev") as file:
        for line in file:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])
    return None


def _gradient_bytes(hidden_units):
    params = INPUT_FEATURES * hidden_units + hidden_units + hidden_units * hidden_units + hidden_units
    return 4 * (params + hidden_units * NUM_CLASSES + NUM_CLASSES)


def _ratio(numerator, denominator):
    return round(numerator / denominator, 3) if numerator and denominator else None


def measure_config(groups, config, link, args):
    """Interleaved rounds of every role on one configuration; returns its JSON line (without env/commit)."""
    spec = CONFIGS[config]
    global_batch, hidden_units = spec["global_batch"], spec["hidden_units"]
    facts = {}
    for role, group in groups.items():
        replies = group.request(
            STARTUP_SECONDS, op="setup_fit", steps=args.steps, warmup=args.warmup,
            global_batch=global_batch, hidden_units=hidden_units,
        )
        facts[role] = replies[0]
    step_seconds = {role: [] for role in groups}
    lo_tx = {role: [] for role in groups}
    kdist_wire = {role: [] for role in groups if role in KDIST_ROLES}
    for round_index in range(args.rounds):
        order = list(groups) if round_index % 2 == 0 else list(reversed(groups))
        for role in order:
            tx_before = _lo_tx_bytes() if link == "throttled" else None
            replies = groups[role].request(OPERATION_SECONDS, op="fit")
            # Ranks finish each step together (the reduction syncs them); rank 0 speaks for all.
            step_seconds[role].append(statistics.median(replies[0]["step_seconds"]))
            if tx_before is not None:
                lo_tx[role].append((_lo_tx_bytes() - tx_before) / (args.steps + args.warmup))
            if role in KDIST_ROLES:
                kdist_wire[role].append(replies[0]["gradient_wire_bytes"] / replies[0]["num_steps"])
    throughput = {role: [global_batch / s for s in values] for role, values in step_seconds.items()}
    med = {role: statistics.median(values) for role, values in throughput.items()}

    def paired(numerator, denominator):
        if numerator not in throughput or denominator not in throughput:
            return None
        pairs = zip(throughput[numerator], throughput[denominator])
        return round(statistics.median(k / d for k, d in pairs), 3)

    pairs = [("kdist_fp32", "keras316_ddp"), ("kdist_bf16", "keras316_ddp"), ("kdist_bf16", "kdist_fp32"),
             ("kdist_fp32", "torch_ddp")]
    ratios = {f"{a}/{b}": _ratio(med.get(a), med.get(b)) for a, b in pairs}
    targets = {
        "kdist_fp32/keras316_ddp": 1.0,
        # bf16: 1.4x Keras on the throttled link. Compression is off by default,
        # so the default is never slower than fp32; bf16 itself is reported on both links.
        "kdist_bf16/keras316_ddp": 1.4 if link == "throttled" else None,
        "kdist_bf16/kdist_fp32": None,
        # For information: a Keras fit against a bare torch loop. The target
        # (>= 0.95 of DDP's scaling efficiency, each against its own one-process
        # run) is measured by multiworker_scaling.py.
        "kdist_fp32/torch_ddp": None,
    }
    ddp_formula = round(_gradient_bytes(hidden_units) * 2 * (WORLD_SIZE - 1) / WORLD_SIZE)
    wire = {role: round(statistics.median(values)) for role, values in kdist_wire.items()}
    wire.update({role: ddp_formula for role in ("keras316_ddp", "torch_ddp") if role in groups})
    line = {
        "config": config,
        "link": LINKS[link],
        "world_size": WORLD_SIZE,
        "model": f"MLP {INPUT_FEATURES}-{hidden_units}-{hidden_units}-{NUM_CLASSES} relu, Adam(1e-3), sparse CE from logits",
        "gradient_bytes": _gradient_bytes(hidden_units),
        "global_batch": global_batch,
        "samples_per_sec": {role: round(value, 1) for role, value in med.items()},
        "step_ms": {role: round(1000 * statistics.median(v), 2) for role, v in step_seconds.items()},
        "step_ms_by_round": {role: [round(1000 * s, 2) for s in v] for role, v in step_seconds.items()},
        "ratios": ratios,
        "paired_ratio_median": {f"{a}/{b}": paired(a, b) for a, b in pairs},
        "targets": targets,
        "meets_target": {
            key: None if target is None or ratios[key] is None else ratios[key] >= target
            for key, target in targets.items()
        },
        # kdist: counted by ProcessCollectives.statistics (ring formula per bucket); DDP: the same formula.
        "wire_bytes_per_step": wire,
        "kdist_bucket_bytes": facts["kdist_fp32"].get("bucket_bytes"),
        "kdist_options": {role: facts[role] for role in KDIST_ROLES if role in facts},
        "keras316_ddp_bucket_bytes": 25 * 2**20 if "keras316_ddp" in groups else None,
        "keras316_ddp_wrapped": facts.get("keras316_ddp", {}).get("ddp_wrapped"),
        "worker_keras": facts["kdist_fp32"].get("keras"),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "warmup_steps_per_round": args.warmup,
    }
    if link == "throttled":
        # Everything both ranks sent over the namespace's lo per fit step, warm-up and fit start included.
        line["lo_tx_bytes_per_step"] = {role: round(statistics.median(v)) for role, v in lo_tx.items()}
    return line


def measure_link(link, args, python, with_keras, emit):
    """Starts one group per role, measures every configuration on this link, stops the groups."""
    script = os.path.abspath(__file__)
    roles = [role for role in ROLES if with_keras or role != "keras316_ddp"]
    groups = {}
    try:
        # All groups start together (start-up is not timed), then stay up for every round.
        for role in roles:
            groups[role] = WorkerGroup(f"{link}_{role}", [python, script, "--role", role], WORLD_SIZE)
        for group in groups.values():
            group.receive(STARTUP_SECONDS)
        for config in args.configs:
            emit(measure_config(groups, config, link, args))
    finally:
        for group in groups.values():
            group.close()


def run_throttled(argv, args):
    """Re-runs this driver inside a private network namespace with a 2 Gbit/s lo; returns its exit code."""
    from kdist.launch.child import make_preexec

    def skip(why):
        print(json.dumps({"benchmark": "ddp_comparison", "link": "throttled", "skipped": why}), flush=True)
        return 0

    probe = ["unshare", "-n", "--", "sh", "-c", THROTTLE]
    try:
        result = subprocess.run(probe, capture_output=True, text=True, timeout=PROBE_SECONDS)
    except (OSError, subprocess.SubprocessError) as error:
        return skip(f"{shlex.join(probe)} failed: {type(error).__name__}: {error}")
    if result.returncode:
        return skip(f"{shlex.join(probe)} failed with exit code {result.returncode}: {result.stderr.strip()[-500:]}")
    inner = shlex.join([sys.executable, os.path.abspath(__file__), *argv, "--inside-namespace"])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([kdist_root()] + [p for p in [env.get("PYTHONPATH")] if p])
    # stdout is inherited: the inner driver prints its own lines. It dies with this process (preexec).
    deadline = (600 if args.quick else 1800) * len(args.configs)
    try:
        return subprocess.run(
            ["unshare", "-n", "--", "sh", "-c", f"{THROTTLE} && exec {inner}"], env=env, timeout=deadline,
            preexec_fn=make_preexec(),
        ).returncode
    except subprocess.TimeoutExpired:
        print(f"ddp_comparison: the throttled run missed its {deadline} s deadline and was killed", file=sys.stderr)
        return 1


def parse_args(argv=None):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=ROLES, help=argparse.SUPPRESS)
    parser.add_argument("--inside-namespace", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run, about 1 minute")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 5; 2 with --quick)")
    parser.add_argument("--steps", type=int, help="timed steps per round (default 20; 4 with --quick)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated (default %(default)s)")
    parser.add_argument("--links", default=",".join(LINKS), help="comma-separated (default %(default)s)")
    parser.add_argument(
        "--keras316-python", default=os.path.normpath(os.path.join(repo, "..", "venv316", "bin", "python")),
        help="Python with Keras 3.16.0 for the kdist and Keras DDP roles (default %(default)s)",
    )
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.steps = args.steps or (4 if args.quick else 20)
    args.warmup = 2 if args.quick else 3
    args.configs = [c for c in args.configs.split(",") if c]
    args.links = [link for link in args.links.split(",") if link]
    unknown = [c for c in args.configs if c not in CONFIGS] + [link for link in args.links if link not in LINKS]
    if args.rounds < 1 or args.steps < 2 or unknown or not args.configs:
        parser.error(
            f"--rounds must be >= 1, --steps >= 2, --configs among {list(CONFIGS)}, --links among {list(LINKS)}. "
            f"Received: --rounds={args.rounds} --steps={args.steps} --configs={args.configs} --links={args.links}."
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.role:
        run_worker(args.role)
        return 0
    import kdist  # noqa: F401  (the driver only orchestrates; imported for free_port and versions)

    reason = check_keras316(args.keras316_python)
    if reason and not args.inside_namespace:  # the outer driver already said so
        print(json.dumps({"benchmark": "ddp_comparison", "what": "keras316_ddp", "skipped": reason}), flush=True)
    python = sys.executable if reason else args.keras316_python
    commit = git_commit()

    def emit(line):
        env = environment(torch_threads_per_process=1, backend="gloo", worker_python=python)
        print(json.dumps({"benchmark": "ddp_comparison", **line, "environment": env, "commit": commit}), flush=True)

    if args.inside_namespace:
        measure_link("throttled", args, python, reason is None, emit)
        return 0
    if "plain" in args.links:
        measure_link("plain", args, python, reason is None, emit)
    if "throttled" in args.links:
        # The inner driver runs the throttled link only, with the same settings.
        inner_argv = ["--rounds", str(args.rounds), "--steps", str(args.steps), "--configs", ",".join(args.configs),
                      "--keras316-python", args.keras316_python] + (["--quick"] if args.quick else [])
        return run_throttled(inner_argv, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
