"""How long kdist takes to recover from a lost process: kill -9 to the first training step after it.

Each case is a real job under `kdist launch ... --max-restarts 1` training a ~2 MB
model (Dense 256-1024-256-10, 528,650 float32 parameters, Adam) with
`keras.callbacks.BackupAndRestore(save_freq=S)`. One process SIGKILLs itself right
after a global step drawn by a seeded RNG (its first run only); the launcher
restarts the job (or, with `--ps`, the process alone) and `fit` resumes from the backup.
The trainers time themselves and write one JSON line per run to a file: the process
start (`/proc/self/stat`), the script's first line, after `import kdist, keras,
torch`, after the strategy is created (torch.distributed rendezvous, or the
connection to the parameter servers), the start of `fit`'s training (after the
backup was read), and the end of the first step. One JSON line per case:

Cases: rank 0 and rank 1 of a 2-process `MultiWorkerMirroredStrategy` job
(`mwms2_rank0` is the target), a between-graph worker (`--workers 1 --ps 1`), and in
coordinator training (`--ps 1 --workers 1 --chief --ps-checkpoint-every 1`) the ps
(killed by the chief; it restores its checkpoint) and the chief itself.

- `recovery_seconds`: from the kill (the killer's clock just before `os.kill`) to
  the end of the first step after it (rank 0's, or the chief's).
- `steps_lost`: steps trained before the kill that are trained again (the kill
  step minus the steps the resumed backup holds).
- `recovery_breakdown`: `detect_and_restart_or_launch` (kill to the restarted
  process's start: the launcher sees the death, stops the other processes and starts
  the new ones at once, forked from its zygote (`kdist.launch.warm`)), `startup` (process start to the strategy
  created), split into `interpreter`, `imports` and `rendezvous`, then
  `restore` (model built, backup read) and `first_step` (steps the backup holds
  skipped, one step trained).
- `cold_start_seconds`: the same job's first run, from `Popen` of the launcher to
  the end of its first step, with the same breakdown (`cold_start_breakdown`).
  `recovery_vs_cold_start` = `recovery_seconds / cold_start_seconds`: the
  baseline, measured in the same invocation.
- `target_seconds` (15 for the 2-process job), `meets_target`.

Values are medians over `--rounds` rounds; `*_by_round` keep every round. Cases
run interleaved per round, so a change in load hits every case alike. The last
line, `recovery_summary`, gives the target case's median and verdict.

Usage:

    PYTHONPATH=. python benchmarks/recovery.py           # 2 rounds of every case: about 3 minutes on 2 cores
    PYTHONPATH=. python benchmarks/recovery.py --quick   # 1 round of the 2-process job: about 30 s
"""

import os
import sys
import time

# Keras reads the backend once, at import time (the driver imports it for the report).
os.environ.setdefault("KERAS_BACKEND", "torch")
# The process's first timestamp, before any import (the trainers report it).
SCRIPT_STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 24
INPUT_DIM, HIDDEN, BOTTLENECK, CLASSES = 256, 1024, 256, 10
NUM_SAMPLES, GLOBAL_BATCH = 2048, 64
STEPS_PER_EPOCH = NUM_SAMPLES // GLOBAL_BATCH  # 32
EPOCHS = 2
SAVE_FREQ = 4
TARGET_SECONDS = 15.0
TARGET_CASE = "mwms2_rank0"
JOB_TIMEOUT_SECONDS = 240  # a hang fails the benchmark, with the launcher's output
COLLECTIVE_TIMEOUT_SECONDS = 60.0

COORDINATOR = ["--ps", "1", "--workers", "1", "--chief", "--ps-checkpoint-every", "1"]
# name: (launcher arguments, the process killed, mode, save_freq). A parameter-server
# fit resumes at an epoch's start (Keras' behaviour), so its case saves every epoch.
CASES = {
    "mwms2_rank0": (["--nproc", "2"], "worker-0", "mwms", SAVE_FREQ),
    "mwms2_rank1": (["--nproc", "2"], "worker-1", "mwms", SAVE_FREQ),
    "between_graph_worker": (["--workers", "1", "--ps", "1"], "worker-0", "ps", "epoch"),
    # Coordinator training, one worker, one closure in flight: the chief kills the ps,
    # which comes back from its checkpoint (taken after every push).
    "coordinator_ps": (COORDINATOR, "ps-0", "coordinator", "epoch"),
    # The chief kills itself; --max-restarts restarts it alone and fit restores the
    # backup's epoch (Keras' behaviour); the ps and the worker keep running.
    "coordinator_chief": (COORDINATOR, "chief-0", "coordinator", "epoch"),
}
QUICK_CASES = ("mwms2_rank0",)
PHASES = ("interpreter", "imports", "rendezvous", "restore", "first_step")


