"""`ServiceOptions`: the tunables of a variable-service server and client."""

import dataclasses

from kdist.errors import InvalidArgumentError
from kdist.validation import is_integer, is_seconds

# Tensors stream in messages of this many payload bytes. Measured on loopback
# (64 MiB float32, grpcio 1.85): 1-2 MiB chunks are the fastest, 4-8 MiB are
# ~10-15% slower (larger buffers fall out of cache and gRPC copies each one),
# 256 KiB pays too much per-message overhead. Unary messages of tens of MiB
# collapse to ~0.2 GB/s, which is why nothing large travels unchunked.
DEFAULT_CHUNK_BYTES = 1 << 20
# A message holds at most one chunk plus its header; 16 MiB leaves room for the
# header of a request that names many thousands of variables.
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
# Room a message needs beyond its chunk: the protobuf tags and lengths, and a
# small header in the first message of a stream.
FRAMING_BYTES = 64 << 10
# Long enough to move a few GiB at loopback speed; a hung server still fails
# the call instead of blocking the worker forever.
DEFAULT_RPC_TIMEOUT_SECONDS = 120.0
# Servers in a cluster start at different times; a first call waits this long
# for its server to come up before it reports the server unavailable.
DEFAULT_CONNECT_TIMEOUT_SECONDS = 60.0
# Each streaming call holds one server thread while it runs: enough for a
# dozen workers pushing and pulling at once on one parameter server.
DEFAULT_MAX_WORKERS = 16
# Threads kept free of streaming calls (at most half the pool), so that unary
# calls (`Health`, `Stats`, `ConfigureOptimizer`, `Save`) always find one even
# when every stream slot is taken by a client that stalls.
RESERVED_UNARY_THREADS = 4
# One client (one `VariableClient`: its authenticated session; without the
# cluster secret, its connection) may hold this many streams at once: a
# worker's client runs a few calls at a time, and one greedy or stalled
# client then cannot take every stream slot of the server.
DEFAULT_MAX_STREAMS_PER_PEER = 8
# A stream that neither delivers a request message nor accepts a response
# message for this long is cancelled: a healthy client sends its next 1 MiB
# chunk within milliseconds, and a stalled one must not hold a thread forever.
DEFAULT_STREAM_IDLE_SECONDS = 30.0
# A parameter server that is gone after having answered (killed, restarting)
# is waited for this long before a call gives up: `kdist launch` restarts a
# dead ps within seconds (1 s delay, start-up ~4-9 s, its restore). Longer would
# not help coordinator training, whose health checks give a ps 15 s
# (`ClusterCoordinator(ps_unavailable_seconds=...)`), and would hold a chief
# whose ps never comes back past that bound.
DEFAULT_RECOVERY_TIMEOUT_SECONDS = 20.0


