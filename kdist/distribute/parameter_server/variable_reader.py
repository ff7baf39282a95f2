"""What the views of remote variables read through: the `VariableReader` protocol and its checks.

`RemoteVariable` and `ShardedVariable`
(`kdist.distribute.parameter_server.sharded_variable`) hold no values: they ask a
`VariableReader` (the strategy's is `kdist.distribute.parameter_server.route.RouteReader`)
and check that it answered with one array of the right shape per request.
"""

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from kdist.distribute.parameter_server.placement import ShardPlacement
from kdist.errors import InvalidArgumentError, KdistError


class ShardReadError(KdistError, RuntimeError):
    """A `VariableReader` answered with the wrong number or shape of arrays: a reader bug. Fatal."""


@runtime_checkable
class VariableReader(Protocol):
    """Reads values held by parameter servers; implemented by the strategy.

    Implementations should serve each call with one round of requests (one per
    parameter server at most), and must be thread-safe if the variables are
    used from several threads. One may also offer `server_key(shard)`, the key
    the shard's parameter server stores it under (`RemoteVariable.server_key`);
    it is optional, so it is not part of the protocol's `isinstance` check.
    """

    def read(self, shards: Sequence[ShardPlacement]) -> list[np.ndarray]:
        """Returns the full value of each shard, in the order given."""
        ...

    def lookup(self, requests: Sequence[tuple[ShardPlacement, np.ndarray]]) -> list[np.ndarray]:
        """Returns, for each `(shard, local_ids)`, the rows `value[local_ids]` of that shard.

        `local_ids` are int64 row ids relative to the shard's first row.
        """
        ...


def check_reader(reader):
    """Returns `reader`, or raises `InvalidArgumentError` when it is not a `VariableReader`."""
    if not isinstance(reader, VariableReader):
        raise InvalidArgumentError(
            f"A remote variable needs a reader. Received: reader={reader!r}. Expected an "
            "object with `read(shards)` and `lookup(requests)` methods (VariableReader)."
        )
    return reader


def checked_results(results, expected_count, method_name):
    """The reader's `results` as a list, or `ShardReadError` unless there are `expected_count`."""
    results = list(results)
    if len(results) != expected_count:
        raise ShardReadError(
            f"VariableReader.{method_name} returned {len(results)} arrays for "
            f"{expected_count} requests. Expected one array per request, in order."
        )
    return results


def checked_array(array, expected_shape, shard_name):
    """`array` as a NumPy array, or `ShardReadError` unless it has `expected_shape`."""
    array = np.asarray(array)
    if array.shape != tuple(expected_shape):
        raise ShardReadError(
            f"VariableReader returned an array of the wrong shape for shard {shard_name!r}. "
            f"Received: shape={array.shape}. Expected shape={tuple(expected_shape)}."
        )
    return array
