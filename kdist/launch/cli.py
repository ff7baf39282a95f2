"""The `kdist` command line: `kdist launch` and `kdist server` (also `python -m kdist ...`).

`kdist --help`, `kdist --version` and `kdist launch` import neither Keras nor
torch (nor TensorFlow or JAX), so they start at once: the launcher only starts
the user's script as child processes, which do. `kdist server` (see
`kdist.launch.server_cli`) serves a task in this process: serving imports them,
`kdist server --help` does not.
"""

import argparse
import dataclasses
import functools
import os
import shutil
import signal
import sys
import tempfile
import threading

from kdist import __version__
from kdist.cluster.address import MAX_PORT, is_port
from kdist.errors import InvalidArgumentError
from kdist.launch import failure_report, job_secret, plans, server_cli, warm
from kdist.launch.help_text import LAUNCH_EPILOG
from kdist.launch.cluster_file import add_cluster_argument, parse_task
from kdist.launch.processes import ProcessSet, ProcessSetTimeout

DEFAULT_GRACE_SECONDS = 30.0
# After SIGABRT (stack dump) or a daemon's SIGTERM, how long before SIGKILL.
# faulthandler prints at once; servers get time for a clean shutdown.
KILL_AFTER_SECONDS = 10.0
# Lines of output kept in memory per process (they are echoed as they come,
# and every line is in the process's log file).
KEEP_LINES = 1000
# Without --log-dir, the logs go to a new directory in the temporary directory
# (as torchrun's do), kept when the job fails so the summary can name them.
LOG_DIR_PREFIX = "kdist-launch-"
# Under the log directory: the parameter servers' checkpoints, unless --ps-checkpoint-dir.
PS_CHECKPOINT_DIR_NAME = "ps-checkpoints"
EXIT_USAGE = 2
EXIT_TIMEOUT = 124  # As coreutils' `timeout`.
# SIGHUP too (the terminal closed): the launcher then stops the job and removes
# the job's secret file instead of dying on the spot.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def build_parser():
    """Returns the `kdist` argument parser (subcommands `launch` and `server`)."""
    parser = argparse.ArgumentParser(
        prog="kdist", description="kdist: tf.distribute-style distributed training for Keras 3."
    )
    parser.add_argument("--version", action="version", version=f"kdist {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    launch = commands.add_parser(
        "launch",
        help="start the processes of a distributed job on this host",
        description="Start the processes of a distributed job on this host, each with the\n"
        "environment that tells it its role, and run them as one job.",
        epilog=LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_launch_arguments(launch)
    launch.set_defaults(prepare=plans.build_specs, run=run_launch, parser=launch)
    server = server_cli.add_parser(commands, _count, _seconds)
    server.set_defaults(prepare=server_cli.prepare, run=server_cli.run_server, parser=server)
    return parser


def _add_launch_arguments(parser):
    mode = parser.add_argument_group("launch mode (choose one)")
    mode.add_argument(
        "--nproc", type=_count(1), metavar="N", help="start N processes with torchrun's variables"
    )
    add_cluster_argument(mode)
    mode.add_argument(
        "--workers",
        type=_count(0),
        metavar="N",
        help="start a whole local TF_CONFIG cluster with N workers",
    )

    torchrun = parser.add_argument_group("with --nproc")
    torchrun.add_argument(
        "--master-addr", metavar="HOST", help="rendezvous address (default: 127.0.0.1)"
    )
    torchrun.add_argument(
        "--master-port", type=_port, metavar="PORT", help="rendezvous port (default: a free port)"
    )

    tf_config = parser.add_argument_group("with --cluster")
    tf_config.add_argument(
        "--task",
        type=_task,
        action="append",
        default=[],
        metavar="TYPE:INDEX",
        help="a task of the cluster to run on this host, e.g. worker:1; repeat for several",
    )

    local = parser.add_argument_group("with --workers")
    local.add_argument("--ps", type=_count(0), metavar="K", help="K parameter servers (default: 0)")
    local.add_argument("--chief", action="store_true", help="add a chief (the coordinator) task")
    local.add_argument("--evaluator", action="store_true", help="add an evaluator task")
    local.add_argument(
        "--daemon-jobs",
        metavar="JOBS",
        help="comma-separated jobs that serve until stopped (default: ps with --workers, ps and "
        "worker with --chief --ps, where the chief is the coordinator; none with --cluster)",
    )
    local.add_argument(
        "--max-worker-restarts",
        type=_count(0),
        metavar="N",
        help="with --chief --ps (coordinator training): restart each worker that dies up to N "
        f"times (default: {plans.DEFAULT_MAX_WORKER_RESTARTS}; 0: a worker's death fails the job)",
    )

    local.add_argument(
        "--max-ps-restarts",
        type=_count(0),
        metavar="N",
        help="with --ps: restart each parameter server that dies up to N times; it restores its "
        f"last checkpoint (default: {plans.DEFAULT_MAX_PS_RESTARTS}; 0: a ps's death fails the job)",
    )
    local.add_argument(
        "--ps-checkpoint-every",
        metavar="EVERY",
        help="with --ps: each parameter server checkpoints itself every N applied pushes (\"1\": "
        "every step) or every N seconds (\"30s\") (default: "
        f"{plans.DEFAULT_PS_CHECKPOINT_EVERY} while ps restarts are allowed)",
    )
    local.add_argument(
        "--ps-checkpoint-dir",
        metavar="DIR",
        help="with --ps: where ps i keeps its checkpoint (DIR/ps-i) (default: ps-checkpoints in "
        "the log directory)",
    )

    job = parser.add_argument_group("the job")
    job.add_argument(
        "--max-restarts",
        type=_count(0),
        default=0,
        metavar="K",
        help="with --nproc, or --workers without --ps: when a process fails, restart the whole "
        "job up to K times; fit resumes from the script's BackupAndRestore. With --ps: restart "
        "the process that trains (the chief, or each worker without --chief) up to K times "
        "(default: 0)",
    )
    job.add_argument(
        "--grace",
        type=_seconds,
        default=DEFAULT_GRACE_SECONDS,
        metavar="SECONDS",
        help="after a failure (or Ctrl-C), how long the others get before their stacks are dumped "
        f"and they are killed (default: {DEFAULT_GRACE_SECONDS:g})",
    )
    job.add_argument(
        "--timeout",
        type=_positive_seconds,
        metavar="SECONDS",
        help="limit for the whole job (default: none)",
    )
    job.add_argument(
        "--log-dir",
        metavar="DIR",
        help="also write each process's output to DIR/<name>.log (default: a new directory in "
        "the temporary directory, removed when the job succeeds)",
    )
    job.add_argument(
        "--no-warm",
        dest="warm",
        action="store_false",
        help="start every process cold (a new interpreter importing everything itself), not "
        "forked from a process that imported NumPy, torch and Keras once; also KDIST_WARM=0 "
        "(default: warm, on Linux)",
    )
    job.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="script is a module name, run as python -m script",
    )
    job.add_argument("script", help="the Python script (or module, with -m) every process runs")
    job.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def main(argv=None):
    """Runs the `kdist` command with `argv` (default `sys.argv[1:]`); returns the exit code.

    Example:
        >>> main(["launch", "--nproc", "2", "train.py"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        try:
            # Every check that can fail before anything starts: a usage error (exit 2).
            plan = args.prepare(args)
        except InvalidArgumentError as error:
            args.parser.error(str(error))
    except SystemExit as exit_request:
        code = exit_request.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)
    return args.run(args, plan)


def run_launch(args, specs):
    """Starts `specs` as one job and waits for it; returns the launcher's exit code."""
    try:
        secret = _job_secret(args)
    except OSError as error:
        _say(f"could not write the job's secret file: {error}")
        return 1
    with secret:

        def with_secret(specs):
            return [dataclasses.replace(spec, env={**spec.env, **secret.env}) for spec in specs]

        # A restart rebuilds the specs: a new rendezvous port, a new local cluster.
        job_restart = plans.job_restart(args, lambda: with_secret(plans.build_specs(args)))
        return _run_processes(args, with_secret(specs), job_restart)


