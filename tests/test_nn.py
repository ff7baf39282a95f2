"""`kdist.nn`: TensorFlow's loss-scaling helpers for custom loops."""

import keras
import numpy as np
import pytest
import torch

import kdist
from kdist.errors import InvalidArgumentError, StrategyScopeError


def test_compute_average_loss_divides_the_sum_by_the_global_batch():
    loss = kdist.nn.compute_average_loss(torch.tensor([1.0, 2.0, 3.0]), global_batch_size=6)
    assert float(loss) == pytest.approx(1.0)


def test_compute_average_loss_weights_each_example():
    loss = kdist.nn.compute_average_loss(
        torch.tensor([[1.0, 1.0], [2.0, 2.0]]), sample_weight=torch.tensor([0.0, 1.0]), global_batch_size=4
    )
    assert float(loss) == pytest.approx(1.0)


def test_compute_average_loss_of_an_empty_global_batch_is_zero():
    assert float(kdist.nn.compute_average_loss(torch.zeros(0), global_batch_size=0)) == 0.0


def test_compute_average_loss_defaults_to_shard_size_times_replicas():
    strategy = kdist.MirroredStrategy(["cpu:0", "cpu:1"])
    shards = strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(3) * 2.0)
    per_replica = strategy.run(kdist.nn.compute_average_loss, args=(shards,))
    # Each replica: 6 / (3 * 2) = 1; summed over replicas: the mean over 6 examples, 2.
    assert float(strategy.reduce("sum", per_replica, axis=None)) == pytest.approx(2.0)


def test_scale_regularization_loss_divides_by_the_replicas():
    strategy = kdist.MirroredStrategy(["cpu:0", "cpu:1"])
    per_replica = strategy.run(lambda: kdist.nn.scale_regularization_loss(torch.tensor([1.0, 3.0])))
    assert float(strategy.reduce("sum", per_replica, axis=None)) == pytest.approx(4.0)


def test_one_device_divides_by_the_batch():
    assert float(kdist.nn.scale_regularization_loss(keras.ops.convert_to_tensor([2.0]))) == 2.0
    assert float(kdist.nn.compute_average_loss(np.ones(4, "float32"))) == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "8"])
def test_a_bad_global_batch_size_is_refused(bad):
    with pytest.raises(InvalidArgumentError, match="global_batch_size"):
        kdist.nn.compute_average_loss(torch.ones(2), global_batch_size=bad)


def test_a_scalar_loss_is_refused():
    with pytest.raises(InvalidArgumentError, match="rank"):
        kdist.nn.compute_average_loss(torch.tensor(1.0), global_batch_size=1)


def test_cross_replica_context_without_a_batch_size_is_refused():
    strategy = kdist.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        with pytest.raises(StrategyScopeError, match="cross-replica"):
            kdist.nn.compute_average_loss(torch.ones(2))
        with pytest.raises(StrategyScopeError, match="cross-replica"):
            kdist.nn.scale_regularization_loss(torch.ones(2))
