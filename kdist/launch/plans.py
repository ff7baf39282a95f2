"""Turns parsed `kdist launch` arguments into the `ProcessSpec`s to start.

Three modes, exactly one per launch:

- `--nproc N`: N processes with torchrun's variables (one host, `torch.distributed`).
- `--cluster FILE --task T:I ...`: the listed tasks of a multi-host `TF_CONFIG`
  cluster that run on this host.
- `--workers N [--ps K] [--chief] [--evaluator]`: a whole `TF_CONFIG` cluster on
  this host, every task on a free port of 127.0.0.1.

`--max-restarts K` (synchronous jobs: `--nproc`, or `--workers` without `--ps`)
restarts the whole job from specs built again by `build_specs`, so a new
rendezvous port or local cluster (`job_restart`).

Every check happens here, before anything starts; a mistake raises `UsageError`
naming the command-line argument.
"""

import dataclasses
import os
import sys

from kdist.errors import InvalidArgumentError
from kdist.launch import cluster_file, task_env
from kdist.launch.ports import free_ports
from kdist.launch.restarts import JobRestart
from kdist.launch.spec import ProcessSpec, RestartPolicy

LOCAL_HOST = "127.0.0.1"
# Jobs that serve until stopped in a local cluster (`--workers` mode).
DEFAULT_DAEMON_JOBS = ("ps",)
# With a chief and parameter servers, the chief is the coordinator: workers
# only serve the functions it schedules.
COORDINATOR_DAEMON_JOBS = ("ps", "worker")
# In coordinator training the chief moves a dead worker's closures to the
# others and reconnects to the worker's address every second: a worker that is
# started again on its old port rejoins. Restarts of each worker, by default,
# and the delay before the first (then doubling: 1 s, 2 s, 4 s).
DEFAULT_MAX_WORKER_RESTARTS = 3
FIRST_RESTART_DELAY_SECONDS = 1.0
OMP_NUM_THREADS = "OMP_NUM_THREADS"


class UsageError(InvalidArgumentError):
    """A command-line argument is wrong; `argument` names it ("--task", "script")."""

    def __init__(self, argument, message):
        super().__init__(f"argument {argument}: {message}")
        self.argument = argument
        self.message = message


def build_specs(args):
    """Returns the list of `ProcessSpec`s that `args` (from `cli.build_parser`) asks for.

    Raises:
        UsageError: the arguments are inconsistent, or a file they name is bad.
    """
    mode = _mode(args)
    _check_mode_options(args, mode)
    command = _command(args)
    if mode == "--nproc":
        specs = _torchrun_specs(args, command)
    elif mode == "--cluster":
        specs = _cluster_specs(args, command)
    else:
        specs = _local_cluster_specs(args, command)
    return _with_thread_limit(specs)


def _mode(args):
    modes = []
    if args.nproc is not None:
        modes.append("--nproc")
    if args.cluster is not None:
        modes.append("--cluster")
    if args.workers is not None or args.ps is not None:
        modes.append("--workers" if args.workers is not None else "--ps")
    if not modes:
        raise UsageError(
            "--nproc",
            "choose how to launch: --nproc N (torchrun-style processes), --cluster FILE "
            "--task TYPE:INDEX (tasks of a TF_CONFIG cluster), or --workers N [--ps K] "
            "(a whole local TF_CONFIG cluster).",
        )
    if len(modes) > 1:
        raise UsageError(modes[1], f"not allowed with argument {modes[0]}; use one launch mode.")
    return modes[0]


def _check_mode_options(args, mode):
    only = {
        "--master-addr": (args.master_addr is not None, ("--nproc",)),
        "--master-port": (args.master_port is not None, ("--nproc",)),
        "--task": (bool(args.task), ("--cluster",)),
        "--chief": (args.chief, ("--workers", "--ps")),
        "--evaluator": (args.evaluator, ("--workers", "--ps")),
        "--daemon-jobs": (args.daemon_jobs is not None, ("--cluster", "--workers", "--ps")),
        "--max-worker-restarts": (args.max_worker_restarts is not None, ("--workers", "--ps")),
        "--max-restarts": (bool(args.max_restarts), ("--nproc", "--workers")),
    }
    for argument, (given, modes) in only.items():
        if given and mode not in modes:
            raise UsageError(
                argument, f"only allowed with {' or '.join(modes)}; received it with {mode}."
            )
    if mode == "--ps":
        raise UsageError("--ps", "needs --workers N: a parameter-server cluster needs workers.")
    if args.max_restarts and args.ps:
        raise UsageError(
            "--max-restarts",
            "restarts a synchronous job (--nproc, or --workers without --ps); with --ps the "
            "parameter servers hold the job's state, and a restart would lose it. For "
            "coordinator training use --max-worker-restarts.",
        )
    if mode == "--cluster" and not args.task:
        raise UsageError(
            "--task",
            "--cluster needs at least one --task TYPE:INDEX: the tasks to run on this host.",
        )


