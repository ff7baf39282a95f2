"""`SlurmClusterResolver`: the cluster of a Slurm job step, from the `SLURM_*` variables.

`srun` starts every task of a job step and tells each, in its environment,
which task it is and where all of them run:

- `SLURM_PROCID`: this task's index in the step, 0..ntasks-1;
- `SLURM_STEP_NUM_TASKS` (and `SLURM_NTASKS`): how many tasks the step has;
- `SLURM_STEP_NODELIST`: the step's nodes, as a hostlist (`node[01-04,07]`,
  see `kdist.cluster.hostlist`);
- `SLURM_STEP_TASKS_PER_NODE`: tasks on each node, in node-list order
  (`2(x3),1`);
- `SLURM_LOCALID`, `SLURM_NODEID`, `SLURM_STEP_NUM_NODES`: this task's index
  on its node, its node's index, the number of nodes.

Tasks are numbered node by node (Slurm's default `block` distribution): the
first node's tasks come first. The variables are checked against each other:
a layout they contradict (e.g. `srun --distribution=cyclic`) is refused.
"""

import os

from kdist.cluster.address import MAX_PORT, format_address
from kdist.cluster.hostlist import expand_hostlist, expand_tasks_per_node
from kdist.cluster.resolvers import ClusterResolver, format_master_url
from kdist.cluster.spec import ClusterSpec
from kdist.cluster.torchrun import read_integer
from kdist.errors import ClusterEnvironmentError, InvalidArgumentError
from kdist.types import TaskType
from kdist.validation import is_integer

# TensorFlow's default: the first task on each node listens on 8888, the next on 8889, ...
DEFAULT_PORT_BASE = 8888
_LAUNCHER = "Slurm"
_MAX_TASKS = 2**31


def _environment_error(what, variable, value, expected):
    """The error formula: what happened, `Received: VARIABLE='value'.`, what was expected."""
    return ClusterEnvironmentError(
        f"{what} Received: {variable}={value!r}. {expected}", variable, value
    )


def _num_tasks(environ):
    """The step's task count: SLURM_STEP_NUM_TASKS, else SLURM_NTASKS; both must agree."""
    names = [name for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if name in environ]
    if not names:
        raise ClusterEnvironmentError(
            "The Slurm task count is missing. Received: SLURM_STEP_NUM_TASKS and SLURM_NTASKS "
            "unset. Expected srun to set them; start each task with srun.",
            "SLURM_NTASKS",
            None,
        )
    counts = [read_integer(environ, name, 1, _MAX_TASKS, "a positive integer", _LAUNCHER) for name in names]
    if len(set(counts)) > 1:
        raise _environment_error(
            "Inconsistent Slurm task counts: SLURM_STEP_NUM_TASKS="
            f"{environ['SLURM_STEP_NUM_TASKS']!r} disagrees with SLURM_NTASKS.",
            "SLURM_NTASKS",
            environ["SLURM_NTASKS"],
            "Expected equal counts, as srun sets them for a step.",
        )
    return counts[0], names[0]


def _hosts(environ, tasks_per_node):
    if "SLURM_STEP_NODELIST" in environ:
        hosts = expand_hostlist(environ["SLURM_STEP_NODELIST"], "SLURM_STEP_NODELIST")
    elif isinstance(tasks_per_node, dict):
        hosts = list(tasks_per_node)
    else:
        raise ClusterEnvironmentError(
            "The Slurm node list is missing. Received: SLURM_STEP_NODELIST unset. Expected "
            "srun to set it; start each task with srun, or pass tasks_per_node as a dict "
            "from host to task count.",
            "SLURM_STEP_NODELIST",
            None,
        )
    seen = set()
    for host in hosts:
        problem = "appears twice in" if host in seen else None
        if any(character in "/@:" for character in host):
            problem = "is not a host name, in"
        if problem:
            raise _environment_error(
                f"The Slurm node {host!r} {problem} the node list.",
                "SLURM_STEP_NODELIST",
                environ.get("SLURM_STEP_NODELIST", tasks_per_node),
                "Expected each node once, by host name or IPv4 address.",
            )
        seen.add(host)
    if "SLURM_STEP_NUM_NODES" in environ:
        read_integer(
            environ, "SLURM_STEP_NUM_NODES", len(hosts), len(hosts),
            f"{len(hosts)}, the number of nodes in SLURM_STEP_NODELIST", _LAUNCHER,
        )
    return hosts


