"""`ServiceOptions`: the tunables of a variable-service server and client."""

import dataclasses
import math

from kdist.errors import InvalidArgumentError

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
        max_workers: server side: threads serving calls.

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

    def __post_init__(self):
        _check_int("chunk_bytes", self.chunk_bytes, minimum=1)
        _check_int("max_message_bytes", self.max_message_bytes, minimum=1)
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
        _check_seconds("rpc_timeout_seconds", self.rpc_timeout_seconds)
        _check_seconds("connect_timeout_seconds", self.connect_timeout_seconds, allow_zero=True)
        if self.max_staleness is not None:
            _check_int("max_staleness", self.max_staleness, minimum=0)
        _check_int("max_workers", self.max_workers, minimum=1)

    def grpc_options(self):
        """Returns the message-size options for a gRPC server or channel."""
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(
            f"ServiceOptions.{name} must be an integer >= {minimum}. "
            f"Received: {name}={value!r}."
        )


def _check_seconds(name, value, allow_zero=False):
    valid = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value > 0 or (allow_zero and value == 0))
    )
    if not valid:
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidArgumentError(
            f"ServiceOptions.{name} must be a finite number of seconds {bound}. "
            f"Received: {name}={value!r}."
        )
