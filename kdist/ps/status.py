"""Domain errors of the variable service and their gRPC status codes — the one place.

Server code raises the exceptions below (or `kdist.errors.InvalidArgumentError`);
`status_code(error)` maps them to a `grpc.StatusCode`, and `client_error`
maps a status code a client received to the kdist error it raises. Nothing
classifies failures by message text.
"""

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

# Codes after which the same call may succeed: the server is (re)starting,
# overloaded, or the network dropped.
_UNAVAILABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def status_code(error):
    """Returns the `grpc.StatusCode` for a server-side exception (`INTERNAL` if unknown).

    Example:

    >>> status_code(NotFoundError("no variable 'w'"))
    <StatusCode.NOT_FOUND: (5, 'not found')>
    """
    for error_class, code in _STATUS_CODES:
        if isinstance(error, error_class):
            return code
    return grpc.StatusCode.INTERNAL


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
