"""`resolve_cluster`: the resolver a strategy uses when the user passes none."""

import os

from kdist.cluster.resolvers import ClusterResolver, SimpleClusterResolver
from kdist.cluster.spec import ClusterSpec
from kdist.cluster.tf_config import TF_CONFIG, TFConfigClusterResolver
from kdist.cluster.torchrun import TorchrunClusterResolver
from kdist.errors import InvalidArgumentError
from kdist.types import TaskType

# A process outside any cluster is worker 0 of a one-task cluster. Port 0
# means "any free port": nobody else has to find rank 0's store.
LOCAL_ADDRESS = "127.0.0.1:0"


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
       `MASTER_PORT`) give a `TorchrunClusterResolver`. torchrun wins over
       `TF_CONFIG` because it is the launcher that actually started the
       processes; a `TF_CONFIG` left in the environment is often stale.
    2. a `TF_CONFIG` with a non-empty cluster gives a `TFConfigClusterResolver`;
    3. otherwise `local_cluster_resolver()`: one process, rank 0 of 1.

    Args:
        cluster_resolver: a `ClusterResolver` to use as is, or None.
        environ: the mapping to read variables from; None reads `os.environ`.

    Returns:
        A `ClusterResolver`.

    Raises:
        kdist.errors.InvalidArgumentError: `cluster_resolver` is not a
            `ClusterResolver`, or the chosen environment is malformed
            (a malformed `TF_CONFIG` is an error, never silently ignored).

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
    return local_cluster_resolver()