# ----- trainer side (`--role trainer`, one process of the job) ------------------------
def process_start_time():
    """This process's start (exec) as a Unix time, to a clock tick (10 ms).

    /proc/self/stat gives it in ticks since boot; `CLOCK_BOOTTIME` is the same
    clock now (/proc/stat's `btime` is whole seconds only, too coarse here).
    """
    with open("/proc/self/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime: field 22 of the line
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot)


def run_trainer(args):
    timeline = {"process_started": process_start_time(), "script_started": SCRIPT_STARTED}
    import kdist
    import keras
    import numpy as np
    import torch

    timeline["imported"] = time.time()
    if args.mode == "mwms":
        strategy = kdist.MultiWorkerMirroredStrategy(
            communication_options=kdist.CommunicationOptions(timeout_seconds=COLLECTIVE_TIMEOUT_SECONDS)
        )
        name, shuffle = f"worker-{strategy.extended.collectives.rank}", True
    else:
        resolver = kdist.cluster.TFConfigClusterResolver()
        name, shuffle = f"{resolver.task_type}-{resolver.task_id}", False
        with open(os.path.join(args.out, f"task-{name}.pid"), "w") as file:  # this run's pid, by task
            file.write(str(os.getpid()))
        if resolver.task_type in (("ps", "worker") if args.mode == "coordinator" else ("ps",)):
            # A restarted ps restores its checkpoint before it serves.
            server = kdist.distribute.Server(resolver.cluster_spec(), resolver.task_type, resolver.task_id)
            timeline["rendezvous"] = time.time()
            _append(os.path.join(args.out, f"timeline-{name}.jsonl"), timeline)
            server.join()
            return 0
        strategy = kdist.ParameterServerStrategy(resolver)
        if args.mode == "coordinator":
            kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
    timeline["rendezvous"] = time.time()
    # Not keras.utils.set_random_seed: with TensorFlow installed it imports it to seed
    # it too (seconds at every start). Keras' torch backend seeds from Python's generator.
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, INPUT_DIM)).astype("float32")
    y = rng.integers(0, CLASSES, size=NUM_SAMPLES)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((INPUT_DIM,)),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(BOTTLENECK, activation="relu"),
            keras.layers.Dense(CLASSES),
        ])
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    marker = os.path.join(args.out, "killed")
    save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
    first_run = not os.path.exists(marker)
    # Coordinator training: the chief kills the task (a ps); otherwise a process kills itself.
    kills = first_run and (args.mode == "coordinator" or name == args.kill_task)
    callbacks = [
        keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup"), save_freq=save_freq),
        Timeline(timeline, os.path.join(args.out, f"timeline-{name}.jsonl"),
                 kill_step=args.kill_step if kills else None, marker=marker,
                 pid_file=os.path.join(args.out, f"task-{args.kill_task}.pid") if args.mode == "coordinator"
                 else None),
    ]
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=shuffle, verbose=0, callbacks=callbacks)
    return 0


def _timeline_callback_class():
    import keras

    class Timeline(keras.callbacks.Callback):
        """Records when training began and its first step ended; SIGKILLs this process at `kill_step`."""

        def __init__(self, timeline, path, kill_step, marker, pid_file=None):
            super().__init__()
            self.timeline, self.path, self.kill_step, self.marker = timeline, path, kill_step, marker
            self.pid_file = pid_file  # whom to kill; None: this process
            self.epoch, self.seen = 0, 0

        def on_train_begin(self, logs=None):  # after BackupAndRestore's (listed first) restore
            self.timeline["train_begin"] = time.time()

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            now = time.time()
            if self.seen == 1:
                self.timeline["first_step"] = now
                # Keras numbers a resumed epoch's steps from the step the backup holds.
                self.timeline["first_global_step"] = self.epoch * STEPS_PER_EPOCH + batch + 1
                _append(self.path, self.timeline)
            if self.kill_step is not None and self.seen == self.kill_step + 1:
                # The chief's first step after it killed a ps: it needed the ps back.
                _append(os.path.join(os.path.dirname(self.path), "recovered.jsonl"), {"first_step": now})
            if self.seen == self.kill_step:
                killed_at = time.time()
                with open(self.marker, "x") as file:
                    file.write(json.dumps({"step": self.kill_step, "time": killed_at}))
                if self.pid_file is None:
                    os.kill(os.getpid(), signal.SIGKILL)
                with open(self.pid_file) as file:
                    os.kill(int(file.read()), signal.SIGKILL)

    return Timeline


def _append(path, record):
    with open(path, "a") as file:
        file.write(json.dumps(record) + "\n")


