"""`ClusterSpec`: which tasks a cluster has and where they listen.

A cluster is a set of *jobs* (`"chief"`, `"worker"`, `"ps"`, `"evaluator"`);
each job is a list of *tasks*, addressed by their index in the job. A task's
address is a string, normally `"host:port"`.

`ClusterSpec` itself only requires non-empty, unique address strings, because
some launchers (torchrun) do not tell a process where the other tasks listen
and the resolver fills in pseudo-addresses. Code that needs a real endpoint
calls `kdist.cluster.address.parse_address`.
"""

import json
import re
from collections.abc import Mapping

from kdist.errors import InvalidArgumentError
from kdist.validation import is_integer

_INDEX_PATTERN = re.compile(r"[0-9]+")


def field_item(field_name, key):
    """Returns the name of `field_name[key]` as error messages spell it.

    String keys are written JSON-style (`cluster["worker"]`) because that is
    how users write `TF_CONFIG`; other keys use their `repr` (`cluster["ps"][1]`).
    """
    key_text = json.dumps(key) if isinstance(key, str) else repr(key)
    return f"{field_name}[{key_text}]"


def normalize_cluster(cluster, field_name="cluster"):
    """Validates a cluster description and returns it as `{job: {index: address}}`.

    Args:
        cluster: a mapping from job name to either a list of addresses (task
            `i` is entry `i`) or a mapping from task index to address (a sparse
            job). Indices may be ints or decimal strings, as JSON keys are.
        field_name: how error messages name `cluster`.

    Returns:
        A new dict from job name (sorted) to a dict from task index (sorted) to
        address.

    Raises:
        kdist.errors.InvalidArgumentError: a job name is not a non-empty string,
            a job is neither a list nor a mapping, a task index is not a
            non-negative integer or appears twice, an address is not a
            non-empty string without whitespace, or two tasks share an address.
    """
    if isinstance(cluster, ClusterSpec):
        return {job: dict(tasks) for job, tasks in cluster._jobs.items()}
    if not isinstance(cluster, Mapping):
        raise InvalidArgumentError(
            f"A cluster must be a dict. Received: {field_name}={cluster!r}. Expected a "
            "dict from job name to a list of addresses, e.g. "
            "{'worker': ['host0:2222', 'host1:2222']}."
        )
    for job in cluster:
        if not isinstance(job, str) or not job:
            raise InvalidArgumentError(
                f"A job name must be a non-empty string. Received: job name {job!r} in "
                f"{field_name}. Expected names such as 'chief', 'worker', 'ps'."
            )
    jobs = {}
    owner_of_address = {}
    for job in sorted(cluster):
        job_field = field_item(field_name, job)
        tasks = _job_tasks(cluster[job], job_field)
        for index, address in tasks.items():
            address_field = field_item(job_field, index)
            if (
                not isinstance(address, str)
                or not address
                or any(character.isspace() for character in address)
            ):
                raise InvalidArgumentError(
                    f"A task address must be a non-empty string without whitespace. "
                    f"Received: {address_field}={address!r}. Expected e.g. 'host:2222'."
                )
            if address in owner_of_address:
                raise InvalidArgumentError(
                    f"Two tasks share an address. Received: {address_field}={address!r}, "
                    f"which is also {owner_of_address[address]}. Expected every task to "
                    "listen on its own host:port; give one of them another port."
                )
            owner_of_address[address] = address_field
        jobs[job] = tasks
    return jobs


def _job_tasks(tasks, job_field):
    """Returns one job's tasks as `{index: address}`, sorted by index."""
    if isinstance(tasks, (list, tuple)):
        return dict(enumerate(tasks))
    if isinstance(tasks, Mapping):
        indexed = {}
        for key, address in tasks.items():
            index = _task_index(key)
            if index is None or index in indexed:
                problem = "is not a non-negative integer" if index is None else "repeats"
                raise InvalidArgumentError(
                    f"A task index {problem}. Received: task index {key!r} in "
                    f"{job_field}. Expected distinct indices 0, 1, 2, ..."
                )
            indexed[index] = address
        return dict(sorted(indexed.items()))
    raise InvalidArgumentError(
        f"A job must list its task addresses. Received: {job_field}={tasks!r}. "
        "Expected a list of addresses such as ['host0:2222', 'host1:2222'], or a dict "
        "from task index to address for a sparse job."
    )


