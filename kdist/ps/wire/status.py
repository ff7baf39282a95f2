"""Domain errors of the variable service and their gRPC status codes — the one place.

Server code raises the exceptions below (or `kdist.errors.InvalidArgumentError`);
`status_code(error)` maps them to a `grpc.StatusCode`, and `client_error`
maps a status code a client received to the kdist error it raises. Nothing
classifies failures by message text.
"""

import errno

import grpc

from kdist.errors import (
    InvalidArgumentError,
    KdistError,
    ParameterServerError,
    ParameterServerUnavailableError,
    UnauthenticatedError,
)


class NotFoundError(KdistError, LookupError):
    """A request names a variable or a checkpoint that does not exist (`NOT_FOUND`)."""

    def __str__(self):
        # LookupError's KeyError cousin quotes its message; this one does not.
        return str(self.args[0]) if self.args else ""


class FailedPreconditionError(KdistError, RuntimeError):
    """The server's state does not allow the request (`FAILED_PRECONDITION`).

    For example a push to a variable that has no optimizer configured, or an
    optimizer config that differs from the one a variable already has.
    """


class ResourceExhaustedError(KdistError, MemoryError):
    """A request needs more memory than the server can give it (`RESOURCE_EXHAUSTED`)."""


# Ordered: the first matching class wins (subclasses before their bases).
_STATUS_CODES = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (MemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
)

# OSError numbers that mean the disk (or the process's file-size limit) is
# full: the request was fine, the server lacks room.
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# Error details travel in gRPC trailing metadata, which a client refuses past
# 16 KiB ("Stream removed"); a detail is cut to this many UTF-8 bytes, and a
# list of names to this many names.
MAX_DETAIL_BYTES = 2048
MAX_LISTED_NAMES = 10
_MAX_LISTED_NAME_CHARS = 80

# Trailing metadata of a refusal for want of a slot; its value names the bound
# ("client" or "server"). The client retries exactly these refusals: the
# request was never read, so even a push without an update id is safe to resend.
SLOT_REFUSED_KEY = "kdist-slot-refused"

# Codes after which the same call may succeed: the server is (re)starting,
# overloaded, or the network dropped.
_UNAVAILABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def status_code(error):
    """Returns the `grpc.StatusCode` for a server-side exception (`INTERNAL` if unknown).

    Example:

    >>> status_code(NotFoundError("no variable 'w'"))
    <StatusCode.NOT_FOUND: (5, 'not found')>
    """
    if disk_full(error):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    for error_class, code in _STATUS_CODES:
        if isinstance(error, error_class):
            return code
    return grpc.StatusCode.INTERNAL


def disk_full(error):
    """True when `error`, or an error it was raised from or during, is a full disk.

    A full disk (`ENOSPC`), quota (`EDQUOT`) or file-size limit (`EFBIG`) is
    the server's shortage, `RESOURCE_EXHAUSTED`, even when the code that met
    it re-raised it as another error (`raise ... from None` still records it
    as `__context__`).
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
            return True
        error = error.__cause__ or error.__context__
    return False


def name_list(names, limit=MAX_LISTED_NAMES):
    """Returns `names` for an error message: at most `limit` of them, each cut short.

    Example:

    >>> name_list([f"w{index}" for index in range(12)], limit=2)
    "['w0', 'w1'] and 10 more"
    """
    names = list(names)
    shown = [name if len(name) <= _MAX_LISTED_NAME_CHARS
             else f"{name[:_MAX_LISTED_NAME_CHARS]}...({len(name)} characters)"
             for name in names[:limit]]
    text = repr(shown)
    return text if len(names) <= limit else f"{text} and {len(names) - limit} more"


def cap_detail(text, max_bytes=MAX_DETAIL_BYTES):
    """Returns `text` cut to `max_bytes` UTF-8 bytes, saying how much was cut.

    Example:

    >>> cap_detail("x" * 5000, max_bytes=10)
    'xxxxxxxxxx... (4990 more bytes)'
    """
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text
    return (f"{data[:max_bytes].decode('utf-8', 'ignore')}... "
            f"({len(data) - max_bytes} more bytes)")


def client_error(rpc_error, address, deadline_seconds, elapsed_seconds=None):
    """Returns the kdist error a client raises for a failed call.

    Args:
        rpc_error: the `grpc.RpcError` (a `grpc.Call`) the call raised.
        address: the server's address, for the message.
        deadline_seconds: the call's deadline, for the message.
        elapsed_seconds: how long the call really took, for the message.

    Returns:
        `ParameterServerUnavailableError` (retryable) for `UNAVAILABLE` and
        `DEADLINE_EXCEEDED`, `UnauthenticatedError` for `UNAUTHENTICATED`,
        `ParameterServerError` for every other code.
    """
    code = rpc_error.code() if hasattr(rpc_error, "code") else grpc.StatusCode.UNKNOWN
    detail = rpc_error.details() if hasattr(rpc_error, "details") else str(rpc_error)
    detail = detail or ""
    if code in _UNAVAILABLE_CODES:
        return ParameterServerUnavailableError(address, deadline_seconds, detail, elapsed_seconds)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return UnauthenticatedError(address, code.name, detail)
    return ParameterServerError(address, code.name, detail)
