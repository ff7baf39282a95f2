"""Input already split per rank, and the check that ranks meant to read the same batches do.

In a multi-worker `fit`/`evaluate`/`predict` every batch Keras reads is one of
two kinds:

- a global batch (the default): every rank reads the same batch and the
  engine keeps this rank's contiguous part of it (`process_sync.local_shards`);
- a rank's batch (per rank): each rank reads its own batch and uses it whole
  as its part of the global batch, which is the ranks' batches concatenated in
  rank order. An epoch runs while any rank has a batch: a rank that ran out
  takes part with an empty part (a stand-in sample of weight 0), as plain
  Keras on the concatenation would. Sizes may differ between ranks: one small
  all-reduce per step tells every rank the others' sizes, and gradients are weighted by each
  shard's share of the global divisor as for any uneven split
  (`gradient_combine`). This rank's replicas split its batch as usual.

An input is per rank when it is a `torch.utils.data.DataLoader` whose sampler
or batch sampler is a `DistributedSampler`, the dataset of
`strategy.distribute_datasets_from_function`, or input the call declared with
`kdist.distribute.per_rank`. The kind is decided when Keras starts reading an
input (`EpochInput`), and set for each batch as it is handed to Keras, which
runs the step in the same thread before it reads the next one.

The check: at the first batch of every epoch (and of every `evaluate` and
`predict`) the ranks compare one small all-reduce (minimum and maximum) of the
input's kind and, for global batches, a fingerprint of the batch: digests of
its shapes and dtypes and of all its contents (`input_fingerprint`). A
difference raises `InputMismatchError`:
input split per rank but not declared (a `.shard()` pipeline, rank-specific
files) cannot train on 1/N of the data silently. Later batches are not
fingerprinted, so steady-state steps cost nothing extra.
"""

import dataclasses
import threading

import keras
import torch
from torch.utils import data as torch_data

from kdist import faults
from kdist.distribute.batching import batch_size_of, slice_batch, split_sizes
from kdist.distribute.input import DistributedDataset, DistributedDatasetFromFunction, PerRankInput
from kdist.errors import InputMismatchError, InvalidArgumentError
from kdist.keras.replica.input_fingerprint import fingerprint


_local = threading.local()


# ----- what a call reads -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CallInputs:
    """Which inputs of one `fit`/`evaluate`/`predict` call are per rank.

    Attributes:
        argument: how error messages name the input (`"fit's x"`, `"validation_data"`).
        per_rank: the call's `x` was declared per rank.
        validation_per_rank: `fit`'s `validation_data` was declared per rank.
        validation: that validation input as Keras receives it (its nested
            `evaluate` is recognised by identity).
        epochs: `fit`'s `EpochStarts` callback (None for `evaluate`/`predict`).
    """

    argument: str = "x"
    per_rank: bool = False
    validation_per_rank: bool = False
    validation: object = None
    epochs: object = None


def prepare_arguments(name, arguments, enclosing=None):
    """Replaces per-rank declarations and distributed datasets in bound call arguments (in place).

    Args:
        name: `"fit"`, `"evaluate"` or `"predict"`.
        arguments: the call's `BoundArguments.arguments`.
        enclosing: the `CallInputs` of the call this one runs inside (fit's
            own validation `evaluate` inherits its `validation_data` kind).

    Returns:
        The call's `CallInputs`.
    """
    x, per_rank = _unwrap(arguments.get("x"))
    if "x" in arguments:
        arguments["x"] = x
    validation, validation_per_rank = None, False
    if arguments.get("validation_data") is not None:
        validation, validation_per_rank = _unwrap(arguments["validation_data"])
        arguments["validation_data"] = validation
    argument = f"{name}'s x"
    if name == "evaluate" and enclosing is not None and x is not None and x is enclosing.validation:
        argument, per_rank = "validation_data", enclosing.validation_per_rank
    epochs = EpochStarts() if name == "fit" else None
    return CallInputs(argument, per_rank, validation_per_rank, validation, epochs)