def Timeline(*args, **kwargs):  # noqa: N802  (built once Keras is imported, in the trainer only)
    return _timeline_callback_class()(*args, **kwargs)


# ----- driver side --------------------------------------------------------------------
def kill_steps(case, rounds):
    """The case's kill step per round: seeded, after its first backup, before the last step.

    Cases that save every epoch are killed in the second epoch; the others in the first.
    """
    rng = random.Random(f"{SEED}/{case}")
    if CASES[case][3] == "epoch":
        return [rng.randrange(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH) for _ in range(rounds)]
    return [rng.randrange(SAVE_FREQ + 1, STEPS_PER_EPOCH) for _ in range(rounds)]


def run_case(case, kill_step, directory):
    """Runs one job; returns its `timelines` (per process, per run), the `killed` record, the `launched`
    time, the chief's first step after a ps came back (`recovered`) and the launcher's `log`."""
    launch_args, victim, mode, save_freq = CASES[case]
    command = [
        sys.executable, "-m", "kdist", "launch", *launch_args, "--max-restarts", "1",
        "--timeout", str(JOB_TIMEOUT_SECONDS - 10), os.path.abspath(__file__), "--role", "trainer",
        "--out", directory, "--mode", mode, "--kill-task", victim, "--kill-step", str(kill_step),
        "--save-freq", str(save_freq),
    ]
    environ = dict(os.environ, KERAS_BACKEND="torch",
                   PYTHONPATH=os.pathsep.join(filter(None, [REPOSITORY, os.environ.get("PYTHONPATH")])))
    launched = time.time()
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=JOB_TIMEOUT_SECONDS)
    if result.returncode != 0:
        raise RuntimeError(f"case {case}: kdist launch exited {result.returncode}\n{result.stderr[-4000:]}")
    timelines = {}
    for file_name in os.listdir(directory):
        if file_name.startswith("timeline-"):
            with open(os.path.join(directory, file_name)) as file:
                timelines[file_name[len("timeline-"):-len(".jsonl")]] = [json.loads(line) for line in file]
    with open(os.path.join(directory, "killed")) as file:
        killed = json.load(file)
    recovered = None
    recovered_path = os.path.join(directory, "recovered.jsonl")
    if os.path.exists(recovered_path):
        with open(recovered_path) as file:
            recovered = json.loads(file.readline())
    return {"timelines": timelines, "killed": killed, "launched": launched, "recovered": recovered,
            "log": result.stderr}


def breakdown(run, started):
    """Phase durations of one run of a process; `started` is where its first phase begins."""
    return {
        "detect_and_restart_or_launch": run["process_started"] - started,
        "interpreter": run["script_started"] - run["process_started"],
        "imports": run["imported"] - run["script_started"],
        "rendezvous": run["rendezvous"] - run["imported"],
        "startup": run["rendezvous"] - run["process_started"],
        "restore": run["train_begin"] - run["rendezvous"],
        "first_step": run["first_step"] - run["train_begin"],
    }


def measure_round(case, kill_step, directory):
    job = run_case(case, kill_step, directory)
    timelines, killed, launched = job["timelines"], job["killed"], job["launched"]
    if CASES[case][1].startswith("ps-"):
        return _measure_ps_round(case, job)
    trainer = "chief-0" if CASES[case][2] == "coordinator" else "worker-0"
    chief = timelines.get(trainer, [])
    if len(chief) != 2:
        raise RuntimeError(f"case {case}: expected 2 runs of {trainer}, got {len(chief)}: {timelines}")
    cold, resumed = chief
    return {
        "kill_step": killed["step"],
        "recovery_seconds": resumed["first_step"] - killed["time"],
        "cold_start_seconds": cold["first_step"] - launched,
        "steps_lost": killed["step"] - (resumed["first_global_step"] - 1),
        "recovery_breakdown": breakdown(resumed, killed["time"]),
        "cold_start_breakdown": breakdown(cold, launched),
        "restarted_processes": sorted(name for name, runs in timelines.items() if len(runs) == 2),
    }


LOST_PUSHES = re.compile(r"(ps-\d+) restored its checkpoint of push \d+ .*; (\d+) pushes applied after it are lost")