def _command(args):
    if args.module:
        return [sys.executable, "-m", args.script, *args.script_args]
    if not os.path.isfile(args.script):
        raise UsageError("script", f"no such file: {args.script!r}. Use -m to run a module.")
    return [sys.executable, args.script, *args.script_args]


def _torchrun_specs(args, command):
    master_addr = args.master_addr or LOCAL_HOST
    master_port = args.master_port
    if master_port is None:
        try:
            master_port = free_ports(1, master_addr)[0]
        except OSError as error:
            raise UsageError(
                "--master-addr",
                f"cannot find a free port on {master_addr!r} ({error.strerror or error}); "
                "pass --master-port, or an address of this host.",
            ) from None
    return [
        ProcessSpec(
            f"worker-{rank}",
            command,
            task_env.torchrun_env(rank, args.nproc, master_addr, master_port),
        )
        for rank in range(args.nproc)
    ]


def _cluster_specs(args, command):
    try:
        cluster = cluster_file.load_cluster(args.cluster)
    except cluster_file.ClusterFileError as error:
        raise UsageError("--cluster", str(error)) from None
    seen = set()
    for task in args.task:
        try:
            cluster_file.check_task(cluster, *task)
        except InvalidArgumentError as error:
            raise UsageError("--task", str(error)) from None
        if task in seen:
            raise UsageError("--task", f"{task[0]}:{task[1]} was given twice.")
        seen.add(task)
    daemon_jobs = _daemon_jobs(args, cluster, default=())
    return [
        ProcessSpec(
            task_env.task_name(*task),
            command,
            task_env.tf_config_env(cluster, *task),
            daemon=task[0] in daemon_jobs,
        )
        for task in args.task
    ]


def _local_cluster_specs(args, command):
    num_ps = args.ps or 0
    if args.workers < 1 and not args.chief:
        raise UsageError(
            "--workers", f"needs at least one worker (or --chief). Received: {args.workers}."
        )
    cluster = task_env.local_cluster(args.workers, num_ps, args.chief, args.evaluator, LOCAL_HOST)
    coordinated = args.chief and num_ps > 0
    daemon_jobs = _daemon_jobs(
        args, cluster, default=COORDINATOR_DAEMON_JOBS if coordinated else DEFAULT_DAEMON_JOBS
    )
    worker_restart = _worker_restart(args, coordinated and "worker" in daemon_jobs)
    return [
        ProcessSpec(
            task_env.task_name(*task),
            command,
            task_env.tf_config_env(cluster, *task),
            daemon=task[0] in daemon_jobs,
            restart=worker_restart if task[0] == "worker" else None,
        )
        for task in task_env.cluster_tasks(cluster)
    ]


def _worker_restart(args, workers_only_serve):
    """The `RestartPolicy` of the workers: only where the chief coordinates serving workers."""
    if not workers_only_serve:
        if args.max_worker_restarts:
            raise UsageError(
                "--max-worker-restarts",
                "applies to coordinator training only, where workers only serve: --chief with "
                "--ps K (and worker among --daemon-jobs). Elsewhere a worker trains itself and "
                "its death fails the job.",
            )
        return None
    num_restarts = args.max_worker_restarts
    if num_restarts is None:
        num_restarts = DEFAULT_MAX_WORKER_RESTARTS
    if num_restarts == 0:
        return None
    return RestartPolicy(num_restarts, FIRST_RESTART_DELAY_SECONDS)


def job_restart(args, make_specs):
    """The `JobRestart` that `--max-restarts K` asks for (None for 0, the default).

    Args:
        args: the parsed arguments (already checked by `build_specs`).
        make_specs: callable returning the restarted job's `ProcessSpec`s.
    """
    if not args.max_restarts:
        return None
    return JobRestart(args.max_restarts, make_specs, FIRST_RESTART_DELAY_SECONDS)


def runs_part_of_a_cluster(args):
    """True for `--cluster` launches that leave some of the cluster's tasks to other hosts."""
    if args.cluster is None:
        return False
    cluster = cluster_file.load_cluster(args.cluster)
    return len(set(args.task)) < len(task_env.cluster_tasks(cluster))


def _daemon_jobs(args, cluster, default):
    if args.daemon_jobs is None:
        return set(default)
    jobs = {job.strip() for job in args.daemon_jobs.split(",") if job.strip()}
    unknown = sorted(jobs - set(cluster))
    if unknown:
        raise UsageError(
            "--daemon-jobs",
            f"{', '.join(unknown)} is not a job of the cluster (jobs: {', '.join(cluster)}).",
        )
    return jobs


def _with_thread_limit(specs):
    """Splits the cores between the processes unless the user chose OMP_NUM_THREADS.

    torch sizes its thread pool to every core of the machine; N processes would
    each do that and oversubscribe the cores N times (torchrun sets 1 instead).
    """
    if OMP_NUM_THREADS in os.environ or len(specs) < 2:
        return specs
    try:
        num_cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        num_cpus = os.cpu_count() or 1
    threads = str(max(1, num_cpus // len(specs)))
    return [dataclasses.replace(spec, env={**spec.env, OMP_NUM_THREADS: threads}) for spec in specs]