def unwrap_one_process(args, kwargs):
    """`(args, kwargs)` with per-rank declarations and distributed datasets replaced (one process).

    In one process a rank's batch is the global batch, so a declaration only
    needs taking off.
    """
    return [_unwrap(value)[0] for value in args], {key: _unwrap(value)[0] for key, value in kwargs.items()}


def _unwrap(value):
    """`(what Keras reads, declared per rank)` for one argument value."""
    if isinstance(value, PerRankInput):
        return _unwrap(value.data)[0], True
    if isinstance(value, DistributedDatasetFromFunction):
        return PerRankBatchLoader(value.rank_batches, value.num_rank_batches), True
    if isinstance(value, DistributedDataset):
        dataset = value.global_batches
        return BatchLoader(lambda: dataset, _length(dataset)), False
    return value, False


def _length(dataset):
    try:
        return len(dataset)
    except TypeError:
        return None


class _Batches(torch_data.IterableDataset):
    """Batches that are already made, converted as Keras converts a generator's."""

    def __init__(self, make_iterable):
        super().__init__()
        self._make_iterable = make_iterable

    def __iter__(self):
        for batch in self._make_iterable():
            yield keras.tree.map_structure(keras.ops.convert_to_tensor, batch, none_is_leaf=False)


class _SizedBatches(_Batches):
    def __init__(self, make_iterable, length):
        super().__init__(make_iterable)
        self._length = length

    def __len__(self):
        return self._length


class BatchLoader(torch_data.DataLoader):
    """A `DataLoader` over batches already made: what Keras reads from a distributed dataset.

    Args:
        make_iterable: called at every epoch; returns an iterable of batches.
        length: the number of batches, or None when unknown.
    """

    def __init__(self, make_iterable, length=None):
        dataset = _Batches(make_iterable) if length is None else _SizedBatches(make_iterable, length)
        super().__init__(dataset, batch_size=None)


class PerRankBatchLoader(BatchLoader):
    """A `BatchLoader` whose every batch is this rank's part of the global batch."""


# ----- the kind of the batch being read ---------------------------------------------
def batch_kind():
    """True while the batch Keras is reading is this rank's part (per rank), else False."""
    return getattr(_local, "per_rank", False)


def set_batch_kind(per_rank, stand_in=False):
    _local.per_rank = per_rank
    _local.stand_in = stand_in


def uses_batch_whole():
    """Whether the engine uses the current batch whole as this rank's part (not its slice)."""
    return batch_kind() and not faults.ACTIVE.sliced_per_rank_input


def rank_batch_size(batch):
    """The samples this rank contributes with `batch`, a rank's batch (0 for a stand-in)."""
    return 0 if getattr(_local, "stand_in", False) else batch_size_of(batch)


def stand_in_batch(last):
    """What a rank out of per-rank input hands Keras while others have data (weight 0, `local_shards`)."""
    return slice_batch(last, 0, 1)


def no_batches_error(reading, has_data):
    """The error every rank raises when some rank's per-rank input has no batch at all this epoch."""
    return InputMismatchError(
        f"Some rank's {reading.argument} (split per rank) has no batch at all in this epoch while "
        f"other ranks have data. Received: this rank has data={has_data}. Expected: at least one "
        "batch on every rank, so that it can take part in the steps of the ranks that still "
        "have data. Fix: give every rank some of the data (split it into as many parts as ranks)."
    )


def uneven_lengths_error(reading, counts):
    """Every rank's error for per-rank inputs of known, different lengths (Keras fixes the steps up front)."""
    shown = [count if count >= 0 else None for count in counts]
    return InputMismatchError(
        f"Ranks hold different numbers of batches of {reading.argument} (split per rank), "
        "and Keras fixes each rank's steps per epoch from its input's length, so the ranks "
        "cannot step together through every batch. Received: batches per rank "
        f"{shown} in rank order (None: unknown length). Expected: the same number of batches "
        "on every rank. Fix: give every rank the same number of batches (DistributedSampler "
        "pads to equal lengths), or pass a generator (no length): kdist then steps while any "
        "rank has data, ranks that ran out adding nothing to the global batch."
    )


