"""The Strategy API: contexts, distributed values, strategies and distributed input."""

from kdist.distribute.context import (
    ReplicaContext,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from kdist.distribute.default_strategy import DefaultStrategy
from kdist.distribute.extended import StrategyExtended
from kdist.distribute.input import (
    DistributedDataset,
    DistributedDatasetFromFunction,
    InputContext,
    PerRankInput,
    ValueContext,
    per_rank,
)
from kdist.distribute.mirrored import MirroredStrategy
from kdist.distribute.multi_worker import MultiWorkerMirroredStrategy
from kdist.distribute.parameter_server import partitioners
from kdist.distribute.parameter_server.sharded_variable import RemoteVariable, ShardedVariable
from kdist.distribute.parameter_server.strategy import ParameterServerStrategy
from kdist.distribute.server import Server
from kdist.distribute.strategy import Strategy
from kdist.distribute.values import DistributedValues, Mirrored, PerReplica

__all__ = [
    "DefaultStrategy",
    "DistributedDataset",
    "DistributedDatasetFromFunction",
    "DistributedValues",
    "InputContext",
    "Mirrored",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "PerRankInput",
    "PerReplica",
    "RemoteVariable",
    "ReplicaContext",
    "Server",
    "ShardedVariable",
    "Strategy",
    "StrategyExtended",
    "ValueContext",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "partitioners",
    "per_rank",
]
