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


def place_on_devices(devices):
    """The torch engine's `make_element`: each shard's torch tensors moved to its replica's device.

    Args:
        devices: `kdist.distribute.devices.Device` objects, one per local replica.

    Returns:
        A function from one structure per replica to one structure of `PerReplica` leaves.
    """
    def make_element(shards):
        return per_replica_structure([_place(shard, device.torch_device) for shard, device in zip(shards, devices)])

    return make_element


def call_dataset_fn(dataset_fn, input_context):
    """`dataset_fn(input_context)`, after checking that `dataset_fn` is a function.

    Raises:
        kdist.errors.InvalidArgumentError: `dataset_fn` is not callable.
    """
    if not callable(dataset_fn):
        raise InvalidArgumentError(
            f"Expected a function taking an InputContext. Received: dataset_fn="
            f"{dataset_fn!r}."
        )
    return dataset_fn(input_context)


class DistributedDataset:
    """Splits each global batch of `dataset` across the replicas.

    Iterating yields structures whose leaves are `PerReplica` shards, ready for
    `strategy.run(fn, args=(element,))`. Created by
    `Strategy.experimental_distribute_dataset`. The split is kdist's rule
    (`kdist.distribute.batching`) on every backend; what differs is how the
    shards become an element, `make_element`.

    Args:
        dataset: an iterable of global batches.
        devices: this process's replica devices, in replica order.
        first_replica: `replica_id_in_sync_group` of the first of them.
        num_replicas_in_sync: replicas in every process (default: `len(devices)`).
        make_element: turns this process's shards (one structure per local
            replica) into the element; default `place_on_devices(devices)`.
    """

    def __init__(self, dataset, devices, first_replica=0, num_replicas_in_sync=None, make_element=None):
        _check_iterable(dataset, "dataset")
        self._dataset = dataset
        self._num_local_replicas = len(devices)
        # In a multi-worker job every process reads the same global batches and
        # keeps the shards of its own replicas.
        self._first_replica = first_replica
        self._num_replicas_in_sync = num_replicas_in_sync or len(devices)
        self._make_element = make_element or place_on_devices(devices)

    def __iter__(self):
        first, count = self._first_replica, self._num_local_replicas
        for batch in self._dataset:
            shards = split_batch(batch, self._num_replicas_in_sync)[first : first + count]
            yield self._make_element([shard for shard, _ in shards])


class DistributedDatasetFromFunction:
    """Per-replica batches from a dataset built by `dataset_fn(InputContext)`.

    Each step dequeues one element per replica, in replica order, as the
    `distribute_datasets_from_function` contract describes: the dataset must
    already be batched with the per-replica batch size. A final step with fewer
    elements than replicas is dropped, because a replica would have no batch.

    Args:
        dataset_fn: called once, here, with `input_context`.
        input_context: this process's `InputContext`.
        devices: this process's replica devices, in replica order.
        make_element: as for `DistributedDataset`.
    """

    def __init__(self, dataset_fn, input_context, devices, make_element=None):
        self._dataset = call_dataset_fn(dataset_fn, input_context)
        _check_iterable(self._dataset, "the dataset returned by dataset_fn")
        self._num_local_replicas = len(devices)
        self._make_element = make_element or place_on_devices(devices)

    def __iter__(self):
        iterator = iter(self._dataset)
        while True:
            elements = []
            for _ in range(self._num_local_replicas):
                try:
                    elements.append(next(iterator))
                except StopIteration:
                    return
            yield self._make_element(elements)
