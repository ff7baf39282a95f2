"""Turns parsed `kdist launch` arguments into the `ProcessSpec`s to start.

Three modes, exactly one per launch:

- `--nproc N`: N processes with torchrun's variables (one host, `torch.distributed`).
- `--cluster FILE --task T:I ...`: the listed tasks of a multi-host `TF_CONFIG`
  cluster that run on this host.
- `--workers N [--ps K] [--chief] [--evaluator]`: a whole `TF_CONFIG` cluster on
  this host, every task on a free port of 127.0.0.1.

`--max-restarts K` (synchronous jobs: `--nproc`, or `--workers` without `--ps`)
restarts the whole job from specs built again by `build_specs`, so a new
rendezvous port or local cluster (`job_restart`). With `--ps` the servers hold
the job's state, so processes come back one at a time on their old ports: the
trainer (the chief, or each worker without one) under `--max-restarts`, a
coordinator's workers under `--max-worker-restarts`, and each ps under
`--max-ps-restarts` (it restores the checkpoint it takes every
`--ps-checkpoint-every`, `kdist.ps.autosave`).

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
from kdist.ps import autosave

LOCAL_HOST = "127.0.0.1"
# Jobs that serve until stopped in a local cluster (`--workers` mode).
DEFAULT_DAEMON_JOBS = ("ps",)
# With a chief and parameter servers, the chief is the coordinator: workers
# only serve the functions it schedules.
COORDINATOR_DAEMON_JOBS = ("ps", "worker")
# In coordinator training the chief moves a dead worker's closures to the
# others and reconnects to the worker's address every second: a worker that is
# started again on its old port rejoins. Restarts of each worker, by default,
# and the backoff: the first restart is immediate, then 1 s, 2 s, 4 s (`RestartPolicy`).
DEFAULT_MAX_WORKER_RESTARTS = 3
RESTART_BACKOFF_SECONDS = 1.0
# A parameter server that dies is started again on its port and restores its
# last checkpoint (`kdist.ps.autosave`); by default it checkpoints every minute.
DEFAULT_MAX_PS_RESTARTS = 3
DEFAULT_PS_CHECKPOINT_EVERY = "60s"
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
        "--max-ps-restarts": (args.max_ps_restarts is not None, ("--workers", "--ps")),
        "--ps-checkpoint-every": (args.ps_checkpoint_every is not None, ("--workers", "--ps")),
        "--ps-checkpoint-dir": (args.ps_checkpoint_dir is not None, ("--workers", "--ps")),
        "--max-restarts": (bool(args.max_restarts), ("--nproc", "--workers")),
    }
    for argument, (given, modes) in only.items():
        if given and mode not in modes:
            raise UsageError(
                argument, f"only allowed with {' or '.join(modes)}; received it with {mode}."
            )
    if mode == "--ps":
        raise UsageError("--ps", "needs --workers N: a parameter-server cluster needs workers.")
    if not args.ps:
        for argument, given in (
            ("--max-ps-restarts", args.max_ps_restarts is not None),
            ("--ps-checkpoint-every", args.ps_checkpoint_every is not None),
            ("--ps-checkpoint-dir", args.ps_checkpoint_dir is not None),
        ):
            if given:
                raise UsageError(
                    argument, "needs --ps K with K >= 1: it configures the parameter servers."
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
    restarts = {"worker": _worker_restart(args, coordinated and "worker" in daemon_jobs)}
    ps_env = {}
    if num_ps:
        restarts["ps"], ps_env = _ps_restart(args)
        # With parameter servers the job's state outlives a trainer: --max-restarts
        # restarts the process that trains (the chief, or each worker) alone.
        trainer = "chief" if args.chief else "worker"
        if args.max_restarts and trainer not in daemon_jobs:
            restarts[trainer] = RestartPolicy(args.max_restarts, RESTART_BACKOFF_SECONDS)
    return [
        ProcessSpec(
            task_env.task_name(*task),
            command,
            {
                **task_env.tf_config_env(cluster, *task),
                **(_ps_env(ps_env, args, task[1]) if task[0] == "ps" else {}),
            },
            daemon=task[0] in daemon_jobs,
            restart=restarts.get(task[0]),
        )
        for task in task_env.cluster_tasks(cluster)
    ]


def _ps_restart(args):
    """The parameter servers' `RestartPolicy` and checkpoint interval variables."""
    num_restarts = args.max_ps_restarts
    if num_restarts is None:
        num_restarts = DEFAULT_MAX_PS_RESTARTS
    every = args.ps_checkpoint_every
    if every is None and num_restarts:
        every = DEFAULT_PS_CHECKPOINT_EVERY
    env = {}
    if every is not None:
        try:
            env[autosave.CHECKPOINT_EVERY_VARIABLE] = str(
                autosave.parse_every(every, "--ps-checkpoint-every"))
        except InvalidArgumentError as error:
            raise UsageError("--ps-checkpoint-every", str(error)) from None
    policy = RestartPolicy(num_restarts, RESTART_BACKOFF_SECONDS) if num_restarts else None
    return policy, env


def _ps_env(env, args, index):
    if env and args.ps_checkpoint_dir is not None:
        directory = os.path.join(os.path.abspath(args.ps_checkpoint_dir), f"ps-{index}")
        return {**env, autosave.CHECKPOINT_DIR_VARIABLE: directory}
    return env


def with_ps_checkpoint_dir(specs, root):
    """Gives each checkpointing ps without a directory its own, `root/ps-<index>`."""
    result = []
    for spec in specs:
        env = spec.env
        every, directory = (autosave.CHECKPOINT_EVERY_VARIABLE, autosave.CHECKPOINT_DIR_VARIABLE)
        if every in env and not env.get(directory):
            index = spec.name.rsplit("-", 1)[-1]
            env = {**env, directory: os.path.join(root, f"ps-{index}")}
        result.append(dataclasses.replace(spec, env=env))
    return result


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
    return RestartPolicy(num_restarts, RESTART_BACKOFF_SECONDS)


def job_restart(args, make_specs):
    """The `JobRestart` that `--max-restarts K` asks for (None for 0, the default).

    Args:
        args: the parsed arguments (already checked by `build_specs`).
        make_specs: callable returning the restarted job's `ProcessSpec`s.
    """
    if not args.max_restarts or args.ps:
        return None  # With --ps, --max-restarts restarts one process at a time (above).
    return JobRestart(args.max_restarts, make_specs, RESTART_BACKOFF_SECONDS)


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
