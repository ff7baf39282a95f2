"""Distributed input: datasets whose elements hold one batch shard per replica.

A "dataset" here is anything iterable that yields batches: a list of batches,
a `torch.utils.data.DataLoader`, a `keras.utils.PyDataset`, or a generator
function's result. Leaves of a batch may be NumPy arrays or torch tensors;
torch tensors are moved to the replica's device, NumPy arrays are left as they
are.

`per_rank(x)` declares input whose batches are already this rank's part of
every global batch, for Keras' `fit`/`evaluate`/`predict` in a multi-worker
job (`kdist.keras.replica.per_rank_input` reads it).
"""

import dataclasses

import numpy as np
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

    @property
    def global_batches(self):
        """The dataset of global batches this one splits (what `fit` reads when given it)."""
        return self._dataset

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
        for elements in self._steps():
            yield self._make_element(elements)

    def rank_batches(self):
        """This process's part of each step's global batch, as one batch (a generator).

        The local replicas' elements concatenated in replica order: what `fit`,
        `evaluate` and `predict` read when given this dataset. With one replica
        per process that is each element as it is.
        """
        for elements in self._steps():
            yield elements[0] if len(elements) == 1 else concatenate_batches(elements)

    @property
    def num_rank_batches(self):
        """How many steps the dataset holds (None when its length is unknown)."""
        try:
            return len(self._dataset) // self._num_local_replicas
        except TypeError:
            return None

    def _steps(self):
        iterator = iter(self._dataset)
        while True:
            elements = []
            for _ in range(self._num_local_replicas):
                try:
                    elements.append(next(iterator))
                except StopIteration:
                    return
            yield elements


def concatenate_batches(batches):
    """Batches of the same structure joined along the batch axis (NumPy or torch leaves)."""

    def join(*leaves):
        if isinstance(leaves[0], torch.Tensor):
            return torch.cat([torch.as_tensor(leaf).to(leaves[0].device) for leaf in leaves])
        if getattr(leaves[0], "shape", None) is not None and len(leaves[0].shape):
            return np.concatenate([np.asarray(leaf) for leaf in leaves])
        return leaves[0]

    return nest.map_structure(join, *batches)


class PerRankInput:
    """Input whose every batch is this rank's part of the global batch (made by `per_rank`).

    Attributes:
        data: the input as given to `per_rank`.
    """

    __slots__ = ("data",)

    def __init__(self, data):
        self.data = data

    def __repr__(self):
        return f"per_rank({self.data!r})"


def per_rank(data):
    """Declares that `data` is already this rank's own part of every global batch.

    By default every rank of a `MultiWorkerMirroredStrategy` job reads the same
    global batches and trains on its own slice of each. Input that is already
    split per rank (each rank reads its own files, a `tf.data` pipeline with
    `.shard()`, a generator that yields this rank's samples) is declared with
    `per_rank`: `fit`, `evaluate` and `predict` then use each batch whole as
    this rank's part, and the global batch is the ranks' batches concatenated
    in rank order (they may differ in size). Training equals plain Keras on
    those concatenated batches. In one process, `per_rank(data)` is `data`.

    A `torch.utils.data.DataLoader` whose sampler or batch sampler is a
    `DistributedSampler` and the dataset of
    `strategy.distribute_datasets_from_function` are recognised as per rank
    without it.

    Args:
        data: a `keras.utils.PyDataset`, a generator, a
            `torch.utils.data.DataLoader` or a `tf.data.Dataset` yielding this
            rank's batches.

    Returns:
        A `PerRankInput` to pass as `x` (or `validation_data`) of `fit`,
        `evaluate` or `predict`.

    Raises:
        kdist.errors.InvalidArgumentError: `data` is in-memory arrays (a
            tensor, array, list, tuple or dict), or an
            `experimental_distribute_dataset` result, which holds global batches.

    Example:

    ```python
    def batches():  # this rank's own files
        for path in sorted(glob.glob(f"shards/rank{rank}-*.npz")):
            part = np.load(path)
            yield part["x"], part["y"]

    model.fit(kdist.distribute.per_rank(batches()), epochs=1)
    ```
    """
    if isinstance(data, (PerRankInput, DistributedDatasetFromFunction)):
        return data
    if isinstance(data, DistributedDataset):
        raise InvalidArgumentError(
            "per_rank() declares input that is already split per rank, but an "
            "experimental_distribute_dataset() result holds global batches. Received: "
            "data of type DistributedDataset. Pass it to fit as it is, or build per-rank "
            "input with strategy.distribute_datasets_from_function."
        )
    if data is None or getattr(data, "shape", None) is not None or isinstance(data, (list, tuple, dict)):
        raise InvalidArgumentError(
            "per_rank() takes input that yields batches: a PyDataset, a generator, a "
            f"DataLoader or a tf.data.Dataset. Received: data of type {type(data).__name__}. "
            "For arrays that differ per rank, yield this rank's batches from a generator "
            "or a keras.utils.PyDataset and pass that to per_rank()."
        )
    return PerRankInput(data)
