"""The values a `VariableClient` sends and receives (frozen dataclasses).

Tensors given to the client may be NumPy arrays or torch CPU tensors; tensors
returned are writable, C-contiguous NumPy arrays.
"""

import dataclasses
from typing import Any

import numpy as np

from kdist.errors import InvalidArgumentError
from kdist.validation import is_integer


def check_name(name, what="name"):
    """Raises InvalidArgumentError unless `name` is a non-empty string."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(
            f"A variable {what} must be a non-empty string. Received: {what}={name!r}."
        )


# Update ids are short names ("closure-17/3"); the bound keeps a server's
# memory of applied ids (kdist.ps.server.store.MAX_REMEMBERED_UPDATES of them) small.
MAX_UPDATE_ID_LENGTH = 256
# A push's outcome (`VariableClient.push`) is at most this many bytes: a
# server keeps recent ones in memory (`kdist.ps.server.update_ids`).
MAX_OUTCOME_BYTES = 1 << 20


def check_update_id(update_id):
    """Raises InvalidArgumentError unless `update_id` is None or a string of at most 256 characters.

    Example:

    >>> check_update_id("closure-17/0")
    """
    if update_id is None or (isinstance(update_id, str)
                             and len(update_id) <= MAX_UPDATE_ID_LENGTH):
        return
    received = (f"{len(update_id)} characters starting {update_id[:40]!r}"
                if isinstance(update_id, str) else repr(update_id))
    raise InvalidArgumentError(
        f"An update_id must be None or a string of at most {MAX_UPDATE_ID_LENGTH} "
        f"characters. Received: update_id={received}. Use a short name, e.g. "
        "\"<closure id>/<push index>\"."
    )


def check_outcome(outcome):
    """Raises InvalidArgumentError unless `outcome` is bytes of at most `MAX_OUTCOME_BYTES`.

    Example:

    >>> check_outcome(b"metric state")
    """
    if isinstance(outcome, (bytes, bytearray)) and len(outcome) <= MAX_OUTCOME_BYTES:
        return
    received = (f"{len(outcome)} bytes" if isinstance(outcome, (bytes, bytearray))
                else f"{type(outcome).__name__}")
    raise InvalidArgumentError(
        f"A push's outcome must be bytes, at most {MAX_OUTCOME_BYTES} of them. Received: "
        f"outcome={received}. Send a summary (a metric state), not values."
    )


def _check_version(version):
    if version is not None and not is_integer(version, minimum=0):
        raise InvalidArgumentError(
            f"A version must be None or an integer >= 0. Received: version={version!r}."
        )


@dataclasses.dataclass(frozen=True)
class VariableInit:
    """A variable to create: its name, initial value and whether it is trainable.

    Example:

    >>> VariableInit("dense/kernel", np.zeros((3, 2), "float32")).trainable
    True
    """

    name: str
    value: Any
    trainable: bool = True
    initializer: "ServerInitializer | None" = None
    # Where this shard lies in the whole variable (`ShardOrigin`), or None.
    shard: "ShardOrigin | None" = None

    def __post_init__(self):
        check_name(self.name)


@dataclasses.dataclass(frozen=True)
class ServerInitializer:
    """A value the server computes itself (`kdist.ps.server.server_init`): the variable's creator sends no value.

    The `VariableInit`'s `value` then only gives the shard's shape and dtype
    (any array of them, e.g. `np.broadcast_to(np.zeros((), "float32"), shape)`),
    and the server never sends the value back.

    Attributes:
        config_json: `kdist.ps.wire.conventions.initializer_config(initializer)`.
        full_shape: the whole variable's shape.
        row_start: the shard's first row in the whole variable.
    """

    config_json: str
    full_shape: tuple
    row_start: int = 0


@dataclasses.dataclass(frozen=True)
class ShardOrigin:
    """Where a created shard lies in its whole variable.

    A server that restores the checkpoints of another number of servers
    (`kdist.ps.server.reshard`) fills the shard from these rows of the old variable.

    Attributes:
        full_shape: the whole variable's shape.
        row_start: the shard's first row in the whole variable (0 for a whole variable).
    """

    full_shape: tuple
    row_start: int = 0


@dataclasses.dataclass(frozen=True)
class VariableState:
    """A variable's value (None when not sent: the caller already has it) and version.

    Example:

    >>> VariableState("w", None, 3).version
    3
    """

    name: str
    value: np.ndarray | None
    version: int


@dataclasses.dataclass(frozen=True)
class DenseGradient:
    """A gradient shaped like its variable.

    Args:
        name: the variable.
        gradient: the gradient (same shape and dtype as the variable).
        version: the variable version the gradient was computed from, as a
            pull returned it; None when unknown (staleness is then not
            measured and never causes a rejection).

    Example:

    >>> DenseGradient("w", np.ones(3, "float32"), version=0).name
    'w'
    """

    name: str
    gradient: Any
    version: int | None = None

    def __post_init__(self):
        check_name(self.name)
        _check_version(self.version)


@dataclasses.dataclass(frozen=True)
class RowGradient:
    """A gradient of some rows (axis 0) of a variable, e.g. of an embedding table.

    Repeated ids are summed. The server scatters the rows into a dense zero
    gradient and applies that, as single-device Keras on torch does.

    Args:
        name: the variable.
        row_ids: int64 (or int32) ids, any shape; may repeat.
        rows: `row_ids.shape + variable.shape[1:]` gradient rows.
        version: as in `DenseGradient`.

    Example:

    >>> RowGradient("table", np.array([0, 2]), np.ones((2, 4), "float32"), 5).version
    5
    """

    name: str
    row_ids: Any
    rows: Any
    version: int | None = None

    def __post_init__(self):
        check_name(self.name)
        _check_version(self.version)


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A new value for a variable (e.g. BatchNorm statistics); its version goes up by one.

    Example:

    >>> Assignment("moving_mean", np.zeros(4, "float32")).name
    'moving_mean'
    """

    name: str
    value: Any

    def __post_init__(self):
        check_name(self.name)