def _job_secret(args):
    """The job's `JobSecret`: a fresh one, the user's passed through, or none for part of a cluster."""
    if plans.runs_part_of_a_cluster(args) and not any(
        os.environ.get(name)
        for name in (job_secret.SECRET_FILE_VARIABLE, job_secret.SECRET_VARIABLE)
    ):
        _say(
            f"the cluster has tasks on other hosts, so no secret is made here; set "
            f"{job_secret.SECRET_FILE_VARIABLE} (a file with the cluster's secret) on every host"
        )
        return job_secret.JobSecret(None, None)
    return job_secret.JobSecret.create(os.environ)


def _run_processes(args, specs, job_restart=None):
    log_dir, made_log_dir = _log_dir(args)
    if log_dir is not None:
        specs = plans.with_ps_checkpoint_dir(specs, os.path.join(log_dir, PS_CHECKPOINT_DIR_NAME))
    code = 1
    try:
        code = _run_job(args, specs, log_dir, job_restart)
    finally:
        if made_log_dir and code == 0:
            shutil.rmtree(log_dir, ignore_errors=True)
    return code


def _log_dir(args):
    """Returns `(directory, made_here)`: --log-dir, else a new temporary directory, else None."""
    if args.log_dir is not None:
        return args.log_dir, False
    try:
        return tempfile.mkdtemp(prefix=LOG_DIR_PREFIX), True
    except OSError as error:
        _say(f"could not make a log directory ({error}); output is kept in memory only")
        return None, False


