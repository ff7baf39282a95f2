"""`resolve_cluster`: the resolver a strategy uses when the user passes none."""

import os

from kdist.cluster.address import MAX_PORT
from kdist.cluster.kubeflow import KubeflowTrainerClusterResolver
from kdist.cluster.resolvers import ClusterResolver, SimpleClusterResolver
from kdist.cluster.slurm import SlurmClusterResolver
from kdist.cluster.spec import ClusterSpec
from kdist.cluster.tf_config import TF_CONFIG, TFConfigClusterResolver
from kdist.cluster.torchrun import TorchrunClusterResolver, read_integer
from kdist.errors import InvalidArgumentError
from kdist.types import TaskType

# A process outside any cluster is worker 0 of a one-task cluster. Port 0
# means "any free port": nobody else has to find rank 0's store.
LOCAL_ADDRESS = "127.0.0.1:0"

# `resolve_cluster()`'s port base inside `srun` when MASTER_PORT is unset: each
# (job, step) gets its own block of STEP_PORT_BLOCK ports in
# STEP_PORT_FIRST..STEP_PORT_FIRST + STEP_PORT_BLOCK * STEP_PORT_BLOCKS - 1
# (15000..30999), so two jobs sharing a node do not both take TensorFlow's 8888.
# Unprivileged, and below Linux's ephemeral range (32768 up), which clients use.
# Blocks of 8 fit 8 tasks per node; 8 steps per job before the next job's blocks.
STEP_PORT_FIRST = 15000
STEP_PORT_BLOCK = 8
STEP_PORT_BLOCKS = 2000
STEP_PORT_RULE = (
    f"{STEP_PORT_FIRST} + {STEP_PORT_BLOCK} * ((SLURM_JOB_ID * 8 + SLURM_STEP_ID) % {STEP_PORT_BLOCKS})"
)


def local_cluster_resolver():
    """Returns the resolver of a single process that is its own cluster.

    Its `rendezvous()` is rank 0 of world size 1 at `127.0.0.1`, port 0.

    Example:

    >>> local_cluster_resolver().rendezvous().world_size
    1
    """
    return SimpleClusterResolver(
        ClusterSpec({TaskType.WORKER.value: [LOCAL_ADDRESS]}),
        master=LOCAL_ADDRESS,
        task_type=TaskType.WORKER.value,
        task_id=0,
    )


def is_local_cluster(cluster_resolver):
    """True when `cluster_resolver` is `local_cluster_resolver()`'s one-process cluster.

    `resolve_cluster()` returns that one only when the environment names no
    cluster; a strategy uses this to say so.
    """
    # Port 0 ("any free port") in a cluster spec comes only from local_cluster_resolver().
    if not isinstance(cluster_resolver, SimpleClusterResolver):
        return False
    return cluster_resolver.cluster_spec().as_dict() == {TaskType.WORKER.value: [LOCAL_ADDRESS]}