@dataclasses.dataclass(frozen=True)
class PushResult:
    """What a push did.

    Attributes:
        versions: every pushed variable's version after the push.
        rejected: the variables whose gradient was too stale to apply
            (`ServiceOptions.max_staleness`), in request order.
        staleness: for each gradient that carried a version, the server's
            version before the push minus that version.
        deduplicated: True when the push's `update_id` had already been
            applied: this push applied nothing, and the fields above are the
            first push's.
        outcome: on a deduplicated push, the `outcome` the first push sent
            (b"" if it sent none or the server no longer holds it); else b"".
    """

    versions: dict[str, int]
    rejected: tuple[str, ...]
    staleness: dict[str, int]
    deduplicated: bool = False
    outcome: bytes = b""


@dataclasses.dataclass(frozen=True)
class OptimizerState:
    """A variable's server-side optimizer state.

    Attributes:
        iterations: the optimizer's `iterations` (updates applied).
        slots: slot name (as Keras named it: "momentum", "velocity", ...) ->
            value, in creation order.
    """

    iterations: int
    slots: dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class VariableStats:
    """Counters of one variable on a server.

    `sparse_applies` counts row gradients applied to their touched rows only,
    `dense_applies` gradients applied as Keras' dense update (see
    `kdist.ps.server.row_updates`), `rows_updated` the distinct rows of the row
    gradients applied.
    """

    version: int
    applied_updates: int
    rejected_updates: int
    shape: tuple[int, ...]
    dtype: str
    num_bytes: int
    sparse_applies: int = 0
    dense_applies: int = 0
    rows_updated: int = 0


@dataclasses.dataclass(frozen=True)
class StalenessStats:
    """Staleness of the gradients a server received (those that carried a version).

    Attributes:
        count: gradients measured.
        mean: their mean staleness (0.0 when none).
        p99: the 99th percentile (nearest rank; 0 when none).
        max: the largest (0 when none).
        histogram: staleness -> number of gradients.
    """

    count: int
    mean: float
    p99: int
    max: int
    histogram: dict[int, int]

    @classmethod
    def from_histogram(cls, histogram):
        """Returns the statistics of a `{staleness: count}` histogram."""
        histogram = {int(key): int(value) for key, value in sorted(histogram.items()) if value}
        count = sum(histogram.values())
        if not count:
            return cls(0, 0.0, 0, 0, {})
        mean = sum(key * value for key, value in histogram.items()) / count
        rank = -(-99 * count // 100)  # nearest rank: ceil(0.99 * count)
        seen, p99 = 0, 0
        for key, value in histogram.items():
            seen += value
            if seen >= rank:
                p99 = key
                break
        return cls(count, mean, p99, max(histogram), histogram)


@dataclasses.dataclass(frozen=True)
class ServerStats:
    """A snapshot of a server's counters.

    Attributes:
        variables: name -> `VariableStats`.
        requests: RPC name in snake_case ("push", "pull", ...) -> calls.
        bytes_received: tensor payload bytes received.
        bytes_sent: tensor payload bytes sent.
        applied_pushes: push calls that applied at least one gradient.
        deduplicated_updates: pushes and assigns not applied because their
            `update_id` already had been (each answered with the first one's
            result).
        staleness: `StalenessStats`.
    """

    variables: dict[str, VariableStats]
    requests: dict[str, int]
    bytes_received: int
    bytes_sent: int
    applied_pushes: int
    deduplicated_updates: int
    staleness: StalenessStats
