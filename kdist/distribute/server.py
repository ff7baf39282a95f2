"""`Server`: the in-process server of one task of a cluster (`tf.distribute.Server`).

A program that branches on its role starts the server of a parameter-server
task in one line and serves until stopped:

```python
resolver = kdist.cluster.TFConfigClusterResolver()
if resolver.task_type == "ps":
    kdist.distribute.Server(resolver.cluster_spec(), "ps", resolver.task_id).join()
```

A `"ps"` task serves the variable service (`kdist.ps`): the variables placed on
it, their optimizer state, pushes and pulls. A `"worker"` task serves the
worker service (`kdist.coordinator`): it runs the functions a
`ClusterCoordinator` on the chief schedules onto it. A worker executes the
code its coordinator sends: give every task the cluster's token (`security`),
and TLS beyond one machine. The chief and evaluator need no server.

Differences from TensorFlow: there is no `protocol`/`config` (the protocol is
always gRPC; `options` and `security` configure it), `target` is the
`"host:port"` a `kdist.ps.VariableClient` connects to (TensorFlow's is a
`grpc://` session target), and a server binds the loopback interface unless
`bind_address` says otherwise.
"""

import threading
from collections.abc import Mapping

from kdist.cluster import ClusterResolver, ClusterSpec
from kdist.cluster.spec import format_address, split_address
from kdist.cluster.resolvers import check_task_types
from kdist.errors import InvalidArgumentError, UnsupportedError
from kdist.types import TaskType

# Where a server listens unless told otherwise: reachable from this host only,
# so a cluster is never exposed to the network by accident.
DEFAULT_BIND_HOST = "127.0.0.1"
# Hosts that mean "every interface"; a client on this host reaches them through loopback.
_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1"}
_SERVED_JOBS = (TaskType.PS.value, TaskType.WORKER.value)