def _task_index(key):
    if is_integer(key):
        return int(key) if key >= 0 else None
    if isinstance(key, str) and _INDEX_PATTERN.fullmatch(key):
        return int(key)
    return None


class ClusterSpec:
    """An immutable description of a cluster: jobs, their tasks and addresses.

    Args:
        cluster: a dict from job name to a list of task addresses, a dict from
            job name to a dict `{task_index: address}` (a sparse job, as
            TensorFlow allows), or another `ClusterSpec`.

    Raises:
        kdist.errors.InvalidArgumentError: a job name is not a non-empty
            string, an address is not a non-empty string, or two tasks share an
            address. The `"host:port"` form is not checked here (see
            `kdist.cluster.address.parse_address`).

    Example:

    >>> spec = ClusterSpec({"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]})
    >>> spec.jobs
    ['chief', 'worker']
    >>> spec.num_tasks("worker"), spec.task_address("worker", 1)
    (2, 'w1:2222')
    """

    __slots__ = ("_jobs",)

    def __init__(self, cluster):
        object.__setattr__(self, "_jobs", normalize_cluster(cluster))

    def __setattr__(self, name, value):
        raise AttributeError("ClusterSpec is immutable; build a new one instead.")

    @property
    def jobs(self):
        """The job names, sorted."""
        return list(self._jobs)

    def as_dict(self):
        """Returns a new dict from job name to its tasks.

        A dense job (indices 0..n-1) maps to a list of addresses; a sparse job
        maps to a dict `{task_index: address}`, as in TensorFlow, so
        `ClusterSpec(spec.as_dict()) == spec` always holds.

        Returns:
            A fresh dict; changing it does not change the spec.
        """
        result = {}
        for job, tasks in self._jobs.items():
            if list(tasks) == list(range(len(tasks))):
                result[job] = list(tasks.values())
            else:
                result[job] = dict(tasks)
        return result

    def num_tasks(self, job_name):
        """Returns the number of tasks in `job_name`.

        Raises:
            kdist.errors.InvalidArgumentError: the cluster has no such job.
        """
        return len(self._tasks_of(job_name))

    def task_indices(self, job_name):
        """Returns the sorted task indices of `job_name`.

        Raises:
            kdist.errors.InvalidArgumentError: the cluster has no such job.
        """
        return list(self._tasks_of(job_name))

    def task_address(self, job_name, task_index):
        """Returns the address of task `task_index` of `job_name`.

        Raises:
            kdist.errors.InvalidArgumentError: the cluster has no such job, or
                the job has no task `task_index`.
        """
        tasks = self._tasks_of(job_name)
        if (
            not is_integer(task_index)
            or task_index not in tasks
        ):
            raise InvalidArgumentError(
                f"The job has no such task. Received: job_name={job_name!r}, "
                f"task_index={task_index!r}. Expected one of the task indices "
                f"{list(tasks)}."
            )
        return tasks[task_index]

    def job_tasks(self, job_name):
        """Returns the addresses of `job_name`'s tasks, position = task index.

        A sparse job has `None` at the indices it lacks, as in TensorFlow.

        Raises:
            kdist.errors.InvalidArgumentError: the cluster has no such job.
        """
        tasks = self._tasks_of(job_name)
        addresses = [None] * (max(tasks) + 1 if tasks else 0)
        for index, address in tasks.items():
            addresses[index] = address
        return addresses

    def _tasks_of(self, job_name):
        if job_name not in self._jobs:
            raise InvalidArgumentError(
                f"The cluster has no such job. Received: job_name={job_name!r}. "
                f"Expected one of the cluster's jobs: {self.jobs}."
            )
        return self._jobs[job_name]

    def __eq__(self, other):
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._jobs == other._jobs

    def __hash__(self):
        return hash(tuple((job, tuple(tasks.items())) for job, tasks in self._jobs.items()))

    def __bool__(self):
        return bool(self._jobs)

    def __repr__(self):
        return f"ClusterSpec({self.as_dict()!r})"
