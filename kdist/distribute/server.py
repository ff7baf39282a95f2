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
code its coordinator sends, so every server requires the cluster secret by
default (`kdist.ps.Security`: `KDIST_SECRET_FILE`, which `kdist launch` sets, or
this process's own secret for a cluster inside one process); add TLS beyond one
machine. The chief and evaluator need no server.

As in TensorFlow, a started server serves until `stop()` or the end of the
process, even when the program drops the `Server` object (TensorFlow's
tutorial creates its in-process cluster that way).

Differences from TensorFlow: `protocol` accepts only `"grpc"` (or None) and
`config` only None (`options` and `security` configure the servers), `target`
is the `"host:port"` a `kdist.ps.VariableClient` connects to (TensorFlow's is
a `grpc://` session target), and a server binds the loopback interface unless
`bind_address` says otherwise.
"""

import threading

from kdist.cluster.address import (
    DEFAULT_BIND_HOST,
    bind_endpoint,
    connect_host,
    format_address,
    resolve_bind_address,
)
from kdist.distribute.server_arguments import (
    _as_cluster_spec,
    _check_options,
    _check_security,
    _check_task,
    check_config,
    check_protocol,
)
from kdist.errors import InvalidArgumentError, UnsupportedError
from kdist.types import TaskType
from kdist.validation import is_seconds

_SERVED_JOBS = (TaskType.PS.value, TaskType.WORKER.value)
# Every started, not yet stopped `Server` of this process. Holding them here is
# what keeps a server serving after its program dropped the object (gRPC stops
# a server when it is garbage-collected); `stop()` removes it.
_serving = set()
_serving_lock = threading.Lock()


class Server:
    """The server of one task of a cluster; for a `"ps"` task, the variable service.

    Thread-safe: `start`, `join` and `stop` may be called from any thread.

    Args:
        cluster_spec: the cluster: a `kdist.cluster.ClusterSpec`, a dict such
            as `{"ps": ["10.0.0.2:2222"], "worker": [...]}`, or a
            `kdist.cluster.ClusterResolver` (its `cluster_spec()` is used).
        job_name: this task's job, e.g. `"ps"`.
        task_index: this task's index in its job.
        protocol: TensorFlow's argument: `"grpc"` or None (the same).
        config: TensorFlow's session config: only None.
        start: start serving at once, as TensorFlow's `Server` does.
        bind_address: where to listen: a host (`"0.0.0.0"`, the port is the
            task's port in `cluster_spec`) or `"host:port"`. Default:
            `127.0.0.1` at the task's port (this host only). A port of 0 in
            the cluster or here means "any free port" (see `port`).
        options: a `kdist.ps.ServiceOptions` (message sizes, thread pool,
            `max_staleness`, checkpoints, ...); None for the defaults. A `"ps"`
            task whose options set no `checkpoint_dir` takes `kdist launch`'s
            (`KDIST_PS_CHECKPOINT_EVERY` and `KDIST_PS_CHECKPOINT_DIR`,
            `kdist.ps.autosave`): it restores the checkpoint found there
            before serving, and checkpoints itself there.
        security: a `kdist.ps.Security` (the cluster secret, TLS files); None
            for the default: the cluster secret from the environment (else this
            process's own), plain text.

    Raises:
        kdist.errors.InvalidArgumentError: `cluster_spec` is malformed, the
            task is not in it, its address is not `"host:port"`, or
            `bind_address`, `options`, `security` or `protocol` has the
            wrong form.
        kdist.errors.UnsupportedError: `job_name` is not `"ps"` or
            `"worker"` (the chief runs the program, the evaluator
            `kdist.SidecarEvaluator`), a `protocol` other than gRPC, or a
            `config`.

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
        protocol=None,
        config=None,
        start=True,
        *,
        bind_address=None,
        options=None,
        security=None,
    ):
        self._protocol = check_protocol(protocol)
        check_config(config)
        self._cluster_spec = _as_cluster_spec(cluster_spec)
        self._job_name, self._task_index = _check_task(self._cluster_spec, job_name, task_index)
        task_address = self._cluster_spec.task_address(job_name, task_index)
        _, task_port = bind_endpoint(task_address, f'cluster_spec["{job_name}"][{task_index}]')
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
            host, _ = bind_endpoint(self._bind_address, "bind_address")
            return format_address(host, self.port)
        return self._bind_address

    @property
    def port(self):
        """The port the server listens on: the bound port once started."""
        if self._server is not None:
            return self._server.port
        return bind_endpoint(self._bind_address, "bind_address")[1]

    @property
    def target(self):
        """The `"host:port"` a client on this host connects to (`kdist.ps.VariableClient`).

        The bind host, or loopback when the server listens on every interface.
        """
        host, _ = bind_endpoint(self._bind_address, "bind_address")
        return format_address(connect_host(host), self.port)

    @property
    def protocol(self):
        """The wire protocol: always `"grpc"`."""
        return self._protocol

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
                    from kdist.ps import ServiceOptions, create_server
                    from kdist.ps import autosave

                    # Checkpoint settings: the program's options, else `kdist launch`'s.
                    options = autosave.with_environment(self._options or ServiceOptions())
                    self._server = create_server(
                        self._bind_address, options=options, security=self._security,
                        name=f"{self._job_name}-{self._task_index}",
                        # Its place in the job: checkpoints of another number
                        # of servers are re-split (kdist.ps.server.reshard).
                        layout=(self._task_index, self._cluster_spec.num_tasks(self._job_name)),
                    )
                with _serving_lock:
                    _serving.add(self)
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
        if timeout is not None and not is_seconds(timeout, allow_zero=True, allow_infinite=True):
            raise InvalidArgumentError(
                f"timeout must be None or a number of seconds >= 0. Received: timeout={timeout!r}."
            )
        return server.wait(timeout)

    def stop(self, grace=None):
        """Stops serving and waits until the server has shut down; idempotent.

        Args:
            grace: seconds that calls in flight may take to finish; new calls
                are refused at once. None: the variable service's default
                (`kdist.ps.server.variable_server.DEFAULT_STOP_GRACE_SECONDS`); 0: cancel them.
        """
        with self._lock:
            server = self._server
            already = self._stopped
            self._stopped = True
        with _serving_lock:
            _serving.discard(self)
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
