"""Data-parallel training over the GPUs of one machine: kdist's two engines against plain Keras and Keras' own DDP.

A ResNet-style convnet and a transformer block on synthetic data, per-GPU batch B, on
the N visible GPUs: `plain` (plain Keras on 1 GPU, the baseline); `mirrored`
(`kdist.MirroredStrategy` in one process over N GPUs); `kdist_fp32`, `kdist_bf16`
(`kdist launch --nproc N` running `kdist.MultiWorkerMirroredStrategy` on NCCL,
gradients sent in fp32 or `kdist.Compression.bf16`); `keras316_ddp` (the same launcher
running plain Keras 3.16, which wraps the model in `DistributedDataParallel` itself;
each rank fits its slice of every global batch; it needs `--keras316-python`, else the
line says why it was skipped). All configurations run under that one worker Python
when it is usable, so the ratios compare engines, not Keras releases.

Each configuration runs in its own processes and measures every model in turn: per
round, one window of `--steps` steps after `--warmup` untimed ones, bracketed by a
synchronisation of every GPU the process drives. One JSON line per model: samples/s
(median of rounds), scaling efficiency (`samples/s / (N * plain's)`) and the ratios;
benchmarks/README.md explains every field. Without a GPU it prints one JSON line
saying nothing was measured and exits 0; `--device cpu` runs every code path but NCCL
on the CPU (gloo, logical replicas "cpu:0", "cpu:1"), as the tests do.

Usage:

    python benchmarks/gpu_scaling.py                       # every visible GPU
    python benchmarks/gpu_scaling.py --quick               # tiny models, a few steps
    python benchmarks/gpu_scaling.py --device cpu --quick  # CPU smoke run, 2 logical GPUs, ~20 s
"""

import os

# Keras reads the backend once, at import time.
os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from _workers import MESSAGE_MARKER, kdist_root, reply  # noqa: E402  (benchmarks/ is on sys.path)

NUM_CLASSES = 10
MODELS = ("convnet", "transformer")
ONE_PROCESS_CONFIGS = ("plain", "mirrored")
LAUNCHED_CONFIGS = ("kdist_fp32", "kdist_bf16", "keras316_ddp")
# Configurations that run no kdist code: the only ones retried (once) after a failure.
BASELINE_CONFIGS = ("keras316_ddp",)
CONFIGS = ONE_PROCESS_CONFIGS + LAUNCHED_CONFIGS
# "full" is the GPU workload; "tiny" keeps every layer of "full" but shrinks the
# tensors so compute is negligible (replica_host_time.py measures host time with it);
# "quick" is smaller still in layers, for smoke runs.
SIZES = {
    "full": {
        "convnet": dict(image_size=32, widths=(64, 128, 256), blocks_per_stage=2, per_device_batch=128),
        "transformer": dict(sequence_length=256, model_dim=512, num_heads=8, feedforward_dim=2048, num_blocks=2,
                            vocabulary_size=8192, per_device_batch=32),
    },
    "tiny": {
        "convnet": dict(image_size=8, widths=(4, 4, 4), blocks_per_stage=2, per_device_batch=2),
        "transformer": dict(sequence_length=4, model_dim=16, num_heads=8, feedforward_dim=16, num_blocks=2,
                            vocabulary_size=32, per_device_batch=2),
    },
    "quick": {
        "convnet": dict(image_size=8, widths=(8, 16), blocks_per_stage=1, per_device_batch=4),
        "transformer": dict(sequence_length=8, model_dim=16, num_heads=2, feedforward_dim=32, num_blocks=1,
                            vocabulary_size=64, per_device_batch=4),
    },
}
# Deadlines: a collective that waits longer fails its job; a job that runs longer is killed.
COLLECTIVE_TIMEOUT_SECONDS = 120.0
JOB_TIMEOUT_SECONDS = {"full": 900, "quick": 300}
LAUNCH_GRACE_SECONDS = 10
NO_GPU = ("no GPU: torch sees no CUDA device, so nothing was measured. Run it on a machine with GPUs, "
          "or `--device cpu --quick` for the CPU smoke run.")
