"""Tests for kdist.distribute.input (and the batch split in kdist.distribute.batching)."""

import dataclasses

import keras
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import kdist
from kdist.distribute.batching import split_sizes
from kdist.errors import InvalidArgumentError


def mirrored(num_replicas):
    return kdist.MirroredStrategy(devices=[f"cpu:{i}" for i in range(num_replicas)])


@pytest.fixture
def strategy():
    return mirrored(2)


def shards(value):
    """The components of a PerReplica as Python lists."""
    assert isinstance(value, kdist.PerReplica)
    return [np.asarray(component).tolist() for component in value.values]


# ----- experimental_distribute_dataset ----------------------------------------------------
def test_seed_example_range_4_batch_2(strategy):
    dataset = [np.array([0, 1]), np.array([2, 3])]  # tf.data.Dataset.range(4).batch(2)
    distributed = strategy.experimental_distribute_dataset(dataset)
    result = [strategy.run(lambda x: x * 2, args=(x,)) for x in distributed]
    assert [shards(r) for r in result] == [[[0], [2]], [[4], [6]]]


def test_global_batches_of_8_numpy_rows(strategy):
    dataset = list(np.arange(16).reshape(2, 8))
    elements = list(strategy.experimental_distribute_dataset(dataset))
    assert [shards(e) for e in elements] == [
        [[0, 1, 2, 3], [4, 5, 6, 7]],
        [[8, 9, 10, 11], [12, 13, 14, 15]],
    ]
    doubled = strategy.run(lambda x: x * 2, args=(elements[0],))
    assert shards(doubled) == [[0, 2, 4, 6], [8, 10, 12, 14]]


def test_torch_batches_stay_on_the_replica_device(strategy):
    (element,) = strategy.experimental_distribute_dataset([torch.arange(8.0)])
    assert shards(element) == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    assert all(c.device == torch.device("cpu") for c in element.values)


def test_tuple_and_dict_batches_are_split_leaf_by_leaf(strategy):
    batch = (torch.arange(8), {"label": torch.arange(8) * 10, "weight": np.ones(8)})
    ((x, y),) = strategy.experimental_distribute_dataset([batch])
    assert shards(x) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shards(y["label"]) == [[0, 10, 20, 30], [40, 50, 60, 70]]
    assert shards(y["weight"]) == [[1.0] * 4] * 2
    result = strategy.run(lambda x, y: x + y["label"], args=(x, y))
    assert shards(result) == [[0, 11, 22, 33], [44, 55, 66, 77]]


def test_partial_batch_of_7_over_3_replicas():
    strategy = mirrored(3)
    (element,) = strategy.experimental_distribute_dataset([np.arange(7)])
    assert shards(element) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_sizes(7, 3) == [3, 2, 2]


def test_a_batch_smaller_than_the_replica_count_leaves_empty_shards():
    strategy = mirrored(3)
    (element,) = strategy.experimental_distribute_dataset([np.arange(2)])
    assert shards(element) == [[0], [1], []]
    assert strategy.reduce("mean", element, axis=0).item() == 0.5


def test_every_sample_is_seen_once_in_order_with_a_dataloader(strategy):
    x = torch.arange(20.0)
    loader = DataLoader(TensorDataset(x, x * 10), batch_size=8)  # 8, 8, 4
    seen_x, seen_y = [], []
    for batch_x, batch_y in strategy.experimental_distribute_dataset(loader):
        assert len(batch_x) == len(batch_y) == 2
        for part_x, part_y in zip(batch_x.values, batch_y.values):
            seen_x += part_x.tolist()
            seen_y += part_y.tolist()
    assert seen_x == x.tolist()
    assert seen_y == (x * 10).tolist()


def test_dataloader_last_batch_split(strategy):
    loader = DataLoader(TensorDataset(torch.arange(20)), batch_size=8)
    elements = [x for (x,) in strategy.experimental_distribute_dataset(loader)]
    assert [[len(c) for c in e.values] for e in elements] == [[4, 4], [4, 4], [2, 2]]


