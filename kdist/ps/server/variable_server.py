"""`create_server` and `VariableServer`: a running variable-service gRPC server."""

from concurrent import futures

import grpc

from kdist.cluster.address import bind_endpoint, format_address
from kdist.errors import InvalidArgumentError
from kdist.ps.options import ServiceOptions
from kdist.ps.server import memory
from kdist.ps.server.autosaver import Autosaver
from kdist.ps.server.servicer import VariableServicer
from kdist.ps.server.store import VariableStore
from kdist.rpc.security import Security

# How long `stop()` lets calls in flight finish when no grace is given.
DEFAULT_STOP_GRACE_SECONDS = 5.0
# `stop()` waits at most this long past the grace period for gRPC to shut down.
_STOP_MARGIN_SECONDS = 10.0


class VariableServer:
    """A started variable-service server. Thread-safe. Use `create_server` to make one.

    Attributes:
        port: the bound port (the real one when created with port 0).
        address: `"host:port"` with the bound port.
        store: the `kdist.ps.server.store.VariableStore` it serves.
    """

    def __init__(self, server, servicer, host, port):
        self._server = server
        self._servicer = servicer
        self.store = servicer.store
        # The `kdist.ps.server.autosaver.Autosaver` (its `restored`: the line it
        # logged at start, or None), or None without automatic checkpoints.
        self.autosaver = servicer.autosaver
        self.port = port
        self.address = format_address(host, port)

    def stats(self):
        """Returns this server's `ServerStats` without an RPC."""
        return self.store.stats()

    def stop(self, grace=None):
        """Stops serving and waits until the server has shut down.

        Args:
            grace: seconds that calls in flight may take to finish; new calls
                are refused at once. None: `DEFAULT_STOP_GRACE_SECONDS`; 0:
                cancel them now.

        Returns:
            True when the server shut down within `grace` plus a margin.
        """
        grace = DEFAULT_STOP_GRACE_SECONDS if grace is None else grace
        stopped = self._server.stop(grace).wait(grace + _STOP_MARGIN_SECONDS)
        if self.autosaver is not None:
            self.autosaver.close()  # after the last call: it saves what it applied
        return stopped

    def wait(self, timeout=None):
        """Blocks until the server stops or `timeout` seconds pass; returns True if stopped."""
        # grpc returns True when the timeout passed first.
        return not self._server.wait_for_termination(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.stop(0)

    def __repr__(self):
        return f"VariableServer(address={self.address!r})"


def create_server(address="127.0.0.1:0", *, options=None, security=None, name=None, layout=None):
    """Creates, binds and starts a variable-service server.

    Args:
        address: `"host:port"` to bind, exactly as given; port 0 picks a free
            port (read it from `server.port`). Defaults to loopback.
        options: `ServiceOptions` (chunk size, message limit, staleness bound,
            threads). Defaults to `ServiceOptions()`.
        security: `Security` (TLS, token) or None for plain text without a token.
        name: how logs name this server (e.g. `"ps-1"`); None: its address.
        layout: `(ps_index, num_ps)`, this server's place in its job, or None.
            With checkpoints, they record it, and a server whose directory
            `ROOT/ps-<ps_index>` (or its siblings `ROOT/ps-<j>`) holds the
            checkpoints of another number of servers re-splits them by this
            job's partitioning (`kdist.ps.server.reshard`). `kdist.distribute.Server`
            passes it from the cluster spec.

    With `options.checkpoint_dir` and `checkpoint_every`, the server restores
    the checkpoint it finds in its directory before it serves, then
    checkpoints itself there (`kdist.ps.server.autosaver`).

    Returns:
        The started `VariableServer`.

    Raises:
        kdist.errors.InvalidArgumentError: a malformed address, one that cannot
            be bound (in use, not local), wrong option types, or a damaged
            checkpoint in `options.checkpoint_dir`, a bad `layout`, or old
            checkpoints that cannot be re-split
            (`kdist.ps.server.reshard.CheckpointLayoutError`).

    Example:

    >>> server = create_server()  # doctest: +SKIP
    >>> client = VariableClient(server.address)  # doctest: +SKIP
    """
    options = ServiceOptions() if options is None else options
    security = Security() if security is None else security
    if not isinstance(options, ServiceOptions):
        raise InvalidArgumentError(
            f"options must be a ServiceOptions. Received: {type(options).__name__}."
        )
    if not isinstance(security, Security):
        raise InvalidArgumentError(
            f"security must be a Security. Received: {type(security).__name__}."
        )
    host, _ = bind_endpoint(address)
    memory.keep_freed_memory()  # a step's temporaries reused, not faulted in anew (process-wide)
    store = VariableStore(max_staleness=options.max_staleness,
                          allow_non_finite_gradients=options.allow_non_finite_gradients)
    autosaver = None
    if options.checkpoint_dir is not None:
        autosaver = Autosaver(store, options.checkpoint_dir, options.checkpoint_every,
                              name or address, layout=layout)
        autosaver.restore_at_start()  # before serving anything
    servicer = VariableServicer(store, options.chunk_bytes, options, autosaver)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=options.max_workers,
                                   thread_name_prefix="kdist-ps"),
        handlers=[servicer.handlers()],
        interceptors=security.server_interceptors(),
        # Without SO_REUSEPORT a second server on a taken port fails to bind
        # instead of silently sharing the port with the first.
        options=options.grpc_options() + [("grpc.so_reuseport", 0)],
    )
    try:
        port = security.bind(server, address, "parameter server")
    except BaseException:
        if autosaver is not None:
            autosaver.close()
        raise
    server.start()
    if autosaver is not None:
        autosaver.start()
    security.check_exposure("parameter server", host, port)
    return VariableServer(server, servicer, host, port)

