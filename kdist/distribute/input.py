"""Distributed input: datasets whose elements hold one batch shard per replica.

A "dataset" here is anything iterable that yields batches: a list of batches,
a `torch.utils.data.DataLoader`, a `keras.utils.PyDataset`, or a generator
function's result. Leaves of a batch may be NumPy arrays or torch tensors;
torch tensors are moved to the replica's device, NumPy arrays are left as they
are.
"""

import dataclasses

import torch

from kdist.distribute import nest
from kdist.distribute.batching import split_batch
from kdist.distribute.values import PerReplica
from kdist.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What a `dataset_fn` needs to know to build its shard of the input.

    Attributes:
        num_input_pipelines: how many input pipelines (workers) there are.
        input_pipeline_id: this pipeline's index, 0-based.
        num_replicas_in_sync: replicas across all pipelines.

    Example:

    ```python
    def dataset_fn(ctx):
        batch = ctx.get_per_replica_batch_size(64)
        return make_batches(x[ctx.input_pipeline_id::ctx.num_input_pipelines], batch)
    dist = strategy.distribute_datasets_from_function(dataset_fn)
    ```
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size):
        """Returns `global_batch_size // num_replicas_in_sync`.

        Raises:
            kdist.errors.InvalidArgumentError: the global batch does not divide
                evenly across replicas.
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise InvalidArgumentError(
                "The global batch size must divide evenly across replicas. Received: "
                f"global_batch_size={global_batch_size} for num_replicas_in_sync="
                f"{self.num_replicas_in_sync}."
            )
        return global_batch_size // self.num_replicas_in_sync


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """What a `value_fn` of `experimental_distribute_values_from_function` receives.

    Attributes:
        replica_id_in_sync_group: the replica the value is for.
        num_replicas_in_sync: how many replicas there are.
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


def _check_iterable(dataset, argument_name):
    try:
        iter(dataset)
    except TypeError:
        raise InvalidArgumentError(
            f"Expected an iterable of batches (list, DataLoader, PyDataset, generator). "
            f"Received: {argument_name} of type {type(dataset).__name__}."
        ) from None


def _place(structure, device):
    def move(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.device != device:
            return leaf.to(device, non_blocking=True)
        return leaf

    return nest.map_structure(move, structure)


def per_replica_structure(shards):
    """Turns one structure per replica into one structure of `PerReplica` leaves."""
    if len(shards) == 1:
        return shards[0]
    return nest.map_structure(lambda *leaves: PerReplica(leaves), *shards)


class DistributedDataset:
    """Splits each global batch of `dataset` across the replicas.

    Iterating yields structures whose leaves are `PerReplica` shards, ready for
    `strategy.run(fn, args=(element,))`. Created by
    `Strategy.experimental_distribute_dataset`.
    """

    def __init__(self, dataset, devices, first_replica=0, num_replicas_in_sync=None):
        _check_iterable(dataset, "dataset")
        self._dataset = dataset
        self._devices = devices
        # In a multi-worker job every process reads the same global batches and
        # keeps the shards of its own replicas.
        self._first_replica = first_replica
        self._num_replicas_in_sync = num_replicas_in_sync or len(devices)

    def __iter__(self):
        first, count = self._first_replica, len(self._devices)
        for batch in self._dataset:
            shards = split_batch(batch, self._num_replicas_in_sync)[first : first + count]
            placed = [
                _place(shard, device.torch_device)
                for (shard, _), device in zip(shards, self._devices)
            ]
            yield per_replica_structure(placed)


class DistributedDatasetFromFunction:
    """Per-replica batches from a dataset built by `dataset_fn(InputContext)`.

    Each step dequeues one element per replica, in replica order, as the
    `distribute_datasets_from_function` contract describes: the dataset must
    already be batched with the per-replica batch size. A final step with fewer
    elements than replicas is dropped, because a replica would have no batch.
    """

    def __init__(self, dataset_fn, input_context, devices):
        if not callable(dataset_fn):
            raise InvalidArgumentError(
                f"Expected a function taking an InputContext. Received: dataset_fn="
                f"{dataset_fn!r}."
            )
        self._dataset = dataset_fn(input_context)
        _check_iterable(self._dataset, "the dataset returned by dataset_fn")
        self._devices = devices

    def __iter__(self):
        iterator = iter(self._dataset)
        while True:
            shards = []
            for device in self._devices:
                try:
                    shards.append(_place(next(iterator), device.torch_device))
                except StopIteration:
                    return
            yield per_replica_structure(shards)
