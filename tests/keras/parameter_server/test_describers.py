"""What the chief sends a coordinator worker to rebuild its strategy (kdist/keras/parameter_server/describers.py)."""

import pytest

import kdist
from kdist.cluster import ClusterSpec, SimpleClusterResolver
from kdist.keras.parameter_server import describers
from kdist.keras.parameter_server.worker_runtime import KerasWorkerRuntime

CLUSTER = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3", "127.0.0.1:4"]}


@pytest.mark.parametrize("sparse_updates", ["exact", "lazy"])
def test_a_rebuilt_worker_strategy_keeps_sparse_updates(sparse_updates):
    # A worker whose strategy lost "lazy" would send the servers the dense
    # optimizer config: the table's updates would silently be dense.
    kdist.ParameterServerStrategy  # loads kdist's hooks, as every program does
    chief = kdist.ParameterServerStrategy(SimpleClusterResolver(CLUSTER, task_type="chief", task_id=0),
                                          sparse_updates=sparse_updates)
    kind, spec, _ = describers._describe_strategy(chief, None)
    assert kind == "strategy" and spec["sparse_updates"] == sparse_updates
    runtime = KerasWorkerRuntime(ClusterSpec(CLUSTER), 0, chief.extended.security)
    worker = runtime.build("strategy", spec)
    assert worker.extended.sparse_updates == sparse_updates
    assert worker.extended.variable_router.sparse_updates == sparse_updates
