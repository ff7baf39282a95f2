"""Checks of `kdist.distribute.Server`'s arguments, validated once at construction.

Each returns the normalised value or raises `kdist.errors.InvalidArgumentError`
(or `UnsupportedError` for a value kdist understands but cannot honour) with
the argument's name and what was received.
"""

from collections.abc import Mapping

from kdist.cluster import ClusterResolver, ClusterSpec
from kdist.cluster.resolvers import check_task_types, require_task_in_cluster
from kdist.errors import InvalidArgumentError, UnsupportedError

# The one wire protocol kdist serves (TensorFlow's default too); TensorFlow's
# other values ("grpc+verbs", "grpc+gdr", ...) name transports kdist lacks.
SUPPORTED_PROTOCOLS = ("grpc",)


def _as_cluster_spec(cluster_spec):
    if isinstance(cluster_spec, ClusterSpec):
        return cluster_spec
    if isinstance(cluster_spec, ClusterResolver):
        return cluster_spec.cluster_spec()
    if isinstance(cluster_spec, Mapping):
        return ClusterSpec(cluster_spec)
    raise InvalidArgumentError(
        f"cluster_spec must describe the cluster. Received: cluster_spec={cluster_spec!r}. "
        "Expected a kdist.cluster.ClusterSpec, a dict such as {'ps': ['host:2222']}, or a "
        "ClusterResolver."
    )


def _check_task(cluster_spec, job_name, task_index):
    check_task_types(job_name, task_index, "job_name", "task_index")
    if job_name is None or task_index is None:
        raise InvalidArgumentError(
            f"A Server needs its task. Received: job_name={job_name!r}, "
            f"task_index={task_index!r}. Expected e.g. job_name='ps', task_index=0."
        )
    require_task_in_cluster(cluster_spec, job_name, task_index, "job_name", "task_index")
    return job_name, task_index


def _check_options(options):
    if options is None:
        return None
    from kdist.ps import ServiceOptions

    if not isinstance(options, ServiceOptions):
        raise InvalidArgumentError(
            f"options must be a kdist.ps.ServiceOptions. Received: options={options!r}."
        )
    return options


def _check_security(security):
    if security is None:
        return None
    from kdist.rpc.security import Security

    if not isinstance(security, Security):
        raise InvalidArgumentError(
            f"security must be a kdist.ps.Security. Received: security={security!r}."
        )
    # A configuration this server cannot serve fails here, not at start().
    security.server_credentials()
    return security


def check_protocol(protocol):
    """Returns `"grpc"` for `protocol` None or `"grpc"` (TensorFlow's values; kdist serves gRPC only).

    Raises:
        kdist.errors.UnsupportedError: another protocol, such as `"grpc+verbs"`.
        kdist.errors.InvalidArgumentError: not a string.

    Example:

    >>> check_protocol(None), check_protocol("grpc")
    ('grpc', 'grpc')
    """
    if protocol is None:
        return SUPPORTED_PROTOCOLS[0]
    if not isinstance(protocol, str):
        raise InvalidArgumentError(
            f"protocol must be a string such as 'grpc'. Received: protocol={protocol!r}."
        )
    if protocol not in SUPPORTED_PROTOCOLS:
        raise UnsupportedError(
            f"kdist servers speak gRPC only. Received: protocol={protocol!r}. Expected one of "
            f"{list(SUPPORTED_PROTOCOLS)} (or None). Configure TLS and a token with `security`."
        )
    return protocol


def check_config(config):
    """Accepts TensorFlow's `config=None`; refuses a session config kdist cannot honour.

    A `tf.compat.v1.ConfigProto` tunes TensorFlow's own runtime (thread
    pools, device counts, GPU memory); kdist's servers have no such runtime.
    Its thread pool is `kdist.ps.ServiceOptions(max_workers=...)`.

    Raises:
        kdist.errors.UnsupportedError: any `config` other than None.
    """
    if config is None:
        return None
    raise UnsupportedError(
        "kdist servers do not take a TensorFlow session config. Received: "
        f"config of type {type(config).__name__}. Expected config=None; size the variable "
        "service with options=kdist.ps.ServiceOptions(...) instead (a worker runs one closure at a time)."
    )