@dataclasses.dataclass(frozen=True)
class ServiceOptions:
    """Tunables of the variable service, shared by server and client.

    Args:
        chunk_bytes: payload bytes per streamed message. Larger tensors are
            split into messages of this size.
        max_message_bytes: the largest message a server or client sends or
            accepts; a larger one fails with `RESOURCE_EXHAUSTED`. Must be at
            least `chunk_bytes + FRAMING_BYTES`.
        rpc_timeout_seconds: the deadline of every call.
        connect_timeout_seconds: how long a client's first call waits for a
            server that is still starting (gRPC `wait_for_ready`), on top of
            `rpc_timeout_seconds`.
        max_staleness: server side: a gradient computed from a version more
            than this many updates behind the server's is rejected (not
            applied, counted, listed in `PushResult.rejected`). None: every
            gradient is applied.
        max_workers: server side: threads serving calls; at least 2.
        max_concurrent_streams: server side: streaming calls (every method
            but the unary ones: `Health`, `Stats`, `ConfigureOptimizer`,
            `Save`, `Restore`) served at once; more are refused at once with
            `RESOURCE_EXHAUSTED` before any of their request is read, and
            kdist's clients send them again after a jittered backoff within
            the call's deadline (`rpc_timeout_seconds`), so the job's own
            load waits rather than fails. Must be below `max_workers`, so that
            unary calls always find a thread. None: `max_workers` minus
            `RESERVED_UNARY_THREADS` (at most half of them).
        max_streams_per_peer: server side: streaming calls one client may
            have open at once (a client is one `VariableClient`, told apart
            by its authenticated session even when a process's channels share
            one connection; without the cluster secret, one connection); more
            are refused and retried as above. Capped at `max_concurrent_streams`.
        stream_idle_seconds: server side: a streaming call that waits this
            long for its client (no request message arrives, or a response
            message is not taken) is cancelled, freeing its thread.
        allow_non_finite_gradients: server side: apply gradients that hold
            NaN or infinity. False (the default): such a push is refused with
            `INVALID_ARGUMENT` naming the variable, and nothing changes;
            except that a variable whose optimizer is a `LossScaleOptimizer`
            always gets them (it skips that step and lowers its loss scale).
        recovery_timeout_seconds: client side: a server that answered before
            and is now gone (`UNAVAILABLE`: killed, restarting) is called
            again, with jittered backoff and the same update id, until it
            comes back or this long after it went, within the call's
            deadline; then the call raises `ParameterServerUnavailableError`
            saying the server did not come back. `health()` is a probe and
            is not held up.
        checkpoint_dir: server side: this server's own directory; with
            `checkpoint_every` it checkpoints itself there, and restores the
            checkpoint it finds there before serving (`kdist.ps.autosave`).
            None: no automatic checkpoints (`kdist.distribute.Server` then
            reads `kdist launch`'s variables).
        checkpoint_every: server side: a `kdist.ps.autosave.CheckpointEvery`
            or its text: `"N"` (every N applied pushes, saved before the
            N-th push is answered) or `"Ns"` (every N seconds). Needs
            `checkpoint_dir`.

    Raises:
        kdist.errors.InvalidArgumentError: a value of the wrong type or range.

    Example:

    >>> options = ServiceOptions(chunk_bytes=2 << 20, max_staleness=4)
    >>> options.max_message_bytes >= options.chunk_bytes
    True
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    rpc_timeout_seconds: float = DEFAULT_RPC_TIMEOUT_SECONDS
    connect_timeout_seconds: float = DEFAULT_CONNECT_TIMEOUT_SECONDS
    max_staleness: int | None = None
    max_workers: int = DEFAULT_MAX_WORKERS
    max_concurrent_streams: int | None = None
    max_streams_per_peer: int = DEFAULT_MAX_STREAMS_PER_PEER
    stream_idle_seconds: float = DEFAULT_STREAM_IDLE_SECONDS
    allow_non_finite_gradients: bool = False
    recovery_timeout_seconds: float = DEFAULT_RECOVERY_TIMEOUT_SECONDS
    checkpoint_dir: str | None = None
    checkpoint_every: object = None

    def __post_init__(self):
        _check_int(self, "chunk_bytes", minimum=1)
        _check_int(self, "max_message_bytes", minimum=1)
        if self.max_message_bytes < self.chunk_bytes + FRAMING_BYTES:
            raise InvalidArgumentError(
                "max_message_bytes must leave room for one chunk and its framing "
                f"(chunk_bytes + {FRAMING_BYTES}). Received: max_message_bytes="
                f"{self.max_message_bytes}, chunk_bytes={self.chunk_bytes}. Raise "
                "max_message_bytes or lower chunk_bytes."
            )
        if self.max_message_bytes > (1 << 31) - 1:
            raise InvalidArgumentError(
                "max_message_bytes must fit gRPC's 32-bit limit (2**31 - 1). Received: "
                f"max_message_bytes={self.max_message_bytes}."
            )
        _check_seconds(self, "rpc_timeout_seconds")
        _check_seconds(self, "connect_timeout_seconds", allow_zero=True)
        if self.max_staleness is not None:
            _check_int(self, "max_staleness", minimum=0)
        _check_int(self, "max_workers", minimum=2)
        if self.max_concurrent_streams is not None:
            _check_int(self, "max_concurrent_streams", minimum=1)
            if self.max_concurrent_streams >= self.max_workers:
                raise InvalidArgumentError(
                    "ServiceOptions.max_concurrent_streams must be below max_workers, so "
                    "that unary calls such as Health always find a thread. Received: "
                    f"max_concurrent_streams={self.max_concurrent_streams}, max_workers="
                    f"{self.max_workers}. Lower it or raise max_workers."
                )
        _check_int(self, "max_streams_per_peer", minimum=1)
        _check_seconds(self, "stream_idle_seconds")
        if not isinstance(self.allow_non_finite_gradients, bool):
            raise InvalidArgumentError(
                "ServiceOptions.allow_non_finite_gradients must be a bool. Received: "
                f"allow_non_finite_gradients={self.allow_non_finite_gradients!r}."
            )
        _check_seconds(self, "recovery_timeout_seconds", allow_zero=True)
        _check_checkpointing(self)

    @property
    def stream_limit(self):
        """Streaming calls served at once (`max_concurrent_streams` resolved)."""
        if self.max_concurrent_streams is not None:
            return self.max_concurrent_streams
        return self.max_workers - min(RESERVED_UNARY_THREADS, self.max_workers // 2)

    @property
    def peer_stream_limit(self):
        """Streaming calls one peer may have open at once (at most `stream_limit`)."""
        return min(self.max_streams_per_peer, self.stream_limit)

    def grpc_options(self):
        """Returns the message-size options for a gRPC server or channel."""
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]


def _check_int(options, name, minimum):
    """Checks field `name` of `options`; stores it as a Python int (gRPC takes no NumPy ints)."""
    value = getattr(options, name)
    if not is_integer(value, minimum=minimum):
        raise InvalidArgumentError(
            f"ServiceOptions.{name} must be an integer >= {minimum}. "
            f"Received: {name}={value!r}."
        )
    object.__setattr__(options, name, int(value))


def _check_seconds(options, name, allow_zero=False):
    value = getattr(options, name)
    if not is_seconds(value, allow_zero=allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidArgumentError(
            f"ServiceOptions.{name} must be a finite number of seconds {bound}. "
            f"Received: {name}={value!r}."
        )


def _check_checkpointing(options):
    # Imported here: autosave imports nothing of the service, options stays light.
    from kdist.ps.autosave import CheckpointEvery, parse_every

    every, directory = options.checkpoint_every, options.checkpoint_dir
    if every is not None and not isinstance(every, CheckpointEvery):
        every = parse_every(every, "ServiceOptions.checkpoint_every")
        object.__setattr__(options, "checkpoint_every", every)
    if directory is not None and (not isinstance(directory, str) or not directory):
        raise InvalidArgumentError(
            "ServiceOptions.checkpoint_dir must be a non-empty path or None. Received: "
            f"checkpoint_dir={directory!r}."
        )
    if (every is None) != (directory is None):
        raise InvalidArgumentError(
            "ServiceOptions.checkpoint_dir and checkpoint_every go together. Received: "
            f"checkpoint_dir={directory!r}, checkpoint_every={every!r}. Set both (e.g. "
            "checkpoint_every=\"1\" to save before each push is answered) or neither."
        )