def _task_counts(environ, hosts, tasks_per_node, num_tasks, num_tasks_variable):
    """Tasks on each host, in host order, from the argument or SLURM_STEP_TASKS_PER_NODE."""
    if tasks_per_node is None:
        if "SLURM_STEP_TASKS_PER_NODE" in environ:
            text = environ["SLURM_STEP_TASKS_PER_NODE"]
            counts = expand_tasks_per_node(text, "SLURM_STEP_TASKS_PER_NODE")
            if len(counts) != len(hosts):
                # Name the list that is short: too few hosts, or too few counts.
                variable = "SLURM_STEP_NODELIST" if len(hosts) < len(counts) else "SLURM_STEP_TASKS_PER_NODE"
                raise _environment_error(
                    f"SLURM_STEP_TASKS_PER_NODE={text!r} lists {len(counts)} nodes but "
                    f"SLURM_STEP_NODELIST names {len(hosts)}.",
                    variable,
                    environ.get(variable),
                    "Expected one count per node of the node list.",
                )
        elif len(hosts) == 1:
            counts = [num_tasks]
        else:
            raise ClusterEnvironmentError(
                "Slurm's tasks per node are missing. Received: SLURM_STEP_TASKS_PER_NODE unset "
                f"with {len(hosts)} nodes. Expected srun to set it, or pass tasks_per_node.",
                "SLURM_STEP_TASKS_PER_NODE",
                None,
            )
        source, source_value = "SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_STEP_TASKS_PER_NODE")
    elif is_integer(tasks_per_node, minimum=1):
        counts = [int(tasks_per_node)] * len(hosts)
        source, source_value = "tasks_per_node", tasks_per_node
    elif (
        isinstance(tasks_per_node, dict)
        and sorted(tasks_per_node) == sorted(hosts)
        and all(is_integer(count, minimum=1) for count in tasks_per_node.values())
    ):
        counts = [int(tasks_per_node[host]) for host in hosts]
        source, source_value = "tasks_per_node", tasks_per_node
    else:
        raise InvalidArgumentError(
            f"Malformed tasks per node. Received: tasks_per_node={tasks_per_node!r}. Expected "
            "None (read SLURM_STEP_TASKS_PER_NODE), a positive int, or a dict from each host "
            f"of the node list {hosts} to a positive int."
        )
    if sum(counts) != num_tasks:
        message = (
            f"The tasks per node add up to {sum(counts)} but {num_tasks_variable}="
            f"{environ[num_tasks_variable]!r} tasks run. Received: {source}={source_value!r}. "
            "Expected counts that add up to the step's task count."
        )
        if source == "tasks_per_node":
            raise InvalidArgumentError(message)
        raise ClusterEnvironmentError(message, source, source_value)
    return counts


def _check_jobs(jobs, num_tasks, num_tasks_variable, environ):
    if jobs is None:
        return {TaskType.WORKER.value: num_tasks}
    if not (
        isinstance(jobs, dict)
        and jobs
        and all(isinstance(name, str) and name for name in jobs)
        and all(is_integer(count, minimum=1) for count in jobs.values())
    ):
        raise InvalidArgumentError(
            f"Malformed jobs. Received: jobs={jobs!r}. Expected a dict from job name to a "
            "positive task count, e.g. {'ps': 1, 'worker': 3}, or None for one 'worker' per task."
        )
    if sum(jobs.values()) != num_tasks:
        raise InvalidArgumentError(
            f"The jobs ask for {sum(jobs.values())} tasks but {num_tasks_variable}="
            f"{environ[num_tasks_variable]!r} run. Received: jobs={jobs!r}. Expected task "
            "counts that add up to the step's task count."
        )
    return {name: int(jobs[name]) for name in jobs}


def _check_local_position(environ, rank, node_index, local_index):
    """Refuses a layout where SLURM_NODEID/SLURM_LOCALID disagree with block numbering."""
    for variable, expected in (("SLURM_NODEID", node_index), ("SLURM_LOCALID", local_index)):
        if variable not in environ:
            continue
        text = environ[variable]
        value = read_integer(environ, variable, 0, _MAX_TASKS, "a non-negative integer", _LAUNCHER)
        if value != expected:
            raise _environment_error(
                f"Task SLURM_PROCID={rank} is task {local_index} of node {node_index} when tasks "
                "are numbered node by node (srun's default block distribution), but "
                f"{variable} says otherwise.",
                variable,
                text,
                f"Expected {variable}={expected}; launch with `srun --distribution=block`, or "
                "pass a cluster resolver of your own.",
            )


