"""Typed exceptions raised by kdist.

Every kdist error derives from `KdistError` and says whether retrying the same
operation can succeed (`retryable`). Callers classify failures by type, never by
message text.

User mistakes are also subclasses of the matching built-in (`ValueError`,
`TypeError`, `RuntimeError`) so existing `except ValueError:` code keeps working.
"""


class KdistError(Exception):
    """Base class of every kdist error.

    Attributes:
        retryable: True when the same operation may succeed if tried again
            (a transient failure); False when the caller must change something.
    """

    retryable = False


class InvalidArgumentError(KdistError, ValueError):
    """An argument has the wrong value. Fatal: fix the call."""


class InvalidDeviceError(InvalidArgumentError):
    """A device string cannot be parsed or names a device that does not exist."""


class StrategyScopeError(KdistError, RuntimeError):
    """Strategy scopes or contexts were mixed or used in the wrong place.

    Examples: entering one strategy's scope inside another's, compiling a model
    under a different strategy than the one it was created under, calling a
    cross-replica API from a replica context.
    """


class ReplicaGradientError(KdistError, RuntimeError):
    """A replica produced no gradient for a variable that replica 0 trained.

    Raised instead of silently training on fewer replicas than the strategy has.
    Usually a device-placement problem (a tensor copied off the replica device)
    or a `train_step` whose control flow depends on the replica.
    """


class ReplicaSyncError(KdistError, RuntimeError):
    """Replicas of one `Strategy.run` call took different paths.

    For example one replica called `merge_call` and another returned, or two
    replicas called `merge_call` with different functions.
    """


class UnsupportedError(KdistError, RuntimeError):
    """The feature is outside what this strategy or Keras version supports."""


class BackendError(KdistError, RuntimeError):
    """Keras was imported with a backend kdist cannot drive."""


class CollectiveTimeoutError(KdistError, RuntimeError):
    """A cross-process collective did not complete: a rank died, stalled or disconnected.

    Raised on every surviving rank instead of hanging. Retryable at the level of
    the job: restart every process (with `keras.callbacks.BackupAndRestore` the
    job resumes from its last completed epoch).

    Attributes:
        operation: the collective that failed, e.g. `"all_reduce(gradients)"`.
        missing_ranks: the ranks that did not take part, as far as the
            survivors could tell (empty when it could not be determined).
        timeout_seconds: the timeout the collective ran under.
    """

    retryable = True

    def __init__(self, message, operation=None, missing_ranks=(), timeout_seconds=None):
        super().__init__(message)
        self.operation = operation
        self.missing_ranks = tuple(missing_ranks)
        self.timeout_seconds = timeout_seconds


class ParameterServerUnavailableError(KdistError, ConnectionError):
    """A parameter server could not be reached within the deadline.

    Retryable: the server may be starting, restarting or briefly overloaded.
    Raised after gRPC's own retries (on `UNAVAILABLE`) are spent, or when a
    call's deadline passed.

    Attributes:
        address: the server's `"host:port"`.
        deadline_seconds: how long the call was allowed to take.
        detail: gRPC's description of the failure (for people, not for code).
    """

    retryable = True

    def __init__(self, address, deadline_seconds, detail=""):
        message = (
            f"The parameter server at {address} could not be reached within "
            f"{deadline_seconds:g} seconds. Check that it is running and that the address "
            "is right; the call may be retried."
        )
        if detail:
            message += f" gRPC said: {detail}"
        super().__init__(message)
        self.address = address
        self.deadline_seconds = deadline_seconds
        self.detail = detail


class ParameterServerError(KdistError, RuntimeError):
    """A parameter server refused or failed a call. Fatal: fix the request.

    Raised for `INVALID_ARGUMENT` (wrong shape, dtype, name, out-of-range id),
    `NOT_FOUND` (unknown variable or checkpoint), `FAILED_PRECONDITION` (no
    optimizer configured, a conflicting optimizer), `RESOURCE_EXHAUSTED` (a
    message above the size limit) and any other non-transient status.

    Attributes:
        address: the server's `"host:port"`.
        code_name: the gRPC status code's name, e.g. `"INVALID_ARGUMENT"`.
        detail: the server's explanation.
    """

    def __init__(self, address, code_name, detail):
        super().__init__(f"The parameter server at {address} answered {code_name}: {detail}")
        self.address = address
        self.code_name = code_name
        self.detail = detail


class UnauthenticatedError(ParameterServerError):
    """A parameter server refused a call without the right token (`UNAUTHENTICATED`).

    Fatal: give the client the server's token (`Security(token=...)`).
    """
