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


class BackendChoiceWarning(UserWarning):
    """Keras was imported before kdist with a backend nobody chose explicitly.

    Given once per process when Keras took a backend other than torch from
    `keras.json` (`KERAS_BACKEND` unset): kdist's strategies follow it. Import
    kdist first, or set `KERAS_BACKEND`, to choose; setting it silences this.
    """


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
        deadline_seconds: how long the call was allowed to take (None when
            another process reported the outage).
        detail: gRPC's description of the failure (for people, not for code).
        elapsed_seconds: how long this process really tried (None: unknown).
    """

    retryable = True

    def __init__(self, address, deadline_seconds, detail="", elapsed_seconds=None):
        if elapsed_seconds is not None:
            within = f" after trying for {elapsed_seconds:.1f} seconds"
            if deadline_seconds is not None:
                within += f" (deadline {deadline_seconds:g} seconds)"
        else:
            within = "" if deadline_seconds is None else f" within {deadline_seconds:g} seconds"
        message = (
            f"The parameter server at {address} could not be reached{within}. Check that it "
            "is running and that the address is right; the call may be retried."
        )
        if detail:
            message += f" gRPC said: {detail}"
        super().__init__(message)
        self.address = address
        self.deadline_seconds = deadline_seconds
        self.detail = detail
        self.elapsed_seconds = elapsed_seconds


class _RefusedCallError(KdistError, RuntimeError):
    """A server answered a call with a non-transient gRPC status (the shared body of two errors).

    `ParameterServerError` and `WorkerError` stay distinct types (code catches
    one without the other); only their construction is shared.
    """

    # How the message names the server, e.g. "parameter server".
    _server_kind = "server"

    def __init__(self, address, code_name, detail):
        super().__init__(f"The {self._server_kind} at {address} answered {code_name}: {detail}")
        self.address = address
        self.code_name = code_name
        self.detail = detail


class ParameterServerError(_RefusedCallError):
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

    _server_kind = "parameter server"


class UnauthenticatedError(ParameterServerError):
    """A parameter server refused a call that did not prove the cluster secret (`UNAUTHENTICATED`).

    Fatal: give every task the same secret (run under `kdist launch`, or set
    `KDIST_SECRET_FILE` on every host; `docs/parameter_server.md`, Security).
    """


class PeerAuthenticationError(KdistError, ConnectionError):
    """The server at an address did not prove it holds the cluster secret.

    Fatal: it may be an impostor (a process that took a dead server's port),
    a server with another secret, or one running with authentication off. The
    client sent it no proof and read none of its replies.

    Attributes:
        address: the server's `"host:port"`.
        reason: what went wrong.
    """

    def __init__(self, address, reason):
        super().__init__(f"The server at {address} is not trusted: {reason}.")
        self.address = address
        self.reason = reason


class WorkerUnavailableError(KdistError, ConnectionError):
    """A worker could not be reached, or died while running a closure.

    Retryable: the coordinator catches it, puts the worker's closure back in
    its queue for another worker, and keeps calling the worker until it comes
    back. User code does not see it (the closure's `RemoteValue` reads
    `ABORTED` meanwhile).

    Attributes:
        address: the worker's `"host:port"`.
        detail: gRPC's description of the failure (for people, not for code).
    """

    retryable = True

    def __init__(self, address, detail=""):
        message = f"The worker at {address} is unavailable; its closure is retried on another worker."
        if detail:
            message += f" gRPC said: {detail}"
        super().__init__(message)
        self.address = address
        self.detail = detail


class WorkerError(_RefusedCallError):
    """A worker refused the coordinator's request. Fatal: fix the cluster or the request.

    Raised for a missing or wrong token (`code_name` `"UNAUTHENTICATED"`), a
    resource the worker could not build from its config (`"INVALID_ARGUMENT"`,
    with the worker's traceback in `detail`), or a message over the size limit.

    Attributes:
        address: the worker's `"host:port"`.
        code_name: the gRPC status code's name.
        detail: the worker's explanation.
    """

    _server_kind = "worker"


class RemoteFunctionError(KdistError, RuntimeError):
    """A scheduled function raised on a worker, and its exception could not be rebuilt here.

    When the exception pickles, the coordinator raises the original type
    instead, chained to a `RemoteTraceback` with the worker's traceback.

    Attributes:
        worker: the worker's `"host:port"`.
        error_type: the exception's qualified type name on the worker.
        traceback: the worker's formatted traceback.
    """

    def __init__(self, worker, error_type, message, traceback):
        super().__init__(
            f"A scheduled function raised {error_type} on the worker at {worker}: {message}\n"
            f"Worker traceback:\n{traceback}"
        )
        self.worker = worker
        self.error_type = error_type
        self.traceback = traceback


class RemoteTraceback(KdistError):
    """The `__cause__` of an exception re-raised from a worker: its text is the worker's traceback."""

    def __init__(self, traceback):
        super().__init__(traceback)
        self.traceback = traceback

    def __str__(self):
        return f"\n\nWorker traceback:\n{self.traceback}"


class OutOfRangeError(KdistError, RuntimeError):
    """A per-worker iterator ran out of data inside a scheduled function.

    Repeat the dataset (`dataset_fn` should return an endless stream for
    coordinator training) or schedule fewer steps.
    """


class CancelledError(KdistError, RuntimeError):
    """A scheduled closure was cancelled before it ran because an earlier closure failed."""


class ClusterEnvironmentError(InvalidArgumentError):
    """A launcher's environment variable is missing, malformed, or contradicts another. Fatal.

    Raised while reading what Slurm (`SLURM_*`), Kubeflow Trainer (`PET_*`) or
    torchrun set, before any process connects to another: fix the launch.

    Attributes:
        variable: the variable's name, e.g. `"SLURM_PROCID"`.
        value: its value as read (a string), or None when it is unset.
    """

    def __init__(self, message, variable, value):
        super().__init__(message)
        self.variable = variable
        self.value = value


class InputMismatchError(InvalidArgumentError):
    """Ranks that should read the same global batch read different ones.

    Raised by `fit`/`evaluate`/`predict` in a multi-worker job at the first
    batch of an epoch, instead of silently training each rank on a slice of
    its own different batch (1/N of the data). Fatal: declare the input per
    rank (`kdist.distribute.per_rank`) or give every rank the full data.
    """
