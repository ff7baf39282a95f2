"""Counts of the collectives a process ran, and the bytes they moved.

`ProcessCollectives.statistics` maps an operation name, such as
`"all_reduce(gradients)"`, to a `CollectiveStats`. A bucketed reduction counts
one call per bucket. `wire_bytes` is what this rank sends by the standard
algorithm for `n` payload bytes and `W` ranks (ring all-reduce, ring
all-gather, broadcast from the source), not a measurement:

| collective | wire bytes per rank |
|---|---|
| all_reduce | 2 (W - 1) / W · n |
| all_gather | (W - 1) · n |
| broadcast | n on the source rank, 0 elsewhere |
"""

import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
    """Totals of one operation on this rank.

    Attributes:
        calls: collective calls made (one per bucket for bucketed reductions).
        payload_bytes: bytes of the tensors handed to those calls.
        wire_bytes: bytes this rank sends for them, by the standard formulas
            (see the module docstring).
    """

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0


def all_reduce_wire_bytes(payload_bytes, world_size):
    """Bytes one rank sends in a ring all-reduce of `payload_bytes`: 2 (W - 1) / W · n."""
    return 2 * (world_size - 1) * payload_bytes // world_size


def all_gather_wire_bytes(payload_bytes, world_size):
    """Bytes one rank sends in an all-gather of its `payload_bytes`: (W - 1) · n."""
    return (world_size - 1) * payload_bytes


def broadcast_wire_bytes(payload_bytes, is_source):
    """Bytes one rank sends in a broadcast of `payload_bytes`: n on the source, 0 elsewhere."""
    return payload_bytes if is_source else 0


class CollectiveStatistics:
    """A thread-safe tally of `CollectiveStats` per operation name.

    One lock-protected dict update per collective call, so it is always on.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._stats = {}

    def record(self, operation, payload_bytes, wire_bytes):
        """Adds one call of `operation` that carried `payload_bytes` and sent `wire_bytes`."""
        with self._lock:
            old = self._stats.get(operation, _ZERO)
            self._stats[operation] = CollectiveStats(
                old.calls + 1, old.payload_bytes + payload_bytes, old.wire_bytes + wire_bytes
            )

    def snapshot(self):
        """Returns `{operation: CollectiveStats}` as of now (a new dict)."""
        with self._lock:
            return dict(self._stats)


_ZERO = CollectiveStats()
