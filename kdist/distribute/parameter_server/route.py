"""`Route`: one variable's local copy, the server keys of its shards, and their versions.

A `VariableRouter` keeps one `Route` per variable created in a
`ParameterServerStrategy` scope. This module holds the bookkeeping on a
route's local side: the requests that create its shards on the servers
(`Route.create_requests`), which part of the local memory a shard is
(`local_view`), writing a value read from a server into it (`write_shard`),
the snapshot that says whether a non-trainable value changed
(`take_snapshot`, `changed`); the naming of server keys (`server_keys`,
`keys_by_server`); `to_numpy`, the one tensor-to-wire conversion; and
`RouteReader`, which reads a route's shards for the user-facing views. The
traffic is in `kdist.distribute.parameter_server.router`.

Server keys: a variable's shards are stored on their servers under keys
given by creation order, `"v<index>"` for a whole variable and
`"v<index>/part_<k>"` for shard `k` of a partitioned one (`server_keys`),
not under their TensorFlow-style names (`ShardPlacement.name`, `"w/part_0"`).
Keras numbers default names per process ("variable_3"), while every worker
of a between-graph job creates the same variables in the same order.
"""

import dataclasses

import numpy as np
import torch

from kdist.ps import VariableInit
from kdist.ps.wire.values import ServerInitializer, ShardOrigin
from kdist.rpc import dtypes


def server_keys(index, placement):
    """The server key of each shard of the `index`-th variable created, in shard order.

    Example:

    >>> from kdist.distribute.parameter_server.placement import RoundRobinPlacer
    >>> from kdist.distribute.parameter_server.partitioners import FixedShardsPartitioner
    >>> server_keys(3, RoundRobinPlacer(2).place("w", (4, 2), "float32", FixedShardsPartitioner(2)))
    ('v3/part_0', 'v3/part_1')
    """
    if placement.is_partitioned:
        return tuple(f"v{index}/part_{position}" for position in range(placement.num_shards))
    return (f"v{index}",)


@dataclasses.dataclass(eq=False)
class Route:
    """One variable created in scope: its local copy and where its shards live.

    Written by the thread that runs the model's step; not otherwise thread-safe.

    Attributes:
        variable: the local `keras.Variable` the model computes with.
        placement: its `kdist.distribute.parameter_server.placement.VariablePlacement`.
        keys: the server key of each shard, in shard order (see `server_keys`).
        versions: server version of each shard at the last read (-1: unknown).
        row_sparse: True when steps look rows up instead of reading the table.
        snapshot: a non-trainable variable's value at the last read, or None.
        lookup_versions: for a row-read table, the oldest version of each
            shard (by position) among the lookups since the last push.
        layer_name: the layer that reads a row-read table (named in errors), or None.
        remote: True for a table that lives on the servers only: the local
            variable holds a placeholder of no memory
            (`kdist.keras.parameter_server.remote_tables`), never its value.
    """

    variable: object
    placement: object
    keys: tuple
    versions: list
    row_sparse: bool = False
    snapshot: object = None
    lookup_versions: dict = dataclasses.field(default_factory=dict)
    layer_name: str = None
    remote: bool = False

    @property
    def trainable(self):
        return bool(self.variable.trainable)

    def create_requests(self, initializer_json=None):
        """`{ps_index: [(shard position, VariableInit)]}` creating this variable's shards.

        With `initializer_json`, each server computes its shards' value (a
        table that lives there only); else they carry the local value.
        """
        placement, requests = self.placement, {}
        value = None if initializer_json is not None else to_numpy(self.variable.value)
        for position, shard in enumerate(placement.shards):
            if initializer_json is not None:
                shape = tuple(placement.shape) if not placement.is_partitioned else tuple(shard.shape)
                part = np.broadcast_to(np.zeros((), dtypes.numpy_dtype(placement.dtype)), shape)
                initializer = ServerInitializer(initializer_json, tuple(placement.shape), shard.row_start)
            else:
                part, initializer = placement.shard_part(position, value), None
            # Every shard says where it lies: a server restoring the checkpoints
            # of another number of servers fills it from those rows (kdist.ps.server.reshard).
            origin = ShardOrigin(tuple(placement.shape), shard.row_start if placement.is_partitioned else 0)
            item = VariableInit(self.keys[position], part, trainable=self.trainable,
                                initializer=initializer, shard=origin)
            requests.setdefault(shard.ps_index, []).append((position, item))
        return requests

    def server_key(self, shard):
        """The server key of `shard` (one of `placement.shards`)."""
        return self.keys[self.placement.shards.index(shard)]

    def local_view(self, position):
        """A NumPy view of the local memory holding shard `position`, or None (not on the CPU, not contiguous)."""
        tensor = self.variable.value
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        return self.placement.shard_part(position, dtypes.to_numpy(tensor))

    def write_shard(self, position, value):
        """Copies a server's `value` of shard `position` into the local variable."""
        target = self.placement.shard_part(position, self.variable.value)
        source = dtypes.to_torch(value if value.flags.c_contiguous else value.copy(order="C"))
        with torch.no_grad():
            target.copy_(source.reshape(target.shape))

    def take_snapshot(self):
        # Non-trainable state (BatchNorm statistics) is written back only when a
        # step changed it, so frozen weights cost nothing per step.
        if not self.trainable:
            self.snapshot = self.variable.value.detach().clone()

    def changed(self):
        """True when a non-trainable variable's local value differs from what was last read."""
        return self.snapshot is not None and not torch.equal(self.snapshot, self.variable.value.detach())


class RouteReader:
    """Reads one `Route`'s shards for `RemoteVariable` / `ShardedVariable` views. Thread-safe.

    `router` is the `VariableRouter` holding `route`. Implements
    `kdist.distribute.parameter_server.variable_reader.VariableReader`, plus
    `server_key(shard)`, which `RemoteVariable.server_key` asks.
    """

    def __init__(self, router, route):
        self._router = router
        self._route = route

    def read(self, shards):
        return self._router.read_shards(self._route, [self._route.placement.shards.index(shard) for shard in shards])

    def lookup(self, requests):
        positions = [(self._route.placement.shards.index(shard), ids) for shard, ids in requests]
        return [rows for rows, _ in self._router.lookup_shards(self._route, positions)]

    def server_key(self, shard):
        """The key the parameter server stores `shard` under, e.g. `"v3/part_0"`."""
        return self._route.server_key(shard)


def to_numpy(tensor):
    """A tensor (or array) as a C-contiguous NumPy array on the CPU; bfloat16 stays bfloat16."""
    if isinstance(tensor, np.ndarray):
        return tensor
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return dtypes.to_numpy(tensor.contiguous())


def keys_by_server(routes):
    """`{ps_index: [server keys]}` of every shard of `routes`."""
    by_server = {}
    for route in routes:
        for position, shard in enumerate(route.placement.shards):
            by_server.setdefault(shard.ps_index, []).append(route.keys[position])
    return by_server
