"""The `ClusterResolver` interface and `SimpleClusterResolver`.

A cluster resolver tells a process which cluster it belongs to
(`cluster_spec()`) and which task it is (`task_type`, `task_id`). kdist adds
`rendezvous()`: where and as which rank the process joins `torch.distributed`
for synchronous multi-worker training.
"""

import abc

from kdist.cluster.rendezvous import cluster_rendezvous
from kdist.cluster.spec import ClusterSpec
from kdist.errors import InvalidArgumentError
from kdist.types import TaskType
from kdist.validation import is_integer


def check_task_types(task_type, task_id, type_field="task_type", id_field="task_id"):
    """Checks that a task type is a non-empty string and a task index a non-negative int.

    None is accepted for either. A bool is not an index.

    Raises:
        kdist.errors.InvalidArgumentError: naming `type_field` or `id_field`.
    """
    if task_type is not None and (not isinstance(task_type, str) or not task_type):
        raise InvalidArgumentError(
            f"A task type must be a job name. Received: {type_field}={task_type!r}. "
            "Expected a string such as 'worker'."
        )
    if task_id is not None and not is_integer(task_id, minimum=0):
        raise InvalidArgumentError(
            f"A task index must be a non-negative integer. Received: {id_field}={task_id!r}. "
            "Expected an int such as 0 (not a string or a bool)."
        )


def validate_task(cluster_spec, task_type, task_id, type_field="task_type", id_field="task_id"):
    """Checks that `task_type`/`task_id` are well-typed and name a task of the cluster.

    Either may be None (no task). When both are given the task must exist,
    except an `"evaluator"` with index 0, which may run outside the cluster
    (as TensorFlow's sidecar evaluator does).

    Raises:
        kdist.errors.InvalidArgumentError: a wrong type, an unknown job or an
            index out of range; the message names `type_field` or `id_field`.
    """
    check_task_types(task_type, task_id, type_field, id_field)
    if task_type is None or task_id is None:
        return
    if task_type not in cluster_spec.jobs and task_type == TaskType.EVALUATOR.value and task_id == 0:
        return
    require_task_in_cluster(cluster_spec, task_type, task_id, type_field, id_field)


def require_task_in_cluster(
    cluster, task_type, task_id, type_field="task_type", id_field="task_id", received=None
):
    """Raises unless task `task_type:task_id` is a task of `cluster`: the one such check in kdist.

    Args:
        cluster: a `ClusterSpec`, or a dict from job name to its list of
            addresses (as `kdist launch` reads a cluster file).
        task_type, task_id: the task, already well-typed (`check_task_types`).
        type_field, id_field: how the message names the wrong one, e.g.
            `"job_name"`, `'TF_CONFIG["task"]["index"]'`.
        received: what the message shows instead of the named field, e.g.
            `"ps:3"` on the command line.

    Raises:
        kdist.errors.InvalidArgumentError: the cluster has no job `task_type`,
            or that job no task `task_id`; the message lists what it has.
    """
    is_spec = isinstance(cluster, ClusterSpec)
    jobs = cluster.jobs if is_spec else list(cluster)
    if task_type not in jobs:
        shown = received or f"{type_field}={task_type!r}"
        raise InvalidArgumentError(
            f"job {task_type!r} is not in the cluster. Received: {shown}. "
            f"Expected one of the cluster's jobs: {jobs}."
        )
    indices = cluster.task_indices(task_type) if is_spec else list(range(len(cluster[task_type])))
    if task_id not in indices:
        shown = received or f"{id_field}={task_id!r}"
        raise InvalidArgumentError(
            f"job {task_type!r} has {len(indices)} task(s): the task index is out of range. "
            f"Received: {shown}. "
            f"Expected one of its task indices: {indices}."
        )


def format_master_url(address, rpc_layer):
    """Returns `"rpc_layer://address"`, or `address` when there is no rpc layer."""
    return f"{rpc_layer}://{address}" if rpc_layer else address