def local_shards(engine, batch):
    """This rank's `(local replica id, shard, size)` list and the global batch size, for a rank's batch.

    One all-reduce tells every rank every rank's batch size, so the global
    batch size (their sum) and the rows each rank contributes to predictions
    are known everywhere. A rank that ran out of input (a stand-in batch)
    contributes 0 samples: replica 0 runs the stand-in with weight 0.

    Raises:
        kdist.errors.InvalidArgumentError: some rank's input yielded an empty batch.
    """
    collectives = engine.strategy.extended.collectives
    size = rank_batch_size(batch)
    stand_in = getattr(_local, "stand_in", False)
    counts = torch.zeros(collectives.world_size, dtype=torch.int64)
    # -1 marks a batch the input itself yielded empty (a stand-in is not one).
    counts[collectives.rank] = size if size or stand_in else -1
    (counts,) = collectives.all_reduce_sum([counts], name="rank_batch_sizes")
    sizes = [int(count) for count in counts.tolist()]
    if -1 in sizes:
        raise InvalidArgumentError(
            "Every batch that per-rank input yields must hold at least one sample. Received: "
            f"batch sizes {sizes} in rank order (-1: an empty batch). Make every rank yield "
            "non-empty batches; a rank whose input ends early needs no empty batches."
        )
    _local.rows_per_rank = sizes
    if not size:
        return [(0, batch, 0)], sum(sizes)
    active, start = [], 0
    for replica_id, count in enumerate(split_sizes(size, engine.num_replicas)):
        if count:
            active.append((replica_id, slice_batch(batch, start, start + count), count))
        start += count
    return active, sum(sizes)


def gather_outputs(engine, local_outputs):
    """Every rank's predictions for the current per-rank batches, concatenated in rank order."""
    collectives = engine.strategy.extended.collectives
    rows = _local.rows_per_rank
    return keras.tree.map_structure(
        lambda leaf: collectives.all_gather_rows(leaf, rows, name="predictions").to(leaf.device), local_outputs
    )


