"""`Rendezvous`: where and as which rank a process joins `torch.distributed`.

Synchronous multi-worker training (`MultiWorkerMirroredStrategy`) runs one
process per task of the `"chief"` and `"worker"` jobs. Each process has a
*rank* (0..world_size-1) and meets the others at the *rendezvous point*, a
TCPStore at rank 0's address.
"""

import dataclasses

from kdist.cluster.address import MAX_PORT, split_address
from kdist.cluster.spec import field_item
from kdist.errors import InvalidArgumentError
from kdist.types import TaskType
from kdist.validation import is_integer

# Synchronous training ranks these jobs, in this order; chief:0 is rank 0.
RANKED_JOBS = (TaskType.CHIEF.value, TaskType.WORKER.value)


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """What one process needs to join a multi-process `torch.distributed` group.

    Attributes:
        rank: this process's rank, in `0..world_size-1`.
        world_size: the number of processes training synchronously.
        local_rank: this process's position among the processes on its host
            (it picks the local accelerator).
        local_world_size: the number of processes on this host.
        master_addr: host of the TCPStore every rank connects to (an IPv6
            host without brackets, as `MASTER_ADDR` takes it).
        master_port: port of that store. 0 ("any free port") only when
            `world_size == 1`.
        store_is_external: True when the launcher (torchrun's agent) already
            hosts the store at `master_addr:master_port`; False when rank 0
            must create it.
        attempt: which start of the job this is (torchrun's
            `TORCHELASTIC_RESTART_COUNT`: 0, then 1 after the first restart).
            torchrun's agent keeps one store across restarts, so every key a
            group writes there is scoped by it: a restarted group never reads
            an address the group before it left behind.

    Raises:
        kdist.errors.InvalidArgumentError: the fields contradict each other
            (e.g. `rank >= world_size`).

    Example:

    >>> rendezvous = Rendezvous(rank=1, world_size=2, local_rank=0, local_world_size=1,
    ...                         master_addr="10.0.0.1", master_port=2222)
    >>> rendezvous.rank, rendezvous.store_is_external
    (1, False)
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    store_is_external: bool = False
    attempt: int = 0

    def __post_init__(self):
        for name in ("rank", "world_size", "local_rank", "local_world_size", "master_port", "attempt"):
            value = getattr(self, name)
            if not is_integer(value, minimum=0):
                raise InvalidArgumentError(
                    f"Rendezvous fields are non-negative integers. Received: {name}={value!r}."
                )
        checks = (
            (self.world_size >= 1, "world_size", "at least 1"),
            (self.rank < self.world_size, "rank", f"less than world_size={self.world_size}"),
            (
                1 <= self.local_world_size <= self.world_size,
                "local_world_size",
                f"in 1..world_size={self.world_size}",
            ),
            (
                self.local_rank < self.local_world_size,
                "local_rank",
                f"less than local_world_size={self.local_world_size}",
            ),
            (self.master_port <= MAX_PORT, "master_port", f"at most {MAX_PORT}"),
            (
                self.master_port != 0 or self.world_size == 1,
                "master_port",
                "a real port when several processes must meet (0 only for world_size=1)",
            ),
            (isinstance(self.master_addr, str) and self.master_addr, "master_addr", "a host"),
            (isinstance(self.store_is_external, bool), "store_is_external", "a bool"),
        )
        for holds, name, expected in checks:
            if not holds:
                raise InvalidArgumentError(
                    f"Inconsistent rendezvous. Received: {name}={getattr(self, name)!r}. "
                    f"Expected {expected}."
                )


def cluster_rendezvous(cluster_spec, task_type, task_id):
    """Returns the `Rendezvous` of task `task_type:task_id` of a TF-style cluster.

    Ranks follow the tasks of `"chief"` then `"worker"`, each in index order;
    rank 0's address is the rendezvous point. `local_rank` counts the
    earlier-ranked tasks on the same host (host names compared
    case-insensitively, with no DNS lookup: `localhost` and `127.0.0.1` are
    different hosts here).

    Raises:
        kdist.errors.InvalidArgumentError: no task is set, the task is not a
            chief or worker task of the cluster, or an address of a ranked task
            is not `"host:port"`.
    """
    if task_type is None or task_id is None:
        raise InvalidArgumentError(
            "This process has no task, so it has no rank. "
            f"Received: task_type={task_type!r}, task_id={task_id!r}. Expected a chief or "
            "worker task: set TF_CONFIG's 'task', or pass task_type and task_id to the "
            "cluster resolver."
        )
    if task_type not in RANKED_JOBS:
        raise InvalidArgumentError(
            "Only chief and worker tasks take part in MultiWorkerMirroredStrategy. "
            f"Received: task_type={task_type!r}. Expected 'chief' or 'worker'; "
            "'ps' and 'evaluator' tasks belong to ParameterServerStrategy or a "
            "sidecar evaluator."
        )
    ranked_tasks = [
        (job, index)
        for job in RANKED_JOBS
        if job in cluster_spec.jobs
        for index in cluster_spec.task_indices(job)
    ]
    if (task_type, task_id) not in ranked_tasks:
        raise InvalidArgumentError(
            f"The task is not in the cluster. Received: task_type={task_type!r}, "
            f"task_id={task_id!r}. Expected one of the cluster's chief/worker tasks: "
            f"{ranked_tasks}."
        )
    endpoints = [
        split_address(
            cluster_spec.task_address(job, index),
            field_item(field_item("cluster", job), index),
            allow_port_zero=True,
        )
        for job, index in ranked_tasks
    ]
    hosts = [host.lower() for host, _ in endpoints]
    rank = ranked_tasks.index((task_type, task_id))
    return Rendezvous(
        rank=rank,
        world_size=len(ranked_tasks),
        local_rank=hosts[:rank].count(hosts[rank]),
        local_world_size=hosts.count(hosts[rank]),
        master_addr=endpoints[0][0],
        master_port=endpoints[0][1],
        store_is_external=False,
    )
