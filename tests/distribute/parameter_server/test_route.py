"""Routes on real servers: the server key of a shard view, and bfloat16 variables end to end."""

import keras
import ml_dtypes
import numpy as np
import pytest
import torch

import kdist
from kdist.distribute.parameter_server.partitioners import FixedShardsPartitioner
from kdist.distribute.parameter_server.placement import RoundRobinPlacer
from kdist.distribute.parameter_server.route import server_keys
from kdist.distribute.parameter_server.sharded_variable import RemoteVariable, ShardedVariable
from kdist.errors import ParameterServerError
from tests.keras import _ps

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster():
    with _ps.in_process_servers(2) as cluster:
        yield cluster


def test_server_keys_follow_creation_order():
    placer = RoundRobinPlacer(2)
    assert server_keys(0, placer.place("bias", (3,), "float32")) == ("v0",)
    assert server_keys(4, placer.place("w", (4, 2), "float32", FixedShardsPartitioner(2))) == ("v4/part_0", "v4/part_1")


def test_a_shard_is_fetched_from_its_server_by_server_key_not_by_name(cluster):
    strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=FixedShardsPartitioner(2))
    with strategy.scope():
        table = keras.Variable(np.arange(8, dtype="float32").reshape(4, 2), name="table")
    router = strategy.extended.variable_router
    view = ShardedVariable(router.route(table).placement, router.reader(router.route(table)))
    clients = cluster.clients()
    try:
        for position, shard in enumerate(view.variables):
            assert isinstance(shard, RemoteVariable)
            assert shard.server_key == f"v0/part_{position}" and shard.name == f"table/part_{position}"
            [state] = clients[shard.ps_index].pull([shard.server_key])
            np.testing.assert_array_equal(state.value, shard.numpy())
            with pytest.raises(ParameterServerError, match="NOT_FOUND"):
                clients[shard.ps_index].pull([shard.name])
    finally:
        for client in clients:
            client.close()


def test_a_reader_without_server_keys_gives_none():
    class Reader:
        def read(self, shards):
            return []

        def lookup(self, requests):
            return []

    placement = RoundRobinPlacer(1).place("b", (2,), "float32")
    assert RemoteVariable(placement, Reader()).server_key is None


def test_a_bfloat16_variable_stays_bfloat16_through_the_router(cluster):
    strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=FixedShardsPartitioner(2))
    start = np.array([[1.0, -2.5], [3.140625, 0.5], [7.0, 8.0]], dtype="float32")
    with strategy.scope():
        table = keras.Variable(start, dtype="bfloat16", name="half_table")
    router = strategy.extended.variable_router
    [route] = router.routes([table])
    assert route.placement.is_partitioned and route.placement.dtype == "bfloat16"
    router.configure_optimizer(keras.optimizers.serialize(keras.optimizers.SGD(1.0)), [route])
    gradient = torch.full((3, 2), 0.5, dtype=torch.bfloat16)
    router.send_gradients([(route, gradient)])
    router.send_gradients((), [(route, torch.tensor([2]), torch.ones((1, 2), dtype=torch.bfloat16), {})])
    router.pull([route], only_changed=False)
    expected = torch.tensor(start, dtype=torch.bfloat16) - 0.5
    expected[2] -= 1.0
    assert table.value.dtype == torch.bfloat16 and torch.equal(table.value, expected)
    rows, versions = router.lookup(route, torch.tensor([0, 2]))
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, expected[[0, 2]])
    assert sorted(versions) == [0, 1]
    values = router.read_shards(route, [0, 1])
    assert [value.dtype for value in values] == [np.dtype(ml_dtypes.bfloat16)] * 2
    assert np.concatenate(values).tobytes() == expected.view(torch.int16).numpy().tobytes()