RATIOS = (("kdist_fp32", "keras316_ddp"), ("kdist_bf16", "keras316_ddp"), ("kdist_bf16", "kdist_fp32"),
          ("mirrored", "kdist_fp32"))


# ----- models (replica_host_time.py builds the same ones) ----------------------------
def build_convnet(keras, image_size, widths, blocks_per_stage, **_):
    """A ResNet-style convnet: stages of residual blocks (conv-BN-relu-conv-BN + shortcut)."""
    layers = keras.layers
    inputs = keras.Input((image_size, image_size, 3))
    x = layers.Conv2D(widths[0], 3, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    for stage, width in enumerate(widths):
        for block in range(blocks_per_stage):
            strides = 2 if stage > 0 and block == 0 else 1
            y = layers.Conv2D(width, 3, strides=strides, padding="same", use_bias=False)(x)
            y = layers.ReLU()(layers.BatchNormalization()(y))
            y = layers.BatchNormalization()(layers.Conv2D(width, 3, padding="same", use_bias=False)(y))
            shortcut = x
            if strides != 1 or x.shape[-1] != width:
                shortcut = layers.Conv2D(width, 1, strides=strides, use_bias=False)(x)
                shortcut = layers.BatchNormalization()(shortcut)
            x = layers.ReLU()(layers.Add()([y, shortcut]))
    outputs = layers.Dense(NUM_CLASSES)(layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, outputs, name="convnet")


def build_transformer(keras, sequence_length, model_dim, num_heads, feedforward_dim, num_blocks, vocabulary_size, **_):
    """Token embedding, then post-norm transformer blocks (MultiHeadAttention, LayerNormalization, Dense)."""
    layers = keras.layers
    inputs = keras.Input((sequence_length,), dtype="int32")
    x = layers.Embedding(vocabulary_size, model_dim)(inputs)
    for _ in range(num_blocks):
        attended = layers.MultiHeadAttention(num_heads, model_dim // num_heads)(x, x)
        x = layers.LayerNormalization()(layers.Add()([x, attended]))
        hidden = layers.Dense(feedforward_dim, activation="gelu")(x)
        x = layers.LayerNormalization()(layers.Add()([x, layers.Dense(model_dim)(hidden)]))
    outputs = layers.Dense(NUM_CLASSES)(layers.GlobalAveragePooling1D()(x))
    return keras.Model(inputs, outputs, name="transformer")


def build_model(keras, model_name, spec):
    """The compiled benchmark model: Adam(1e-3), sparse CE from logits, accuracy."""
    model = (build_convnet if model_name == "convnet" else build_transformer)(keras, **spec)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def synthetic_data(model_name, spec, num_samples):
    """`(x, y)` as numpy arrays: random images or token ids, random labels."""
    import numpy as np

    rng = np.random.default_rng(0)
    if model_name == "convnet":
        x = rng.standard_normal((num_samples, spec["image_size"], spec["image_size"], 3), dtype=np.float32)
    else:
        x = rng.integers(0, spec["vocabulary_size"], size=(num_samples, spec["sequence_length"]), dtype=np.int32)
    return x, rng.integers(0, NUM_CLASSES, size=num_samples)


# ----- worker side: one configuration, in its own process(es) ------------------------
class WindowTimer:
    """A Keras callback's `on_train_batch_end`: times steps `warmup`..`last`, devices synchronised at both ends."""

    def __init__(self, warmup, last, synchronize):
        self.warmup, self.last, self.synchronize = warmup, last, synchronize
        self.times = {}

    def __call__(self, batch, logs=None):
        if batch in (self.warmup - 1, self.last):
            # Without it the host would time how fast it queues kernels, not how fast the GPUs run them.
            self.synchronize()
            self.times[batch] = time.perf_counter()

    @property
    def seconds(self):
        return self.times[self.last] - self.times[self.warmup - 1]


def _worker_setup(args):
    """`(scope, rank, world_size, devices_driven, facts, close)` of this configuration's process."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda" and args.role in LAUNCHED_CONFIGS:
        torch.cuda.set_device(local_rank)  # before anything lands on "cuda"
    import kdist
    import keras

    facts = {"keras": keras.version()}
    if args.role == "plain":
        return contextlib.nullcontext(), 0, 1, [0], facts, lambda: None
    if args.role == "mirrored":
        strategy = kdist.MirroredStrategy(devices=[f"{args.device}:{i}" for i in range(args.num_gpus)])
        return strategy.scope(), 0, 1, list(range(args.num_gpus)), facts, lambda: None
    if args.role == "keras316_ddp":
        import torch.distributed as dist

        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS))
        return contextlib.nullcontext(), dist.get_rank(), dist.get_world_size(), [local_rank], facts, dist.destroy_process_group
    options = {"timeout_seconds": COLLECTIVE_TIMEOUT_SECONDS}
    if args.role == "kdist_bf16":
        options["compression"] = kdist.Compression.bf16
    strategy = kdist.MultiWorkerMirroredStrategy(communication_options=kdist.CommunicationOptions(**options))
    collectives = strategy.extended.collectives
    facts["collectives"] = collectives
    return strategy.scope(), collectives.rank, collectives.world_size, [local_rank], facts, collectives.shutdown


def measure_model(args, model_name, scope, rank, world_size, devices, facts):
    """Samples/s of each round of one model under this process's configuration."""
    import keras
    import torch

    spec = SIZES[args.size][model_name]
    global_batch = spec["per_device_batch"] * args.num_gpus
    num_steps = args.warmup + args.steps
    keras.utils.set_random_seed(0)
    with scope:
        model = build_model(keras, model_name, spec)
    x, y = synthetic_data(model_name, spec, global_batch * num_steps)
    if args.role == "plain":
        fit_batch = global_batch = spec["per_device_batch"]
        x, y = x[: global_batch * num_steps], y[: global_batch * num_steps]
    elif args.role == "keras316_ddp":
        # Rank r fits its contiguous slice of every global batch, as kdist splits it.
        local = global_batch // world_size
        x = x.reshape(num_steps, world_size, local, *x.shape[1:])[:, rank].reshape(-1, *x.shape[1:])
        y = y.reshape(num_steps, world_size, local)[:, rank].reshape(-1)
        fit_batch = local
    else:
        fit_batch = global_batch  # kdist reads the global batch; each replica trains its part

    def synchronize():
        if args.device == "cuda":
            for index in devices:
                torch.cuda.synchronize(index)

    def wire_bytes_so_far():  # what kdist counted on the wire for gradient all-reduces
        stats = getattr(facts.get("collectives"), "statistics", None) or {}
        return sum(getattr(entry, "wire_bytes", 0) for key, entry in stats.items() if "gradients" in key)

    samples_per_sec, wire_bytes = [], []
    for _ in range(args.rounds):
        timer = WindowTimer(args.warmup, num_steps - 1, synchronize)
        sent_before = wire_bytes_so_far()
        model.fit(x, y, batch_size=fit_batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=timer)])
        samples_per_sec.append(global_batch * args.steps / timer.seconds)
        wire_bytes.append((wire_bytes_so_far() - sent_before) / num_steps)
    result = {"samples_per_sec_by_round": samples_per_sec, "num_parameters": int(model.count_params())}
    if "collectives" in facts:
        result["gradient_wire_bytes_per_step"] = statistics.median(wire_bytes)
    if args.role == "keras316_ddp":
        # Proof that Keras' DDP path ran, not an unsynchronised plain fit.
        result["ddp_wrapped"] = getattr(model, "ddp_model", None) is not None
    return result