class ClusterResolver(abc.ABC):
    """Tells a process which cluster it belongs to and which task it is.

    Subclasses implement `cluster_spec()` and `master()` and override the
    `task_type`/`task_id` properties. Unlike TensorFlow's, kdist's resolvers
    are read-only after construction: configuration is validated once. They
    are thread-safe because they never change.

    Example:

    >>> resolver = kdist.cluster.resolve_cluster()
    >>> if resolver.is_chief:
    ...     print("this task writes checkpoints")
    """

    @abc.abstractmethod
    def cluster_spec(self):
        """Returns the cluster as a `ClusterSpec` (empty when there is none)."""

    @abc.abstractmethod
    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """Returns the address of a task (this one by default), e.g. `"grpc://h:2222"`.

        Args:
            task_type: job of the task to address; this task's when None.
            task_id: index of the task to address; this task's when None.
            rpc_layer: protocol prefix; the resolver's `rpc_layer` when None.

        Returns:
            `"rpc_layer://host:port"`, `"host:port"` when there is no rpc
            layer, or `""` when there is no task to address.
        """

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """Returns the accelerators a task has, e.g. `{"GPU": 2}`.

        The default counts the CUDA devices this process sees (torch is
        imported only here), assuming every task is on a similar host.

        Args:
            task_type: unused by the default; kept for TensorFlow compatibility.
            task_id: unused by the default.
            config_proto: unused; TensorFlow-only.

        Returns:
            `{"GPU": count}` when CUDA devices are visible, otherwise `{}`.
        """
        del task_type, task_id, config_proto
        try:
            import torch
        except ImportError:
            return {}
        count = torch.cuda.device_count()
        return {"GPU": count} if count > 0 else {}

    # Subclasses set these once, at construction; the properties below read them.
    _task_type = None
    _task_id = None
    _environment = ""
    _rpc_layer = None

    @property
    def task_type(self):
        """This process's job name (`"chief"`, `"worker"`, ...), or None."""
        return self._task_type

    @property
    def task_id(self):
        """This process's index within its job, or None."""
        return self._task_id

    @property
    def environment(self):
        """The environment name TF_CONFIG may carry (e.g. `"cloud"`); `""` if none."""
        return self._environment

    @property
    def rpc_layer(self):
        """The protocol `master()` prefixes addresses with (e.g. `"grpc"`), or None."""
        return self._rpc_layer

    @property
    def is_chief(self):
        """True for the task that does chief-only work (checkpoints, logs).

        That is the `"chief"` task, or worker 0 when the cluster has no chief
        job. A process outside any cluster (empty `cluster_spec()`) is its own
        chief.
        """
        spec = self.cluster_spec()
        if not spec or self.task_type == TaskType.CHIEF.value:
            return True
        return (
            self.task_type == TaskType.WORKER.value
            and self.task_id == 0
            and TaskType.CHIEF.value not in spec.jobs
        )

    def rendezvous(self):
        """Returns where and as which rank this process joins synchronous training.

        Returns:
            A `Rendezvous`; see `cluster_rendezvous` for how ranks are
            numbered (chief first, then workers).

        Raises:
            kdist.errors.InvalidArgumentError: this process has no task, or is
                a `ps` or `evaluator` task, which take no part in
                `MultiWorkerMirroredStrategy`.
        """
        return cluster_rendezvous(self.cluster_spec(), self.task_type, self.task_id)

    def __repr__(self):
        return (
            f"{type(self).__name__}(task_type={self.task_type!r}, task_id={self.task_id!r}, "
            f"cluster_spec={self.cluster_spec()!r})"
        )


class SimpleClusterResolver(ClusterResolver):
    """A resolver that returns exactly what it was given.

    Args:
        cluster_spec: a `ClusterSpec` or a dict accepted by `ClusterSpec`.
        master: what `master()` returns when no task is named.
        task_type: this process's job name, or None.
        task_id: this process's index within its job, or None.
        environment: an environment name, as TF_CONFIG's `environment`.
        num_accelerators: a dict such as `{"GPU": 2}`; None counts the local
            CUDA devices (TensorFlow returns `{}` instead, which would hide
            the GPUs from a strategy).
        rpc_layer: protocol prefix for `master()`, e.g. `"grpc"`, or None.

    Raises:
        kdist.errors.InvalidArgumentError: an argument has the wrong type, or
            `task_type`/`task_id` name no task of `cluster_spec`.

    Example:

    >>> resolver = SimpleClusterResolver(
    ...     ClusterSpec({"worker": ["w0:2222", "w1:2222"]}),
    ...     task_type="worker", task_id=1)
    >>> resolver.rendezvous().rank
    1
    """

    def __init__(
        self,
        cluster_spec,
        master="",
        task_type=None,
        task_id=None,
        environment="",
        num_accelerators=None,
        rpc_layer=None,
    ):
        self._cluster_spec = ClusterSpec(cluster_spec)
        validate_task(self._cluster_spec, task_type, task_id)
        for name, value, allow_none in (
            ("master", master, False),
            ("environment", environment, False),
            ("rpc_layer", rpc_layer, True),
        ):
            if not (isinstance(value, str) or (allow_none and value is None)):
                raise InvalidArgumentError(
                    f"Expected a string. Received: {name}={value!r}."
                )
        if num_accelerators is not None and not (
            isinstance(num_accelerators, dict)
            and all(
                isinstance(kind, str)
                and is_integer(count, minimum=0)
                for kind, count in num_accelerators.items()
            )
        ):
            raise InvalidArgumentError(
                f"Malformed accelerator counts. Received: num_accelerators={num_accelerators!r}. "
                "Expected a dict from device kind to a non-negative int, e.g. {'GPU': 2}."
            )
        self._master = master
        self._task_type = task_type
        self._task_id = task_id
        self._environment = environment
        self._num_accelerators = None if num_accelerators is None else dict(num_accelerators)
        self._rpc_layer = rpc_layer

    def cluster_spec(self):
        """Returns the `ClusterSpec` given at construction."""
        return self._cluster_spec

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """Returns the named task's address, else the `master` given at construction.

        Args:
            task_type: job of the task to address; both it and `task_id`
                must be given to address a task.
            task_id: index of the task to address.
            rpc_layer: protocol prefix; the resolver's `rpc_layer` when None.

        Raises:
            kdist.errors.InvalidArgumentError: the named task is not in the
                cluster.
        """
        if task_type is not None and task_id is not None:
            address = self._cluster_spec.task_address(task_type, task_id)
        else:
            address = self._master
        return format_master_url(address, rpc_layer or self._rpc_layer)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """Returns the `num_accelerators` given, else counts the local CUDA devices."""
        if self._num_accelerators is None:
            return super().num_accelerators(task_type, task_id, config_proto)
        return dict(self._num_accelerators)