class Server:
    """The server of one task of a cluster; for a `"ps"` task, the variable service.

    Thread-safe: `start`, `join` and `stop` may be called from any thread.

    Args:
        cluster_spec: the cluster: a `kdist.cluster.ClusterSpec`, a dict such
            as `{"ps": ["10.0.0.2:2222"], "worker": [...]}`, or a
            `kdist.cluster.ClusterResolver` (its `cluster_spec()` is used).
        job_name: this task's job, e.g. `"ps"`.
        task_index: this task's index in its job.
        bind_address: where to listen: a host (`"0.0.0.0"`, the port is the
            task's port in `cluster_spec`) or `"host:port"`. Default:
            `127.0.0.1` at the task's port (this host only). A port of 0 in
            the cluster or here means "any free port" (see `port`).
        options: a `kdist.ps.ServiceOptions` (message sizes, thread pool,
            `max_staleness`, ...); None for the defaults.
        security: a `kdist.ps.Security` (TLS files, shared token); None for
            plain text without a token.
        start: start serving at once, as TensorFlow's `Server` does.

    Raises:
        kdist.errors.InvalidArgumentError: `cluster_spec` is malformed, the
            task is not in it, its address is not `"host:port"`, or
            `bind_address`, `options` or `security` has the wrong form.
        kdist.errors.UnsupportedError: `job_name` is not `"ps"`: worker and
            chief servers come with the `ClusterCoordinator`.

    Example:

    >>> server = Server({"ps": ["127.0.0.1:0"]}, "ps", 0)
    >>> client = kdist.ps.VariableClient(server.target)  # doctest: +SKIP
    >>> server.stop()
    """

    def __init__(
        self,
        cluster_spec,
        job_name,
        task_index,
        *,
        bind_address=None,
        options=None,
        security=None,
        start=True,
    ):
        self._cluster_spec = _as_cluster_spec(cluster_spec)
        self._job_name, self._task_index = _check_task(self._cluster_spec, job_name, task_index)
        task_address = self._cluster_spec.task_address(job_name, task_index)
        _, task_port = split_address(
            task_address,
            f'cluster_spec["{job_name}"][{task_index}]',
            allow_port_zero=True,
        )
        if job_name not in _SERVED_JOBS:
            raise UnsupportedError(
                f"kdist.distribute.Server serves 'ps' and 'worker' tasks. Received: "
                f"job_name={job_name!r}. The chief runs the training program (and the "
                "ClusterCoordinator) and the evaluator runs kdist.SidecarEvaluator; neither serves."
            )
        self._bind_address = resolve_bind_address(bind_address, task_port)
        self._options = _check_options(options)
        self._security = _check_security(security)
        self._lock = threading.Lock()
        self._server = None
        self._stopped = False
        if not isinstance(start, bool):
            raise InvalidArgumentError(f"start must be a bool. Received: start={start!r}.")
        if start:
            self.start()

    @classmethod
    def create_local_server(cls, *, options=None, security=None, start=True):
        """Returns a `Server` for a one-task `"ps"` cluster on a free loopback port.

        Example:

        >>> server = Server.create_local_server()
        >>> server.port > 0
        True
        >>> server.stop()
        """
        return cls(
            {TaskType.PS.value: [f"{DEFAULT_BIND_HOST}:0"]},
            TaskType.PS.value,
            0,
            options=options,
            security=security,
            start=start,
        )

    @property
    def cluster_spec(self):
        """The cluster, as a `kdist.cluster.ClusterSpec`."""
        return self._cluster_spec

    @property
    def job_name(self):
        """This task's job."""
        return self._job_name

    @property
    def task_index(self):
        """This task's index in its job."""
        return self._task_index

    @property
    def bind_address(self):
        """The `"host:port"` the server listens on (port 0 until started, if so configured)."""
        if self._server is not None:
            host, _ = split_address(self._bind_address, "bind_address", allow_port_zero=True)
            return format_address(host, self.port)
        return self._bind_address

    @property
    def port(self):
        """The port the server listens on: the bound port once started."""
        if self._server is not None:
            return self._server.port
        return split_address(self._bind_address, "bind_address", allow_port_zero=True)[1]

    @property
    def target(self):
        """The `"host:port"` a client on this host connects to (`kdist.ps.VariableClient`).

        The bind host, or loopback when the server listens on every interface.
        """
        host, _ = split_address(self._bind_address, "bind_address", allow_port_zero=True)
        return format_address(_WILDCARD_HOSTS.get(host, host), self.port)

    @property
    def started(self):
        """True while the server is serving (started and not stopped)."""
        return self._server is not None and not self._stopped

    def start(self):
        """Starts serving; does nothing when already serving.

        Raises:
            kdist.errors.UnsupportedError: the server was stopped (a stopped
                gRPC server cannot serve again; create a new `Server`).
            kdist.errors.InvalidArgumentError: the address cannot be bound
                (as raised by `kdist.ps.create_server`).
        """
        with self._lock:
            if self._stopped:
                raise UnsupportedError(
                    "A stopped Server cannot be started again. Received: start() after stop() "
                    f"for {self._job_name}:{self._task_index}. Expected a new Server instead."
                )
            if self._server is None:
                # Imported here so that `import kdist.distribute` does not load gRPC.
                if self._job_name == TaskType.WORKER.value:
                    from kdist.coordinator import create_worker_server

                    self._server = create_worker_server(
                        self._bind_address, self._cluster_spec, self._task_index, security=self._security
                    )
                else:
                    from kdist.ps import create_server

                    self._server = create_server(
                        self._bind_address, options=self._options, security=self._security
                    )
        return self

    def join(self, timeout=None):
        """Blocks until the server stops (another thread's `stop`, a signal handler's).

        Args:
            timeout: seconds to wait at most; None waits as long as it serves.

        Returns:
            True when the server has stopped, False when `timeout` passed first.

        Raises:
            kdist.errors.UnsupportedError: the server was never started, so
                nothing could ever stop it.
        """
        server = self._server
        if server is None:
            raise UnsupportedError(
                "join() waits for a serving Server to stop, but this one was never started. "
                "Received: Server(..., start=False) without start(). Expected start() first."
            )
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            raise InvalidArgumentError(
                f"timeout must be None or a number of seconds >= 0. Received: timeout={timeout!r}."
            )
        return server.wait(timeout)

    def stop(self, grace=None):
        """Stops serving and waits until the server has shut down; idempotent.

        Args:
            grace: seconds that calls in flight may take to finish; new calls
                are refused at once. None: the variable service's default
                (`kdist.ps.server.DEFAULT_STOP_GRACE_SECONDS`); 0: cancel them.
        """
        with self._lock:
            server = self._server
            already = self._stopped
            self._stopped = True
        if server is not None and not already:
            server.stop(grace)

    def stats(self):
        """Returns the variable service's `kdist.ps.ServerStats` (this process's view).

        A worker's server returns `{"instance_id": ..., "closures_run": n}`.
        """
        if self._server is not None and self._job_name == TaskType.WORKER.value:
            servicer = self._server.servicer
            return {"instance_id": servicer.instance_id, "closures_run": servicer.closures_run}
        if self._server is None:
            raise UnsupportedError(
                "stats() needs a started Server. Received: a Server never started."
            )
        return self._server.stats()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()
        return False

    def __repr__(self):
        state = "serving" if self.started else ("stopped" if self._stopped else "not started")
        return (
            f"Server(job_name={self._job_name!r}, task_index={self._task_index}, "
            f"bind_address={self.bind_address!r}, {state})"
        )