def run_role(args):
    """The worker: measures every model of `--models` in this configuration; rank 0 replies."""
    scope, rank, world_size, devices, facts, close = _worker_setup(args)
    results = {name: measure_model(args, name, scope, rank, world_size, devices, facts) for name in args.models}
    if rank == 0:
        facts = {key: value for key, value in facts.items() if key != "collectives"}
        reply({"event": "done", "results": results, "world_size": world_size, **facts})
    close()
    return 0


# ----- driver side ----------------------------------------------------------------
def skip_reasons(args, keras316_reason):
    """Config -> why it is not measured, for the configurations this run cannot measure."""
    import kdist

    reasons = {}
    compression = getattr(kdist, "Compression", None)
    fields = {field.name for field in dataclasses.fields(kdist.CommunicationOptions)}
    if compression is None or not hasattr(compression, "bf16") or "compression" not in fields:
        reasons["kdist_bf16"] = ("this kdist has no gradient compression yet (kdist.Compression.bf16 "
                                 "and CommunicationOptions(compression=...))")
    if keras316_reason:
        reasons["keras316_ddp"] = f"Keras 3.16 is not available: {keras316_reason}"
    return {config: reason for config, reason in reasons.items() if config in args.configs}


def job_command(args, config, python):
    """The command that measures `config`: the script itself, or `kdist launch --nproc N` running it."""
    role = [os.path.abspath(__file__), "--role", config, "--device", args.device, "--num-gpus", str(args.num_gpus),
            "--models", ",".join(args.models), "--rounds", str(args.rounds), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--size", args.size]
    if config in ONE_PROCESS_CONFIGS:
        return [python, *role]
    return [python, "-m", "kdist", "launch", "--nproc", str(args.num_gpus), "--grace", str(LAUNCH_GRACE_SECONDS),
            "--timeout", str(args.job_timeout), *role]


def run_job(command, args):
    """Runs one configuration; returns `(reply, None)` or `(None, why it failed)`."""
    from kdist.launch.child import make_preexec

    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONUNBUFFERED="1")
    # The workers import the kdist the driver imported, whichever Python runs them.
    env["PYTHONPATH"] = os.pathsep.join([kdist_root()] + [p for p in [env.get("PYTHONPATH")] if p])
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU run stays on the CPU on a GPU machine too
    try:
        # The launcher's own --timeout stops a hung job first and prints every rank's stack.
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=args.job_timeout + 2 * LAUNCH_GRACE_SECONDS + 30, preexec_fn=make_preexec())
    except subprocess.TimeoutExpired as error:
        return None, f"killed after {error.timeout:.0f} s"
    for line in done.stdout.splitlines():
        # The launcher prefixes every line with "[worker-0] ".
        if MESSAGE_MARKER in line and done.returncode == 0:
            return json.loads(line.split(MESSAGE_MARKER, 1)[1]), None
    sys.stderr.write(f"gpu_scaling: {' '.join(command)} failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}\n")
    last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or [""])[-1]
    return None, f"exit code {done.returncode}: {last[-300:]}"


