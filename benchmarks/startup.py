"""How fast the `kdist` command starts: `kdist --help`, and `kdist launch` until its child runs.

Measurements, each over `--rounds` rounds (interleaved, so a change in load
hits every measurement alike), reported as the median in seconds:

- `cli_help`: wall time of `kdist --help` (the console script next to this
  Python, else `python -m kdist`), from `subprocess.run` to its exit.
  Target: under 0.3 s.
- `launch_to_child`: `kdist launch --nproc 1 child.py` started with
  `subprocess.Popen`; the child's first line writes `time.time()` to a file.
  The time is from just before `Popen` to that timestamp: the launcher's own
  start-up, its checks, and the child's interpreter start. Target: under 0.5 s.
- `python_floor` (context, no target): `python -c pass` run the same way, and
  `python child.py` from `Popen` to its first line: what any launcher costs
  at least. `cli_help` and `launch_to_child` report their ratio to it.
- `full_import` (context, no target): `python -c "import kdist;
  kdist.MirroredStrategy"`, what loading Keras, torch and kdist's engine costs:
  what the command no longer pays.

Every line is JSON: `{"benchmark": "startup", "what": ..., "seconds": ...,
"seconds_by_round": [...], "target": ..., "meets_target": ..., "environment":
{...}, "commit": ...}`.

```bash
python benchmarks/startup.py           # 7 rounds, about 40 s on 2 CPU cores
python benchmarks/startup.py --quick   # 2 rounds
```
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _report import environment, git_commit  # benchmarks/ is on sys.path

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELP_TARGET_SECONDS = 0.3
LAUNCH_TARGET_SECONDS = 0.5
# Each command below takes seconds at most; a hang is reported, not waited on.
COMMAND_TIMEOUT_SECONDS = 120
CHILD = "import time; open({path!r}, 'w').write(repr(time.time()))\n"


def kdist_command():
    """The `kdist` console script installed beside this Python, else `python -m kdist`."""
    script = os.path.join(os.path.dirname(sys.executable), "kdist")
    if os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-m", "kdist"]


def child_environment():
    environ = dict(os.environ)
    # As a user's checkout: kdist importable from the repository without installing it.
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPOSITORY, environ.get("PYTHONPATH")]))
    return environ


def time_run(command):
    started = time.perf_counter()
    subprocess.run(command, env=child_environment(), stdout=subprocess.DEVNULL, check=True,
                   timeout=COMMAND_TIMEOUT_SECONDS)
    return time.perf_counter() - started


def time_to_first_line(command_for, directory):
    """Seconds from `Popen(command)` to the child script's first line; waits for the exit."""
    stamp = os.path.join(directory, "stamp")
    script = os.path.join(directory, "child.py")
    with open(script, "w") as handle:
        handle.write(CHILD.format(path=stamp))
    if os.path.exists(stamp):
        os.remove(stamp)
    started = time.time()
    process = subprocess.Popen(command_for(script), env=child_environment(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    returncode = process.wait(COMMAND_TIMEOUT_SECONDS)
    if returncode != 0:
        raise RuntimeError(f"{command_for(script)} exited {returncode}")
    with open(stamp) as handle:
        return float(handle.read()) - started


def measure(rounds, full_import):
    kdist = kdist_command()
    measurements = {
        "cli_help": lambda directory: time_run([*kdist, "--help"]),
        "python_floor_run": lambda directory: time_run([sys.executable, "-c", "pass"]),
        "launch_to_child": lambda directory: time_to_first_line(
            lambda script: [*kdist, "launch", "--nproc", "1", script], directory
        ),
        "python_floor_first_line": lambda directory: time_to_first_line(
            lambda script: [sys.executable, script], directory
        ),
    }
    if full_import:
        measurements["full_import"] = lambda directory: time_run(
            [sys.executable, "-c", "import kdist; kdist.MirroredStrategy"]
        )
    by_round = {name: [] for name in measurements}
    with tempfile.TemporaryDirectory(prefix="kdist-startup-") as directory:
        for name, run in measurements.items():  # Warm-up: the page cache, .pyc files.
            run(directory)
        for _ in range(rounds):
            for name, run in measurements.items():
                by_round[name].append(run(directory))
    return kdist, by_round


def report(kdist, by_round, rounds):
    common = {"rounds": rounds, "environment": environment(), "commit": git_commit()}
    median = {name: statistics.median(values) for name, values in by_round.items()}
    lines = [
        ("cli_help", [*kdist, "--help"], HELP_TARGET_SECONDS, "python_floor_run"),
        ("launch_to_child", [*kdist, "launch", "--nproc", "1", "child.py"], LAUNCH_TARGET_SECONDS,
         "python_floor_first_line"),
        ("python_floor_run", [sys.executable, "-c", "pass"], None, None),
        ("python_floor_first_line", [sys.executable, "child.py"], None, None),
        ("full_import", [sys.executable, "-c", "import kdist; kdist.MirroredStrategy"], None, None),
    ]
    for what, command, target, floor in lines:
        if what not in median:
            continue
        line = {
            "benchmark": "startup",
            "what": what,
            "command": " ".join(os.path.basename(part) if part == sys.executable else part
                                for part in command),
            "seconds": round(median[what], 4),
            "seconds_by_round": [round(value, 4) for value in by_round[what]],
            "target": target,
            "meets_target": None if target is None else median[what] < target,
            "ratio_to_python_floor": None if floor is None else round(median[what] / median[floor], 2),
            **common,
        }
        print(json.dumps(line), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds")
    parser.add_argument("--rounds", type=int, help="rounds (default 7; 2 with --quick)")
    parser.add_argument("--no-full-import", action="store_true",
                        help="skip the full-import context measurement (seconds per round)")
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 7)
    if rounds < 1:
        parser.error(f"--rounds must be at least 1. Received: --rounds={rounds}.")
    kdist, by_round = measure(rounds, full_import=not args.no_full_import)
    report(kdist, by_round, rounds)


if __name__ == "__main__":
    main()