def resolve_bind_address(bind_address, task_port):
    """Returns the `"host:port"` to listen on.

    Args:
        bind_address: None (loopback), a host (`"0.0.0.0"`, `"::"`,
            `"[::]"`, `"10.0.0.2"`), or `"host:port"` (`"0.0.0.0:2222"`,
            `"[::]:2222"`).
        task_port: the task's port in the cluster, used when `bind_address`
            has none.

    Raises:
        kdist.errors.InvalidArgumentError: `bind_address` is not a string of
            one of those forms.

    Example:

    >>> resolve_bind_address(None, 2222), resolve_bind_address("::", 2222)
    ('127.0.0.1:2222', '[::]:2222')
    """
    if bind_address is None:
        return format_address(DEFAULT_BIND_HOST, task_port)
    expected = (
        "Expected a host such as '0.0.0.0' (the task's port is used) or 'host:port' such as "
        "'0.0.0.0:2222'; IPv6 as '::' or '[::]:2222'."
    )
    if not isinstance(bind_address, str) or not bind_address.strip():
        raise InvalidArgumentError(
            f"bind_address must be a non-empty string. Received: bind_address={bind_address!r}. "
            f"{expected}"
        )
    if bind_address.startswith("[") and bind_address.endswith("]"):
        host = bind_address[1:-1]
    elif bind_address.count(":") > 1 and not bind_address.startswith("["):
        host = bind_address  # A bare IPv6 address: no port.
    elif ":" in bind_address:
        host, port = split_address(bind_address, "bind_address", allow_port_zero=True)
        return format_address(host, port)
    else:
        host = bind_address
    if not host or any(character.isspace() or character in "/@[]" for character in host):
        raise InvalidArgumentError(
            f"bind_address has a malformed host. Received: bind_address={bind_address!r}. "
            f"{expected}"
        )
    return format_address(host, task_port)


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
    if job_name not in cluster_spec.jobs:
        raise InvalidArgumentError(
            f"The job is not in the cluster. Received: job_name={job_name!r}. Expected one of "
            f"the cluster's jobs: {cluster_spec.jobs}."
        )
    indices = cluster_spec.task_indices(job_name)
    if task_index not in indices:
        raise InvalidArgumentError(
            f"The job has no such task. Received: task_index={task_index!r}. Expected one of "
            f"the indices of job {job_name!r}: {indices}."
        )
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
    from kdist.ps.security import Security

    if not isinstance(security, Security):
        raise InvalidArgumentError(
            f"security must be a kdist.ps.Security. Received: security={security!r}."
        )
    # A configuration this server cannot serve fails here, not at start().
    security.server_credentials()
    return security