def _ratio(numerator, denominator):
    return round(numerator / denominator, 3) if numerator and denominator else None


def model_line(args, model_name, replies, skipped, failed):
    """The JSON line of one model (without environment and commit)."""
    measured = {config: reply["results"][model_name] for config, reply in replies.items()}
    rate = {config: statistics.median(r["samples_per_sec_by_round"]) for config, r in measured.items()}
    plain = rate.get("plain")
    n = args.num_gpus
    return {
        "model": model_name,
        "size": args.size,
        "spec": {key: list(v) if isinstance(v, tuple) else v for key, v in SIZES[args.size][model_name].items()},
        "num_parameters": next((r["num_parameters"] for r in measured.values()), None),
        "num_gpus": n,
        "samples_per_sec": {config: round(value, 1) for config, value in rate.items()},
        "samples_per_sec_by_round": {c: [round(v, 1) for v in r["samples_per_sec_by_round"]] for c, r in measured.items()},
        "scaling_efficiency": {config: _ratio(rate[config], plain and n * plain) for config in rate if config != "plain"},
        "ratios": {f"{a}/{b}": _ratio(rate.get(a), rate.get(b)) for a, b in RATIOS},
        "gradient_wire_bytes_per_step": {c: round(r["gradient_wire_bytes_per_step"]) for c, r in measured.items()
                                         if "gradient_wire_bytes_per_step" in r},
        "keras316_ddp_wrapped": measured.get("keras316_ddp", {}).get("ddp_wrapped"),
        "worker_keras": next((reply.get("keras") for reply in replies.values()), None),
        "skipped": skipped,
        "failed": failed,
        "rounds": args.rounds, "steps_per_round": args.steps, "warmup_steps_per_round": args.warmup,
    }


