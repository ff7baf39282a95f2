"""`VariableClient`: the worker's and coordinator's end of the variable service."""

import threading

import grpc
import grpc.experimental
import numpy as np

from kdist.cluster.address import parse_address
from kdist.ps.client import retry as client_retry
from kdist.ps.wire import codec
from kdist.ps.wire._generated import variable_service_pb2 as pb
from kdist.ps.client.payload import (
    assignment_payload,
    encode_gradient,
    ids_array,
    optimizer_state_payload,
    read_optimizer_state,
    variables_layout,
)
from kdist.ps.options import ServiceOptions
from kdist.ps.wire.conventions import canonical_config
from kdist.ps.wire.methods import METHODS
from kdist.rpc.security import Security
from kdist.ps.wire.values import (PushResult, ServerStats, StalenessStats, VariableState, VariableStats,
                                   check_name, check_outcome, check_update_id)

# (initial, max) milliseconds between reconnection attempts of the channel.
RECONNECT_BACKOFF_MS = (100, 1000)
# Response streams are read in the calling thread. Without it grpcio starts
# (and ends) a channel thread for every call made while no other call is in
# flight, which is every call of a worker's step.
CALLING_THREAD_OPTIONS = ((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),)


class VariableClient:
    """A client of one variable-service server. Thread-safe; one gRPC channel.

    Every method is one RPC. Tensors may be NumPy arrays or torch CPU tensors
    and must not change during the call; returned tensors are writable,
    C-contiguous NumPy arrays. Until a call has succeeded once, calls wait up
    to `connect_timeout_seconds` for the server to come up.

    Args:
        address: the server's `"host:port"`.
        options: `ServiceOptions` (chunk size, message limit, deadlines).
        security: `Security` (TLS, token) or None.

    Raises:
        kdist.errors.InvalidArgumentError: a malformed address or option.
        kdist.errors.ParameterServerUnavailableError: (from calls; retryable)
            the server cannot be reached within the deadline.
        kdist.errors.ParameterServerError: (from calls) the server refused the
            request; `code_name` says why (`UnauthenticatedError` for a
            missing or wrong token).

    Example:

    >>> with VariableClient(server.address) as client:  # doctest: +SKIP
    ...     client.create([VariableInit("w", np.zeros(3, "float32"))])
    ...     client.configure_optimizer(keras.optimizers.serialize(keras.optimizers.SGD(0.1)), ["w"])
    ...     client.push([DenseGradient("w", np.ones(3, "float32"), version=0)])
    ...     [state] = client.pull(["w"])
    """

    def __init__(self, address, *, options=None, security=None):
        parse_address(address)
        self.address = address
        self.options = ServiceOptions() if options is None else options
        security = Security() if security is None else security
        channel_options = self.options.grpc_options() + [
            # A restarted parameter server is reconnected to within a second,
            # inside the retry policy's window, instead of gRPC's default 1-120 s.
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
            *CALLING_THREAD_OPTIONS,
        ]
        # Proves the cluster secret and checks the server's proof (kdist.rpc.auth).
        self._channel = security.channel(address, channel_options)
        self._metadata = ()
        self._calls = {name: method.callable(self._channel) for name, method in METHODS.items()}
        # A request of one message goes out as a unary call (`Method.single_request_callable`).
        self._single_calls = {name: method.single_request_callable(self._channel)
                              for name, method in METHODS.items() if method.request_streaming}
        self._connected = False  # set by the first call that succeeds
        self._gone_since = None  # since when its server is gone (`client_retry`)
        self._closed = threading.Event()  # wakes a retry's backoff on close()

    # -- Calls ----------------------------------------------------------------------

    def _call(self, name, request, read=None, timeout=None, wait_for_ready=None, retry=True):
        """Runs one call, retried on UNAVAILABLE while `retry` and time allow (`client_retry`)."""
        return client_retry.call(self, name, request, read, timeout, wait_for_ready, retry)

    def _stream(self, header, arrays):
        return codec.encode_stream(header, [codec.byte_view(array) for array in arrays],
                                   self.options.chunk_bytes)

    # -- Variables ----------------------------------------------------------------------

    def create(self, items):
        """Creates variables; existing ones keep their value (the first creator wins).

        Args:
            items: `VariableInit`s with distinct names.

        Returns:
            One `VariableState` per item, in order, with the server's value
            (this caller's own for the variables it created) and version.

        Raises:
            kdist.errors.ParameterServerError: `INVALID_ARGUMENT` when a variable
                exists with another shape, dtype or trainable flag.
        """
        arrays = [codec.as_array(item.value, f"the value of {item.name!r}") if item.initializer is None
                  else np.asarray(item.value)  # its shape and dtype only (no payload)
                  for item in items]
        header = pb.CreateHeader(items=[
            pb.CreateItem(name=item.name, value=codec.tensor_meta(array), trainable=item.trainable,
                          initializer=_server_initializer(item.initializer),
                          shard=None if item.shard is None else pb.ShardOrigin(
                              full_shape=list(item.shard.full_shape), row_start=int(item.shard.row_start)))
            for item, array in zip(items, arrays)
        ])
        sent = [array for item, array in zip(items, arrays) if item.initializer is None]

        def read(frames):
            response, values = codec.read_stream(frames, variables_layout, "create response")
            values = iter(values)
            return [
                VariableState(meta.name, next(values) if meta.has_value
                              else None if item.initializer is not None else array.copy(), meta.version)
                for meta, item, array in zip(response.variables, items, arrays)
            ]

        return self._call("Create", lambda: self._stream(header, sent), read)

    def pull(self, names, known_versions=None, out=None):
        """Returns the `VariableState` of each name; value None when its version is known.

        Args:
            names: variable names.
            known_versions: name -> the version the caller holds; values of
                unchanged variables are not sent.
            out: name -> a writable C-contiguous NumPy array of the variable's
                dtype and shape to receive its value in place (the returned
                state's value is then that array). Saves a copy and a fresh
                allocation per pull; names missing here get new arrays.

        Raises:
            kdist.errors.ParameterServerError: `NOT_FOUND` for an unknown name.
        """
        names = list(names)
        for name in names:
            check_name(name)
        request = pb.PullRequest(names=names, known_versions=dict(known_versions or {}))

        targets = []

        def layout(header):
            targets.extend((out or {}).get(meta.name) for meta in header.variables if meta.has_value)
            return variables_layout(header)

        def allocate(index, dtype, shape):
            target = targets[index]
            if (target is not None and target.dtype == dtype and target.shape == tuple(shape)
                    and target.flags.c_contiguous and target.flags.writeable):
                return target
            return None

        def read(frames):
            response, values = codec.read_stream(frames, layout, "pull response", allocate)
            values = iter(values)
            return [VariableState(meta.name, next(values) if meta.has_value else None,
                                  meta.version) for meta in response.variables]

        return self._call("Pull", request, read)

    def push(self, gradients, assignments=(), update_id=None, outcome=b""):
        """Applies gradients with the server's optimizer, then assignments.

        Each gradient is applied atomically under its variable's lock. The whole
        request is validated before anything is applied.

        Args:
            gradients: `DenseGradient`s and `RowGradient`s, one per variable.
            assignments: `Assignment`s (new values) applied after the gradients.
            update_id: an idempotency key of at most 256 characters, or None
                (or ""): a fresh one of this process. The server applies a push whose `update_id` it
                has already applied (among its most recent
                `kdist.ps.server.store.MAX_REMEMBERED_UPDATES`) only once: a repeat
                changes nothing and returns the first push's `PushResult`. So a
                push whose outcome is unknown (its worker died, the connection
                dropped) can be sent again safely. A push the server refused
                (`INVALID_ARGUMENT`, ...) does not use up its id.
            outcome: at most 1 MiB computed with these gradients (a closure's
                metric state), kept with `update_id`: a repeat gets it back.

        Returns:
            A `PushResult`.

        Raises:
            kdist.errors.InvalidArgumentError: an `update_id` that is not a
                string of at most 256 characters, or a bad `outcome`.
            kdist.errors.ParameterServerError: `NOT_FOUND` (unknown variable),
                `INVALID_ARGUMENT` (shape, dtype, row id, non-trainable target,
                a variable twice), `FAILED_PRECONDITION` (no optimizer).

        Example:

        >>> client.push([DenseGradient("w", gradient)], update_id="closure-17/0")  # doctest: +SKIP
        """
        check_update_id(update_id)
        check_outcome(outcome)
        metas, arrays = [], []
        for gradient in gradients:
            meta, payload = encode_gradient(gradient)
            metas.append(meta)
            arrays.extend(payload)
        assignment_metas, assignment_arrays = assignment_payload(assignments)
        header = pb.PushHeader(gradients=metas, assignments=assignment_metas,
                               update_id=client_retry.update_id_or_fresh(update_id),
                               outcome=bytes(outcome))
        # Sent again (server restarting) with its id: applied once in all.
        response = self._call("Push", lambda: self._stream(header, arrays + assignment_arrays))
        return PushResult(dict(response.versions), tuple(response.rejected),
                          dict(response.staleness), response.deduplicated, response.outcome)

    def assign(self, assignments, update_id=None):
        """Replaces variables' values; returns name -> new version.

        Args:
            assignments: `Assignment`s.
            update_id: an idempotency key, as in `push` (pushes and assigns
                share the server's memory of applied ids).

        Raises:
            kdist.errors.InvalidArgumentError: a bad `update_id` (see `push`).
            kdist.errors.ParameterServerError: `NOT_FOUND` or `INVALID_ARGUMENT`.
        """
        check_update_id(update_id)
        metas, arrays = assignment_payload(assignments)
        header = pb.PushHeader(assignments=metas,
                               update_id=client_retry.update_id_or_fresh(update_id))
        return dict(self._call("Assign", lambda: self._stream(header, arrays)).versions)

    def lookup(self, requests):
        """Gathers rows (axis 0) of variables in one call.

        Args:
            requests: `(name, ids)` pairs; ids are integers of any shape.

        Returns:
            One `(rows, version)` per request: rows have shape
            `ids.shape + variable.shape[1:]`.

        Raises:
            kdist.errors.ParameterServerError: `NOT_FOUND`, or
                `INVALID_ARGUMENT` for ids out of range.
        """
        items, arrays = [], []
        for name, ids in requests:
            check_name(name)
            ids = ids_array(ids, f"lookup ids of {name!r}")
            items.append(pb.LookupItem(name=name, ids=codec.tensor_meta(ids)))
            arrays.append(ids)

        def read(frames):
            response, rows = codec.read_stream(
                frames, lambda header: [codec.parse_meta(result.rows, "rows")
                                        for result in header.results], "lookup response")
            return [(value, result.version) for value, result in zip(rows, response.results)]

        return self._call("Lookup", lambda: self._stream(pb.LookupHeader(items=items), arrays),
                          read)

    # -- Optimizers ------------------------------------------------------------------------

    def configure_optimizer(self, config, names):
        """Gives each named variable its own server-side optimizer built from `config`.

        Args:
            config: `keras.optimizers.serialize(optimizer)`.
            names: trainable variables. Configuring a variable again with the
                same config does nothing.

        Raises:
            kdist.errors.ParameterServerError: `FAILED_PRECONDITION` when a
                variable already has another config; `INVALID_ARGUMENT` for a
                config Keras cannot rebuild.
        """
        names = list(names)
        for name in names:
            check_name(name)
        request = pb.ConfigureOptimizerRequest(config_json=canonical_config(config), names=names)
        self._call("ConfigureOptimizer", request)

    def optimizer_state(self, names):
        """Returns name -> `OptimizerState` (iterations and slots in creation order)."""
        request = pb.OptimizerStateRequest(names=list(names))
        return self._call("OptimizerState", request, read_optimizer_state)

    def load_optimizer_state(self, states):
        """Sets the optimizer iterations and slots of configured variables (all or nothing).

        Args:
            states: name -> `OptimizerState`, every slot of each variable given
                (as `optimizer_state` returns them).

        Raises:
            kdist.errors.ParameterServerError: `FAILED_PRECONDITION` for a
                variable without an optimizer, `INVALID_ARGUMENT` for a missing,
                unknown or misshapen slot, `NOT_FOUND` for an unknown variable.
        """
        header, arrays = optimizer_state_payload(states)
        self._call("LoadOptimizerState", lambda: self._stream(header, arrays))

    # -- Checkpoints, counters, health -----------------------------------------------------

    def save(self, directory):
        """Saves every variable to `directory` on the server's file system (atomic)."""
        self._call("Save", pb.CheckpointRequest(directory=str(directory)))

    def restore(self, directory):
        """Restores the variables saved in `directory` on the server (all-or-nothing)."""
        self._call("Restore", pb.CheckpointRequest(directory=str(directory)))

    def stats(self):
        """Returns the server's `ServerStats`."""
        response = self._call("Stats", pb.StatsRequest())
        return ServerStats(
            variables={
                item.name: VariableStats(item.version, item.applied_updates,
                                         item.rejected_updates, tuple(item.shape), item.dtype,
                                         item.num_bytes, item.sparse_applies, item.dense_applies,
                                         item.rows_updated)
                for item in response.variables
            },
            requests=dict(response.requests),
            bytes_received=response.bytes_received,
            bytes_sent=response.bytes_sent,
            applied_pushes=response.applied_pushes,
            deduplicated_updates=response.deduplicated_updates,
            staleness=StalenessStats.from_histogram(dict(response.staleness_histogram)),
        )

    def health(self, timeout=None):
        """Returns the server's health: `{"status", "num_variables", "uptime_seconds", "pid"}`.

        Does not wait for a server that is not up yet (see `wait_until_ready`).
        """
        return _health(self._call("Health", pb.HealthRequest(), timeout=timeout, wait_for_ready=False))

    def wait_until_ready(self, timeout):
        """Waits until the server answers; returns its `health()`.

        Raises:
            kdist.errors.ParameterServerUnavailableError: not up within `timeout`.
        """
        return _health(self._call("Health", pb.HealthRequest(), timeout=timeout, wait_for_ready=True))

    def give_up(self):
        """Declares the server gone for good: calls waiting for it to come back, and later
        ones that find it unavailable, raise `ParameterServerUnavailableError` at once
        (see `kdist.ps.client.retry.give_up`)."""
        client_retry.give_up(self)

    @property
    def closed(self):
        """True once `close()` was called: every call then raises `ValueError`."""
        return self._closed.is_set()

    def close(self):
        """Closes the channel; calls in flight are cancelled."""
        self._closed.set()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        return f"VariableClient(address={self.address!r})"


def _server_initializer(spec):
    if spec is None:
        return None
    return pb.ServerInitializer(config_json=spec.config_json, full_shape=list(spec.full_shape),
                                row_start=int(spec.row_start))


def _health(response):
    return {"status": response.status, "num_variables": response.num_variables,
            "uptime_seconds": response.uptime_seconds, "pid": response.pid}