def _measure_ps_round(case, job):
    """A ps killed by the chief: the restarted ps's start-up, then the chief's first step after the kill."""
    victim, timelines, killed = CASES[case][1], job["timelines"], job["killed"]
    runs = timelines.get(victim, [])
    lost = LOST_PUSHES.search(job["log"])
    if len(runs) != 2 or job["recovered"] is None or lost is None:
        raise RuntimeError(f"case {case}: {victim} ran {len(runs)} times, recovered={job['recovered']}, "
                           f"restore logged: {lost is not None}\n{job['log'][-4000:]}")
    restarted, chief = runs[1], timelines["chief-0"][0]
    first_step = job["recovered"]["first_step"]
    return {
        "kill_step": killed["step"],
        "recovery_seconds": first_step - killed["time"],
        "cold_start_seconds": chief["first_step"] - job["launched"],
        # Updates applied after the ps's last checkpoint: the work lost, in pushes (steps).
        "steps_lost": int(lost.group(2)),
        "recovery_breakdown": {
            "detect_and_restart_or_launch": restarted["process_started"] - killed["time"],
            "interpreter": restarted["script_started"] - restarted["process_started"],
            "imports": restarted["imported"] - restarted["script_started"],
            "rendezvous": restarted["rendezvous"] - restarted["imported"],  # checkpoint restored, serving
            "startup": restarted["rendezvous"] - restarted["process_started"],
            "restore": 0.0,  # in "rendezvous": a ps restores before it serves
            "first_step": first_step - restarted["rendezvous"],
        },
        "cold_start_breakdown": breakdown(chief, job["launched"]),
        "restarted_processes": sorted(name for name, runs in timelines.items() if len(runs) == 2),
    }


def _median_of(rounds, key):
    return round(statistics.median(r[key] for r in rounds), 3)


def _median_breakdown(rounds, key):
    phases = rounds[0][key]
    return {phase: round(statistics.median(r[key][phase] for r in rounds), 3) for phase in phases}


def case_line(case, rounds, common):
    launch_args, victim, mode, save_freq = CASES[case]
    recovery, cold = _median_of(rounds, "recovery_seconds"), _median_of(rounds, "cold_start_seconds")
    target = TARGET_SECONDS if case == TARGET_CASE else None
    return {
        "benchmark": "recovery",
        "what": "recovery",
        "case": case,
        "command": f"kdist launch {' '.join(launch_args)} --max-restarts 1",
        "killed": victim,
        "save_freq": save_freq,
        "recovery_seconds": recovery,
        "steps_lost": _median_of(rounds, "steps_lost"),
        "recovery_breakdown": _median_breakdown(rounds, "recovery_breakdown"),
        "cold_start_seconds": cold,
        "cold_start_breakdown": _median_breakdown(rounds, "cold_start_breakdown"),
        "recovery_vs_cold_start": round(recovery / cold, 3),
        "target_seconds": target,
        "meets_target": None if target is None else recovery < target,
        "kill_step_by_round": [r["kill_step"] for r in rounds],
        "steps_lost_by_round": [r["steps_lost"] for r in rounds],
        "recovery_seconds_by_round": [round(r["recovery_seconds"], 3) for r in rounds],
        "cold_start_seconds_by_round": [round(r["cold_start_seconds"], 3) for r in rounds],
        "restarted_processes": rounds[0]["restarted_processes"],
        **common,
    }


def summary_line(lines, common):
    target = next((line for line in lines if line["case"] == TARGET_CASE), None)
    return {
        "benchmark": "recovery",
        "what": "recovery_summary",
        "target_case": TARGET_CASE,
        "recovery_seconds": None if target is None else target["recovery_seconds"],
        "startup_seconds": None if target is None else target["recovery_breakdown"]["startup"],
        "target_seconds": TARGET_SECONDS,
        "met": None if target is None else target["meets_target"],
        **common,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round of the 2-process job")
    parser.add_argument("--rounds", type=int, help="rounds (default 2; 1 with --quick)")
    parser.add_argument("--cases", help=f"comma-separated, from {', '.join(CASES)} (default: all)")
    parser.add_argument("--role", choices=["driver", "trainer"], default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["mwms", "ps", "coordinator"], help=argparse.SUPPRESS)
    parser.add_argument("--kill-task", help=argparse.SUPPRESS)
    parser.add_argument("--kill-step", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--save-freq", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "trainer":
        return run_trainer(args)

    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 2)
    if rounds < 1:
        parser.error(f"--rounds must be at least 1. Received: --rounds={rounds}.")
    cases = args.cases.split(",") if args.cases else list(QUICK_CASES if args.quick else CASES)
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        parser.error(f"--cases must name cases from {', '.join(CASES)}. Received: {', '.join(unknown)}.")
    steps = {case: kill_steps(case, rounds) for case in cases}
    by_case = {case: [] for case in cases}
    for index in range(rounds):
        for case in cases:
            with tempfile.TemporaryDirectory(prefix="kdist-recovery-") as directory:
                by_case[case].append(measure_round(case, steps[case][index], directory))

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _report import environment, git_commit

    common = {"rounds": rounds, "environment": environment(), "commit": git_commit()}
    lines = [case_line(case, by_case[case], common) for case in cases]
    for line in [*lines, summary_line(lines, common)]:
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