# ----- epochs and the first-batch check --------------------------------------------
class EpochStarts(keras.callbacks.Callback):
    """Counts the epochs one `fit` call began, so an input read across epochs is checked at each one."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.count += 1


class EpochInput:
    """One Keras epoch iterator's input in a multi-worker call: its kind and its first-batch check.

    A `DistributedSampler` built for another number of ranks or another rank
    is noted here and refused at the first batch's comparison, on every rank
    at once: raising on the misconfigured ranks alone would leave the others
    waiting in the next collective until it times out.

    Args:
        iterable: what Keras' epoch iterator reads.
        inputs: the call's `CallInputs` (None: nothing declared).
        collectives: the job's `ProcessCollectives`.
    """

    def __init__(self, iterable, inputs, collectives):
        self._collectives = collectives
        self._inputs = inputs or CallInputs()
        self.per_rank, self._invalid = _is_per_rank(iterable, self._inputs, collectives)
        self._checked_epoch = None
        self._checked = False

    @property
    def argument(self):
        """How error messages name this input (`"fit's x"`, `"validation_data"`)."""
        return self._inputs.argument

    def admit(self, batch, stand_in=False):
        """Called on every rank before each batch goes to Keras; checks the first of each epoch.

        `stand_in`: this rank ran out of its per-rank input; `batch` stands in
        for an empty part (weight 0).

        Raises:
            kdist.errors.InvalidArgumentError: a `DistributedSampler` built for
                another job, on this rank or another.
            kdist.errors.InputMismatchError: ranks disagree on the input's kind,
                or read different global batches.
        """
        set_batch_kind(self.per_rank, stand_in)
        epochs = self._inputs.epochs
        epoch = 0 if epochs is None else epochs.count
        if epochs is not None and not epoch:
            # fit peeks at a batch for the model's shapes before its first
            # epoch, before rank 0's random state is shared: not trained on.
            return
        if self._checked and epoch == self._checked_epoch:
            return
        self._checked, self._checked_epoch = True, epoch
        self._compare(batch)

    def _compare(self, batch):
        rank = self._collectives.rank
        # [rank + 1 where this rank's input is invalid, kind, structure, contents]
        invalid = float(rank + 1) if self._invalid else 0.0
        values = [invalid, 1.0, 0.0, 0.0] if self.per_rank else [invalid, 0.0, *fingerprint(batch)]
        local = torch.tensor(values + [-v for v in values], dtype=torch.float64)
        (reduced,) = self._collectives.all_reduce_min([local], name="input_fingerprint")
        lowest, highest = reduced[: len(values)].cpu(), -reduced[len(values) :].cpu()
        argument = self._inputs.argument
        if highest[0]:
            if self._invalid:
                raise InvalidArgumentError(self._invalid)
            raise InvalidArgumentError(
                f"The DistributedSampler of {argument} on rank {int(highest[0]) - 1} is built for "
                "another job (that rank's error names its num_replicas and rank); every rank stops "
                f"here rather than wait for it. Received: a valid sampler on rank {rank}. Build the "
                "sampler with DistributedSampler(dataset) after the strategy is created, or with the "
                "job's global rank (strategy.extended.collectives.rank), not the local rank."
            )
        if lowest[1] != highest[1]:
            raise InputMismatchError(
                f"Ranks disagree whether {argument} is split per rank: some read it as their own "
                "part of the global batch (a DataLoader with a DistributedSampler, "
                "kdist.distribute.per_rank, distribute_datasets_from_function), others as the "
                f"whole global batch. Received: per rank={self.per_rank} on rank "
                f"{rank}. Pass the same kind of input on every rank."
            )
        # The unshared_random_state control models a silent shuffle bug that
        # only the comparison with plain Keras may catch; do not report it here.
        if self.per_rank or faults.ACTIVE.unshared_random_state or torch.equal(lowest, highest):
            return
        world_size = self._collectives.world_size
        raise InputMismatchError(
            f"Ranks read different batches from {argument}, but every rank must read the same "
            "global batch (each keeps its own slice of it): the first batch of this epoch "
            f"differs between the {world_size} ranks (shapes or a checksum of its values). "
            f"Training on it would silently use 1/{world_size} of the data. Received: "
            f"{argument} not declared per rank. Likely cause: input already split per rank "
            "(a sampler that shards by rank, a tf.data pipeline with .shard(), a PyDataset or "
            "generator reading rank-specific files) or ranks shuffling with their own seeds. "
            "Fix: declare it per rank with kdist.distribute.per_rank(...) (or build it with "
            "strategy.distribute_datasets_from_function), so each rank's batch is used whole "
            "as its part of the global batch; or give every rank the full data, in the same order."
        )


def _is_per_rank(iterable, inputs, collectives):
    """`(per rank, why the input is invalid or None)`."""
    if isinstance(iterable, PerRankBatchLoader):
        return True, None
    sampler = _distributed_sampler(iterable)
    if sampler is None:
        return inputs.per_rank, None
    if sampler.num_replicas == collectives.world_size and sampler.rank == collectives.rank:
        return True, None
    return True, (
        f"The DistributedSampler of {inputs.argument} is built for another job. Received: "
        f"num_replicas={sampler.num_replicas}, rank={sampler.rank}. Expected: "
        f"num_replicas={collectives.world_size}, rank={collectives.rank} (this process). "
        "Build it with DistributedSampler(dataset) after the strategy is created, or with "
        "num_replicas and rank from strategy.extended.collectives (the global rank, not the "
        "local rank on this node)."
    )


def _distributed_sampler(iterable):
    if not isinstance(iterable, torch_data.DataLoader):
        return None
    batch_sampler = iterable.batch_sampler
    for candidate in (iterable.sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
        if isinstance(candidate, torch_data.DistributedSampler):
            return candidate
    return None