def test_sum_over_a_distributed_dataset_matches_the_plain_sum(strategy):
    dataset = [torch.arange(start, start + 8.0) for start in (0, 8, 16)] + [torch.arange(24.0, 29)]
    total = sum(
        strategy.reduce("sum", strategy.run(lambda x: x * x, args=(x,)), axis=0)
        for x in strategy.experimental_distribute_dataset(dataset)
    )
    assert total.item() == sum(i * i for i in range(29))


def test_keras_py_dataset_is_accepted(strategy):
    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return np.arange(8) + 8 * index

    elements = list(strategy.experimental_distribute_dataset(Batches()))
    assert [shards(e)[1] for e in elements] == [[4, 5, 6, 7], [12, 13, 14, 15]]


def test_a_list_dataset_can_be_iterated_again(strategy):
    distributed = strategy.experimental_distribute_dataset([np.arange(4)])
    assert [shards(e) for e in distributed] == [shards(e) for e in distributed] != []


def test_invalid_datasets_raise(strategy):
    with pytest.raises(InvalidArgumentError, match="Received: dataset of type int"):
        strategy.experimental_distribute_dataset(5)
    mismatched = strategy.experimental_distribute_dataset([(np.arange(4), np.arange(3))])
    with pytest.raises(InvalidArgumentError, match=r"leading sizes \[3, 4\]"):
        list(mismatched)


def test_one_replica_yields_the_global_batch_itself():
    (element,) = mirrored(1).experimental_distribute_dataset([np.arange(4)])
    assert element.tolist() == [0, 1, 2, 3]


# ----- distribute_datasets_from_function --------------------------------------------------
def test_input_context_fields_and_per_replica_batch_size(strategy):
    contexts = []

    def dataset_fn(context):
        contexts.append(context)
        return []

    strategy.distribute_datasets_from_function(dataset_fn)
    (context,) = contexts
    assert isinstance(context, kdist.InputContext)
    assert context.num_input_pipelines == 1
    assert context.input_pipeline_id == 0
    assert context.num_replicas_in_sync == 2
    assert context.get_per_replica_batch_size(8) == 4
    with pytest.raises(InvalidArgumentError, match="global_batch_size=7"):
        context.get_per_replica_batch_size(7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.input_pipeline_id = 1


def test_each_step_dequeues_one_element_per_replica(strategy):
    def dataset_fn(context):
        size = context.get_per_replica_batch_size(8)
        return [np.arange(i * size, (i + 1) * size) for i in range(5)]

    elements = list(strategy.distribute_datasets_from_function(dataset_fn))
    # Five per-replica batches make two steps; the fifth has no partner and is dropped.
    assert [shards(e) for e in elements] == [
        [[0, 1, 2, 3], [4, 5, 6, 7]],
        [[8, 9, 10, 11], [12, 13, 14, 15]],
    ]
    doubled = strategy.run(lambda x: x * 2, args=(elements[1],))
    assert shards(doubled) == [[16, 18, 20, 22], [24, 26, 28, 30]]


def test_datasets_from_function_with_three_replicas_and_tuples():
    strategy = mirrored(3)

    def dataset_fn(context):
        assert context.num_replicas_in_sync == 3
        return ((torch.full((2,), i), torch.full((2,), -i)) for i in range(6))

    elements = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert [shards(x) for x, _ in elements] == [[[0, 0], [1, 1], [2, 2]], [[3, 3], [4, 4], [5, 5]]]
    assert shards(elements[0][1]) == [[0, 0], [-1, -1], [-2, -2]]


def test_datasets_from_function_rejects_bad_arguments(strategy):
    with pytest.raises(InvalidArgumentError, match="dataset_fn="):
        strategy.distribute_datasets_from_function([1, 2])
    with pytest.raises(InvalidArgumentError, match="returned by dataset_fn"):
        strategy.distribute_datasets_from_function(lambda context: 3)
