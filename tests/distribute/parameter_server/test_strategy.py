"""`ParameterServerStrategy`: placement, partitioning and the strategy's own checks.

Real variable servers on loopback ports (in this process: these tests are
about where variables go, not about process boundaries).
"""

import keras
import numpy as np
import pytest

import kdist
from kdist.cluster import SimpleClusterResolver
from kdist.distribute.parameter_server.partitioners import FixedShardsPartitioner, MinSizePartitioner
from kdist.errors import InvalidArgumentError
from tests.keras import _ps

pytestmark = pytest.mark.timeout(120)


def _numpy(variable):
    return keras.ops.convert_to_numpy(variable)


def test_variables_are_placed_round_robin_in_creation_order():
    # The seed's example: with 3 ps, v2..v5 land on ps 0, 1, 2, 0; v1 (outside scope) stays local.
    with _ps.in_process_servers(3) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        v1 = keras.Variable(0.0)
        with strategy.scope():
            v2 = keras.Variable(1.0)
            v3 = keras.Variable(2.0)
            v4 = keras.Variable(3.0)
            v5 = keras.Variable(4.0)
        devices = [strategy.extended.variable_device(v) for v in (v2, v3, v4, v5)]
        assert devices == [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (0, 1, 2, 0)]
        assert strategy.extended.placement(v1) is None
        stats = cluster.stats()
        assert [len(s.variables) for s in stats] == [2, 1, 1]
        # The servers hold the values the variables were created with.
        for variable, expected in ((v2, 1.0), (v3, 2.0), (v4, 3.0), (v5, 4.0)):
            assert strategy.extended.remote_view(variable).numpy() == expected


def test_partitioned_variable_uses_the_div_strategy():
    # 13 rows over 5 shards: [0,1,2] [3,4,5] [6,7,8] [9,10] [11,12], one shard per ps in turn.
    with _ps.in_process_servers(5) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=FixedShardsPartitioner(5))
        value = np.arange(13 * 2, dtype="float32").reshape(13, 2)
        with strategy.scope():
            w = keras.Variable(value, name="w")
        view = strategy.extended.remote_view(w)
        assert isinstance(view, kdist.distribute.ShardedVariable)
        assert [(s.row_start, s.row_stop) for s in view.variables] == [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]
        assert [s.name for s in view.variables] == [f"w/part_{i}" for i in range(5)]
        assert [s.ps_index for s in view.variables] == [0, 1, 2, 3, 4]
        np.testing.assert_array_equal(view.numpy(), value)
        np.testing.assert_array_equal(view.variables[3].numpy(), value[9:11])
        ids = np.array([[12, 0], [4, 4]])
        np.testing.assert_array_equal(view.embedding_lookup(ids), value[ids])
        # Each server holds exactly its rows.
        for index, client in enumerate(cluster.clients()):
            (shard_stats,) = client.stats().variables.values()
            assert tuple(shard_stats.shape) == tuple(view.variables[index].shape)


def test_min_size_partitioner_splits_a_dense_layer_over_two_ps():
    with _ps.in_process_servers(2) as cluster:
        partitioner = MinSizePartitioner(min_shard_bytes=1 << 10, max_shards=2)
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=partitioner)
        with strategy.scope():
            dense = keras.layers.Dense(10)
            dense.build((None, 100))
        kernel_view = strategy.extended.remote_view(dense.kernel)
        assert len(kernel_view.variables) == 2
        assert [s.ps_index for s in kernel_view.variables] == [0, 1]
        # The 40-byte bias is below min_shard_bytes: one piece, on the next ps in turn (0).
        assert strategy.extended.placement(dense.bias).is_partitioned is False
        np.testing.assert_array_equal(kernel_view.numpy(), _numpy(dense.kernel))


def test_colocated_variables_are_not_partitioned():
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), variable_partitioner=FixedShardsPartitioner(2))
        with strategy.scope():
            table = keras.Variable(np.zeros((8, 4), "float32"))
            with strategy.extended.colocate_vars_with(table):
                companion = keras.Variable(np.zeros((8, 4), "float32"))
        assert strategy.extended.placement(table).is_partitioned
        companion_placement = strategy.extended.placement(companion)
        assert not companion_placement.is_partitioned
        assert companion_placement.device == strategy.extended.placement(table).device


def test_optimizer_and_metric_variables_stay_on_the_worker():
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dropout(0.1)])
            model.compile(keras.optimizers.Adam(), "mse", metrics=["mae"])
            model.optimizer.build(model.trainable_variables)
        placed = [v for v in model.variables if strategy.extended.placement(v) is not None]
        assert [v.path for v in placed] == [v.path for v in model.weights]
        assert all(strategy.extended.placement(v) is None for v in model.optimizer.variables)
        assert all(strategy.extended.placement(v) is None for v in model.metrics_variables)
        assert len(cluster.stats()[0].variables) == len(model.weights)


def test_second_worker_starts_from_the_first_workers_values():
    with _ps.in_process_servers(1, num_workers=2) as cluster:
        first = kdist.ParameterServerStrategy(cluster.resolver("worker", 0))
        second = kdist.ParameterServerStrategy(cluster.resolver("worker", 1))
        with first.scope():
            a = keras.Variable(np.full((4,), 1.0, "float32"))
        with second.scope():
            b = keras.Variable(np.full((4,), 7.0, "float32"))
        np.testing.assert_array_equal(_numpy(b), np.full((4,), 1.0))
        assert len(cluster.stats()[0].variables) == 1
        del a


def test_strategy_reports_roles_and_devices():
    with _ps.in_process_servers(2, num_workers=2) as cluster:
        chief = kdist.ParameterServerStrategy(cluster.resolver("worker", 0))
        other = kdist.ParameterServerStrategy(cluster.resolver("worker", 1))
        assert chief.extended.should_checkpoint and not other.extended.should_checkpoint
        assert chief.extended.parameter_devices == (
            "/job:ps/replica:0/task:0/device:CPU:0",
            "/job:ps/replica:0/task:1/device:CPU:0",
        )
        assert chief.num_replicas_in_sync == 1
        assert "num_ps=2" in repr(chief)


def test_a_cluster_without_ps_is_refused():
    resolver = SimpleClusterResolver({"worker": ["127.0.0.1:1"]}, task_type="worker", task_id=0)
    with pytest.raises(InvalidArgumentError, match="'ps' task"):
        kdist.ParameterServerStrategy(resolver)


def test_a_ps_task_is_told_to_serve():
    resolver = SimpleClusterResolver({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, task_type="ps", task_id=0)
    with pytest.raises(InvalidArgumentError, match="Server"):
        kdist.ParameterServerStrategy(resolver)


def test_a_bad_partitioner_is_refused():
    resolver = SimpleClusterResolver({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, task_type="worker", task_id=0)
    with pytest.raises(InvalidArgumentError, match="variable_partitioner"):
        kdist.ParameterServerStrategy(resolver, variable_partitioner=3)
