"""TensorFlow's parameter-server tutorial's custom loop runs with its renames only, and equals plain Keras.

The loop (tests/keras/workers/ps_custom_loop_tutorial.py) computes
`torch.autograd.grad(loss, [v.value for v in model.trainable_variables])`
(`tape.gradient`, renamed) with the `Embedding` table the servers hold among
them, then `optimizer.apply_gradients`. Scheduled on a worker by a
`ClusterCoordinator`, and run by this process against the servers
(between-graph), it ends with plain single-device Keras' weights, and the
table's updates reached the servers as rows.
"""

import keras
import numpy as np
import pytest

import kdist
import kdist.coordinator
from kdist.distribute.parameter_server.partitioners import MinSizePartitioner
from kdist.keras.parameter_server import remote_tables
from tests.coordinator import _cluster
from tests.keras import _ps
from tests.keras.workers import ps_custom_loop_tutorial as tutorial

pytestmark = pytest.mark.timeout(240)

NUM_STEPS = tutorial.NUM_EPOCHS * tutorial.STEPS_PER_EPOCH + 1


def _strategy(resolver):
    # The tutorial's partitioner: its 8 x 16384 table is split over the two ps.
    return kdist.ParameterServerStrategy(resolver, variable_partitioner=MinSizePartitioner(256 << 10, max_shards=2))


def _assert_same_as_plain(result, strategy, stats):
    plain = tutorial.train(kdist.get_strategy())
    for ours, theirs in zip(result["weights"], plain["weights"]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result["accuracies"], plain["accuracies"])
    np.testing.assert_allclose(result["final_loss"], plain["final_loss"], rtol=1e-5)
    table = result["model"].get_layer(index=1).embeddings
    assert isinstance(result["model"].get_layer(index=1), keras.layers.Embedding)
    assert remote_tables.of(table) is not None  # held by the servers only
    keys = strategy.extended.variable_router.route(table).keys
    assert len(keys) == 2
    shards = [server.variables[key] for server in stats for key in keys if key in server.variables]
    # Every step pushed the table's gradient as rows (a dense push counts no rows).
    assert [shard.applied_updates for shard in shards] == [NUM_STEPS, NUM_STEPS]
    assert all(0 < shard.rows_updated <= 4 * NUM_STEPS for shard in shards)


def test_scheduled_on_a_worker_equals_plain_keras(tmp_path):
    with _cluster.start(num_workers=1, num_ps=2, tmp_path=tmp_path) as cluster:
        strategy = _strategy(cluster.resolver())
        # One closure at a time on one worker: the steps run in order, as on one device.
        coordinator = kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
        result = tutorial.train(strategy, coordinator)
        assert result["iterations"] == NUM_STEPS
        _assert_same_as_plain(result, strategy, cluster.ps_stats())
        coordinator.shutdown()


def test_between_graph_equals_plain_keras():
    with _ps.in_process_servers(2) as cluster:
        strategy = _strategy(cluster.resolver())
        result = tutorial.train(strategy)
        assert result["iterations"] == NUM_STEPS
        _assert_same_as_plain(result, strategy, cluster.stats())