def _run_job(args, specs, log_dir, job_restart=None):
    # Forking pays when the zygote's one import replaces several (two processes or
    # more, or restarts); a lone process without restarts starts cold, as fast as ever.
    worth_it = len(specs) > 1 or job_restart is not None or any(spec.restart for spec in specs)
    pool = warm.shared_pool() if getattr(args, "warm", True) and worth_it and warm.enabled() else None
    processes = ProcessSet(
        specs,
        grace_seconds=args.grace,
        kill_after_seconds=KILL_AFTER_SECONDS,
        keep_lines=KEEP_LINES,
        log_dir=log_dir,
        job_restart=job_restart,
        warm=pool,
    )
    with _StopOnSignal(processes, args.grace) as stopper:
        try:
            try:
                processes.start()
            except OSError as error:
                _say(f"could not start the processes: {error}")
                return 1
            pids = processes.pids
            started = ", ".join(f"{name} (pid {pids[name]})" for name in processes.names)
            _say(f"started {started}" + ("" if log_dir is None else f"; logs in {log_dir}"))
            processes.wait(args.timeout)
        except ProcessSetTimeout as error:
            _say(str(error))
            return EXIT_TIMEOUT
        finally:
            # Whatever happened above (an unexpected exception included), no
            # process outlives the launcher.
            if processes.poll() is None:
                processes.stop_all("the launcher is exiting", timeout=args.grace)
    if stopper.received is not None:
        return 128 + stopper.received
    for line in failure_report.failure_summary(processes, log_dir):
        _say(line)
    return processes.exit_code()


class _StopOnSignal:
    """While active, SIGINT/SIGTERM stop the job (SIGTERM, then SIGKILL after `grace`).

    A second signal kills every process at once. Handlers are installed only in
    the main thread (Python allows no other); the previous ones are restored.
    """

    def __init__(self, processes, grace):
        self._processes = processes
        self._grace = grace
        self._previous = {}
        self.received = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False

    def _handle(self, signum, frame):
        # Handed to a thread: the handler runs in the main thread, which may be between
        # the set's policy and its wait, holding the set's condition. Called here, the
        # stop and its notify would land before that wait began and be lost (the wait
        # has no deadline); from another thread they wait for the condition and wake it.
        if self.received is None:
            self.received = signum
            reason = (f"the launcher received {signal.Signals(signum).name}; SIGTERM to every process, "
                      f"SIGKILL after {self._grace:g}s")
            act = functools.partial(self._processes.request_stop, reason, timeout=self._grace)
        else:
            act = self._processes.kill_all
        threading.Thread(target=act, name=f"kdist-stop-{signal.Signals(signum).name}", daemon=True).start()


def _say(message):
    print(f"[kdist] {message}", file=sys.stderr, flush=True)


def _count(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number. Received: {text!r}."
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}. Received: {value}.")
        return value

    return parse


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds. Received: {text!r}."
        ) from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds. Received: {text}.")
    return value


def _positive_seconds(text):
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds. Received: 0.")
    return value


def _port(text):
    value = _count(1)(text)
    if not is_port(value):
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1..{MAX_PORT}. Received: {value}.")
    return value


def _task(text):
    try:
        return parse_task(text)
    except InvalidArgumentError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