def parse_args(argv=None):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=tuple(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when visible, else report no GPU")
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds of 3 steps")
    parser.add_argument("--num-gpus", type=int, help="GPUs to use (default: every visible one; 2 with --device cpu)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated (default %(default)s)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated (default %(default)s)")
    parser.add_argument("--rounds", type=int, help="timed windows per configuration (default 5; 2 with --quick)")
    parser.add_argument("--steps", type=int, help="timed steps per window (default 30; 3 with --quick)")
    parser.add_argument("--warmup", type=int, help="untimed steps before each window (default 3; 2 with --quick)")
    parser.add_argument("--job-timeout", type=int, help="seconds per configuration (default 900; 300 with --quick)")
    default_python = os.environ.get("KDIST_KERAS316_PYTHON") or os.path.join(repo, "..", "venv316", "bin", "python")
    parser.add_argument("--keras316-python", default=os.path.normpath(default_python),
                        help="Python with Keras 3.16.0; runs every configuration when usable (default %(default)s)")
    args = parser.parse_args(argv)
    args.size = args.size or ("quick" if args.quick else "full")
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.steps = args.steps or (3 if args.quick else 30)
    args.warmup = args.warmup or (2 if args.quick else 3)
    args.job_timeout = args.job_timeout or JOB_TIMEOUT_SECONDS["quick" if args.quick else "full"]
    args.models = [m for m in args.models.split(",") if m]
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [m for m in args.models if m not in MODELS] + [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.models or "plain" not in args.configs or min(args.rounds, args.steps, args.warmup) < 1:
        parser.error(f"--models among {list(MODELS)}, --configs among {list(CONFIGS)} including plain (the "
                     f"baseline), --rounds, --steps and --warmup at least 1. Received: --models={args.models} "
                     f"--configs={args.configs} --rounds={args.rounds} --steps={args.steps} --warmup={args.warmup}.")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.role:
        return run_role(args)
    import torch

    num_visible = torch.cuda.device_count()
    args.device = args.device or ("cuda" if num_visible else None)
    if args.device is None:
        print("gpu_scaling: no GPU (torch sees no CUDA device); nothing was measured.", file=sys.stderr)
        print(json.dumps({"benchmark": "gpu_scaling", "measured": False, "skipped": NO_GPU}), flush=True)
        return 0
    args.num_gpus = args.num_gpus or (num_visible if args.device == "cuda" else 2)
    if args.device == "cuda" and not 1 <= args.num_gpus <= num_visible:
        print(f"gpu_scaling: --num-gpus must be between 1 and {num_visible}. Received: {args.num_gpus}.", file=sys.stderr)
        return 2
    from _report import environment, git_commit
    from ddp_comparison import check_keras316

    keras316_reason = check_keras316(args.keras316_python)
    python = sys.executable if keras316_reason else args.keras316_python
    skipped = skip_reasons(args, keras316_reason)
    replies, failed, retried = {}, {}, {}
    for config in [c for c in args.configs if c not in skipped]:
        answer, why = run_job(job_command(args, config, python), args)
        if why is not None and config in BASELINE_CONFIGS:
            # Upstream's DDP worker sometimes aborts in its own teardown after the
            # run; a baseline is retried once (and says so), kdist's configurations never.
            retried[config] = why
            answer, why = run_job(job_command(args, config, python), args)
        replies.update({config: answer} if why is None else {})
        failed.update({} if why is None else {config: why})
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    env = environment(device=device_name, num_devices=args.num_gpus, worker_python=python,
                      backend="nccl" if args.device == "cuda" else "gloo")
    commit = git_commit()
    for model_name in args.models:
        line = {**model_line(args, model_name, replies, skipped, failed), "retried": retried}
        print(json.dumps({"benchmark": "gpu_scaling", **line, "environment": env, "commit": commit}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