def resolve_cluster(cluster_resolver=None, environ=None):
    """Returns `cluster_resolver`, or the one the environment describes.

    Without a resolver, the first that applies wins:

    1. the torchrun variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
       `MASTER_PORT`, all four) give a `TorchrunClusterResolver`. torchrun
       wins over the others because it is the launcher that actually started
       these processes: under `srun torchrun ...` or a Kubeflow TrainJob
       running torchrun, the `SLURM_*`/`PET_*` variables describe torchrun's
       own launch, and a `TF_CONFIG` left in the environment is often stale.
    2. a `TF_CONFIG` with a non-empty cluster gives a `TFConfigClusterResolver`:
       a cluster written out task by task is the most explicit description.
    3. inside an `srun` task (`SLURM_PROCID` and `SLURM_STEP_NODELIST` set), a
       `SlurmClusterResolver` with every task a `"worker"`: rank =
       `SLURM_PROCID`, world size = the step's task count, rendezvous at the
       first node of `SLURM_STEP_NODELIST`, port `MASTER_PORT` if set, else
       one derived from `SLURM_JOB_ID` and `SLURM_STEP_ID`
       (`kdist.cluster.resolve.step_port_base`), so jobs sharing a node differ.
    4. any of Kubeflow Trainer v2's `PET_NNODES`, `PET_NPROC_PER_NODE`,
       `PET_NODE_RANK`, `PET_MASTER_ADDR`, `PET_MASTER_PORT` set gives a
       `KubeflowTrainerClusterResolver` (one process per node: rank =
       `PET_NODE_RANK`; it refuses `PET_NPROC_PER_NODE` other than 1).
    5. otherwise `local_cluster_resolver()`: one process, rank 0 of 1.

    Args:
        cluster_resolver: a `ClusterResolver` to use as is, or None.
        environ: the mapping to read variables from; None reads `os.environ`.

    Returns:
        A `ClusterResolver`.

    Raises:
        kdist.errors.InvalidArgumentError: `cluster_resolver` is not a
            `ClusterResolver`, or the chosen environment is malformed
            (a malformed `TF_CONFIG` is an error, never silently ignored).
        kdist.errors.ClusterEnvironmentError: a launcher's variable (`SLURM_*`,
            `PET_*`, torchrun's) is missing, malformed or inconsistent.

    Example:

    >>> resolver = resolve_cluster()
    >>> resolver.rendezvous().rank
    0
    """
    if cluster_resolver is not None:
        if not isinstance(cluster_resolver, ClusterResolver):
            raise InvalidArgumentError(
                f"Expected a cluster resolver. Received: cluster_resolver={cluster_resolver!r}. "
                "Expected a kdist.cluster.ClusterResolver such as TFConfigClusterResolver() "
                "or SimpleClusterResolver(ClusterSpec({...}), task_type=..., task_id=...)."
            )
        return cluster_resolver
    environ = os.environ if environ is None else environ
    if TorchrunClusterResolver.is_available(environ):
        return TorchrunClusterResolver(environ)
    if TF_CONFIG in environ:
        resolver = TFConfigClusterResolver(tf_config=environ[TF_CONFIG])
        if resolver.cluster_spec():
            return resolver
    if SlurmClusterResolver.is_available(environ):
        return slurm_step_resolver(environ)
    if KubeflowTrainerClusterResolver.is_available(environ):
        return KubeflowTrainerClusterResolver(environ)
    return local_cluster_resolver()


def slurm_step_resolver(environ=None):
    """Returns the `SlurmClusterResolver` that `resolve_cluster()` picks inside `srun`.

    Every task is a `"worker"`; tasks listen from port `MASTER_PORT` (if set)
    upwards on each node, else from `step_port_base(environ)`:
    `15000 + 8 * ((SLURM_JOB_ID * 8 + SLURM_STEP_ID) % 2000)`, which every
    task of the step computes alike and which differs between jobs sharing a
    node (TensorFlow's fixed 8888 would collide there). The rendezvous is the
    first node of `SLURM_STEP_NODELIST` at that port.

    Raises:
        kdist.errors.ClusterEnvironmentError: `MASTER_PORT` is not a port;
            without it, `SLURM_JOB_ID` or `SLURM_STEP_ID` is not a
            non-negative integer; or another `SLURM_*` variable is missing,
            malformed or inconsistent.
    """
    environ = os.environ if environ is None else environ
    if "MASTER_PORT" in environ:
        port_base = read_integer(environ, "MASTER_PORT", 1, MAX_PORT, f"a port in 1..{MAX_PORT}", "Slurm")
    else:
        port_base = step_port_base(environ)
    return SlurmClusterResolver(port_base=port_base, environ=environ)


def step_port_base(environ):
    """The port base that every task of this `srun` step derives alike when `MASTER_PORT` is unset.

    `15000 + 8 * ((SLURM_JOB_ID * 8 + SLURM_STEP_ID) % 2000)`: one block of 8
    ports per (job, step) in 15000..30999. Two jobs on one node get different
    blocks unless their ids differ by a multiple of 250 (with the same step),
    and a job's first 8 steps get blocks of their own.

    Args:
        environ: the mapping to read `SLURM_JOB_ID` and `SLURM_STEP_ID` from.

    Returns:
        The port of the first task on each node.

    Raises:
        kdist.errors.ClusterEnvironmentError: `SLURM_JOB_ID` or `SLURM_STEP_ID`
            is unset or not a non-negative integer; the message names the rule
            and `MASTER_PORT` as the way to choose the port instead.

    Example:

    >>> step_port_base({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"})
    30488
    """
    expected = (
        "a non-negative integer: without MASTER_PORT, kdist derives the rendezvous port from "
        f"SLURM_JOB_ID and SLURM_STEP_ID as {STEP_PORT_RULE}. Set MASTER_PORT to choose the port yourself"
    )
    job_id = read_integer(environ, "SLURM_JOB_ID", 0, 2**64, expected, "Slurm")
    step_id = read_integer(environ, "SLURM_STEP_ID", 0, 2**64, expected, "Slurm")
    return STEP_PORT_FIRST + STEP_PORT_BLOCK * ((job_id * 8 + step_id) % STEP_PORT_BLOCKS)