class SlurmClusterResolver(ClusterResolver):
    """The cluster of a Slurm job step: TensorFlow's `SlurmClusterResolver`, read once.

    Tasks are laid out node by node in `SLURM_STEP_NODELIST` order; the
    `i`-th task on a node listens on `host:port_base + i`. Jobs take the
    tasks in the order of their sorted names, as in TensorFlow: with
    `jobs={"ps": 1, "worker": 3}`, `SLURM_PROCID` 0 is `ps:0` and 1..3 are
    `worker:0..2`. The `j`-th task on a node gets GPUs
    `j * gpus_per_task ... (j + 1) * gpus_per_task - 1`
    (`cuda_visible_devices()`).

    Differences from TensorFlow: everything is read and checked once, at
    construction (TensorFlow reads at `cluster_spec()`); nodes keep their
    node-list order (TensorFlow sorts host names as strings, so `node10`
    would come before `node9`); the environment is never written
    (TensorFlow's `auto_set_gpu=True` sets `CUDA_VISIBLE_DEVICES`).

    Args:
        jobs: a dict from job name to task count, e.g. `{"ps": 1, "worker": 3}`,
            adding up to the step's task count; None makes every task a `"worker"`.
        port_base: the port of the first task on each node (TensorFlow's 8888).
        gpus_per_node: GPUs on each node; None counts the CUDA devices this
            process sees.
        gpus_per_task: GPUs each task uses; None divides `gpus_per_node`
            evenly among the most tasks any node runs.
        tasks_per_node: None reads `SLURM_STEP_TASKS_PER_NODE` (on one node,
            every task runs there); an int is the same count on every node; a
            dict maps each host of the node list to its count.
        auto_set_gpu: only False: kdist never writes `os.environ`. Set
            `CUDA_VISIBLE_DEVICES` from `cuda_visible_devices()` yourself, or
            pass `devices=` to the strategy.
        rpc_layer: the protocol prefix of `master()`, `"grpc"` as in TensorFlow.
        environ: the mapping to read the variables from; None reads `os.environ`.

    Raises:
        kdist.errors.ClusterEnvironmentError: a `SLURM_*` variable is missing,
            malformed or contradicts another (non-integer `SLURM_PROCID`,
            `SLURM_PROCID` not below the task count, a malformed hostlist, a
            tasks-per-node list whose length is not the number of nodes or
            whose sum is not the task count, a `SLURM_LOCALID`/`SLURM_NODEID`
            that is not where block numbering puts the task). Its `variable`
            and message name the variable and its value.
        kdist.errors.InvalidArgumentError: an argument is malformed, or does
            not fit the step (jobs that do not add up to the task count, more
            GPUs per node asked for than `gpus_per_node`, a port past 65535).

    Example:

    >>> resolver = SlurmClusterResolver(
    ...     jobs={"ps": 1, "worker": 3}, gpus_per_node=2, environ={
    ...         "SLURM_PROCID": "2", "SLURM_NTASKS": "4",
    ...         "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
    >>> resolver.task_type, resolver.task_id, resolver.master()
    ('worker', 1, 'grpc://node02:8888')
    >>> resolver.cuda_visible_devices()
    '0'
    """

    def __init__(
        self,
        jobs=None,
        port_base=DEFAULT_PORT_BASE,
        gpus_per_node=None,
        gpus_per_task=None,
        tasks_per_node=None,
        auto_set_gpu=False,
        rpc_layer="grpc",
        environ=None,
    ):
        environ = os.environ if environ is None else environ
        if auto_set_gpu is not False:
            raise InvalidArgumentError(
                "kdist never writes os.environ, so it cannot set CUDA_VISIBLE_DEVICES for you. "
                f"Received: auto_set_gpu={auto_set_gpu!r}. Expected False; set "
                "os.environ['CUDA_VISIBLE_DEVICES'] = resolver.cuda_visible_devices() before "
                "the first CUDA call, or pass devices=[...] to the strategy."
            )
        if rpc_layer is not None and not isinstance(rpc_layer, str):
            raise InvalidArgumentError(
                f"Expected a string or None. Received: rpc_layer={rpc_layer!r}."
            )
        num_tasks, num_tasks_variable = _num_tasks(environ)
        self._rank = read_integer(
            environ,
            "SLURM_PROCID",
            0,
            num_tasks - 1,
            f"an integer in 0..{num_tasks_variable}-1={num_tasks - 1}",
            _LAUNCHER,
        )
        hosts = _hosts(environ, tasks_per_node)
        counts = _task_counts(environ, hosts, tasks_per_node, num_tasks, num_tasks_variable)
        self._jobs = _check_jobs(jobs, num_tasks, num_tasks_variable, environ)
        max_per_node = max(counts)
        if not is_integer(port_base, 1, MAX_PORT - max_per_node + 1):
            raise InvalidArgumentError(
                f"Malformed port base. Received: port_base={port_base!r}. Expected an int in "
                f"1..{MAX_PORT - max_per_node + 1}, so that the {max_per_node} tasks of the "
                f"fullest node get ports up to {MAX_PORT}."
            )
        self._gpus_per_node, self._gpus_per_task = self._gpu_counts(
            gpus_per_node, gpus_per_task, max_per_node
        )
        # (address, node index, index on the node) of every task, in SLURM_PROCID order.
        tasks = [
            (format_address(host, port_base + local_index), node_index, local_index)
            for node_index, (host, count) in enumerate(zip(hosts, counts))
            for local_index in range(count)
        ]
        _, node_index, self._local_index = tasks[self._rank]
        _check_local_position(environ, self._rank, node_index, self._local_index)
        cluster, start = {}, 0
        for name in sorted(self._jobs):
            cluster[name] = [address for address, _, _ in tasks[start : start + self._jobs[name]]]
            if start <= self._rank < start + self._jobs[name]:
                self._task_type, self._task_id = name, self._rank - start
            start += self._jobs[name]
        self._cluster_spec = ClusterSpec(cluster)
        self._rpc_layer = rpc_layer

    def _gpu_counts(self, gpus_per_node, gpus_per_task, max_per_node):
        if gpus_per_node is None:
            gpus_per_node = super().num_accelerators().get("GPU", 0)
        for name, value in (("gpus_per_node", gpus_per_node), ("gpus_per_task", gpus_per_task)):
            if value is not None and not is_integer(value, minimum=0):
                raise InvalidArgumentError(
                    f"Expected a non-negative int or None. Received: {name}={value!r}."
                )
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_per_node
        if max_per_node * gpus_per_task > gpus_per_node:
            raise InvalidArgumentError(
                f"More GPUs asked for than a node has. Received: gpus_per_task={gpus_per_task!r} "
                f"with {max_per_node} tasks on the fullest node and gpus_per_node="
                f"{gpus_per_node!r}. Expected gpus_per_task * tasks per node <= gpus_per_node."
            )
        return int(gpus_per_node), int(gpus_per_task)

    @staticmethod
    def is_available(environ=None):
        """Returns True inside an `srun` task: `SLURM_PROCID` and `SLURM_STEP_NODELIST` are set.

        A batch script's own shell (`sbatch` without `srun`) sets `SLURM_PROCID`
        but is no job step of several tasks, and is not taken for one.

        Args:
            environ: the mapping to look in; None looks in `os.environ`.
        """
        environ = os.environ if environ is None else environ
        return "SLURM_PROCID" in environ and "SLURM_STEP_NODELIST" in environ

    def cluster_spec(self):
        """Returns the `ClusterSpec`: each job's tasks as `"host:port"`."""
        return self._cluster_spec

    def get_task_info(self):
        """Returns `(task_type, task_id)` of this task, as TensorFlow's resolver does."""
        return self._task_type, self._task_id

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """Returns a task's address, this task's by default, e.g. `"grpc://node01:8888"`.

        Args:
            task_type: the task's job; this task's when None.
            task_id: the task's index; this task's when None.
            rpc_layer: protocol prefix; the resolver's `rpc_layer` when None.

        Raises:
            kdist.errors.InvalidArgumentError: the task is not in the cluster.
        """
        task_type = self._task_type if task_type is None else task_type
        task_id = self._task_id if task_id is None else task_id
        address = self._cluster_spec.task_address(task_type, task_id)
        return format_master_url(address, rpc_layer or self._rpc_layer)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """Returns `{"GPU": gpus_per_task}`, or `{}` when tasks get no GPU."""
        del task_type, task_id, config_proto
        return {"GPU": self._gpus_per_task} if self._gpus_per_task else {}

    def cuda_visible_devices(self):
        """Returns the GPUs of this task as `CUDA_VISIBLE_DEVICES` spells them, e.g. `"2,3"`.

        `""` when tasks get no GPU. The environment is not changed.

        Example:

        >>> os.environ["CUDA_VISIBLE_DEVICES"] = resolver.cuda_visible_devices()
        """
        first = self._local_index * self._gpus_per_task
        return ",".join(str(gpu) for gpu in range(first, first + self._gpus_per_task))
