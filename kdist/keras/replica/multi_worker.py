"""Keras behaviour that changes when a model trains in several processes.

- Input: every rank reads the same global batches. Rank 0's random state is
  copied to every rank when each epoch begins, so shuffling (torch's
  `RandomSampler`, NumPy, `random`) draws the same order everywhere. Ranks
  agree on the number of batches per epoch (the smallest), and for inputs
  other than arrays (generators, `PyDataset`, `DataLoader`) they agree before
  every step that each still has data: when one runs out, all stop the epoch.
  Input already split per rank is used whole instead: known lengths must
  agree, generators run while any rank has data (exhausted ranks contribute
  empty parts), and the first batch of
  every epoch is compared across ranks (`kdist.keras.replica.per_rank_input`).
- Side effects: only the chief (rank 0) shows a progress bar and runs
  `CSVLogger` and `TensorBoard` (the rule is `kdist.keras.chief_only`'s). `model.save`/`save_weights` are collectives:
  the chief writes to a temporary file, fsyncs it and renames it into place
  (`kdist.atomic_files`), then every rank continues; a rank given a file of its
  own writes it too. `BackupAndRestore` saves
  the same way and every rank restores.
- Decisions made from logs (`EarlyStopping`, `ReduceLROnPlateau`, best-only
  checkpoints) agree on every rank because the logs are bitwise identical.
"""

import base64
import contextlib
import inspect
import json
import os
import random
import socket
import threading

import keras
import numpy as np
import torch

from kdist import atomic_files
from kdist.errors import InvalidArgumentError, KdistError
from kdist.keras import _compat, atomic_save, chief_only
from kdist.keras.replica import gradient_accumulation, per_rank_input, sharded_optimizer

_active = threading.local()


# ----- input ------------------------------------------------------------------
@contextlib.contextmanager
def input_synchronisation(collectives, inputs=None):
    """While active (in this thread), Keras epoch iterators agree across ranks on when data ends.

    `inputs`: the call's `per_rank_input.CallInputs` (what it declared per rank).
    """
    previous = (getattr(_active, "collectives", None), getattr(_active, "inputs", None))
    previous_kind = per_rank_input.batch_kind()
    _active.collectives, _active.inputs = collectives, inputs
    try:
        yield
    finally:
        _active.collectives, _active.inputs = previous
        per_rank_input.set_batch_kind(previous_kind)


def synchronised_iterable(epoch_iterator, iterable):
    """Wraps what `EpochIterator._get_iterator` returned, when a multi-worker call is active."""
    collectives = getattr(_active, "collectives", None)
    if collectives is None:
        return iterable
    reading = per_rank_input.EpochInput(iterable, getattr(_active, "inputs", None), collectives)
    # Agree on the number of batches before the epoch starts. Global batches:
    # the shortest rank's. Input split per rank runs while any rank has a
    # batch (exhausted ranks take part with empty parts), which needs every
    # rank to read on until it runs out: lengths all unknown, or all equal.
    known = _compat.epoch_iterator_num_batches(epoch_iterator)
    world_size = collectives.world_size
    local = torch.zeros(2 * world_size, dtype=torch.int64)
    local[collectives.rank] = known if known else -1
    local[world_size + collectives.rank] = int(reading.per_rank)
    (reduced,) = collectives.all_reduce_sum([local], name="num_batches")
    counts = [int(count) for count in reduced[:world_size].tolist()]
    resumed_from, _active.resumed_from = getattr(_active, "resumed_from", None), None
    if resumed_from is not None and all(reduced[world_size:].tolist()):
        raise _per_rank_resume_error(resumed_from, world_size)
    if all(reduced[world_size:].tolist()):
        if len(set(counts)) > 1:
            raise per_rank_input.uneven_lengths_error(reading, counts)
    elif any(count >= 0 for count in counts):
        smallest = min(count for count in counts if count >= 0)
        if smallest != known:
            _compat.set_epoch_iterator_num_batches(epoch_iterator, smallest)
    # Same arrays everywhere: lengths already agree.
    return _HasDataIterable(iterable, collectives, reading, agree_on_end=not _compat.is_array_adapter(epoch_iterator))


class _HasDataIterable:
    """Every `next` first agrees with the other ranks which of them still have a batch.

    `reading` (a `per_rank_input.EpochInput`) admits each batch: it sets the
    batch's kind and compares the first batch of each epoch across ranks.
    With `agree_on_end=False` (arrays) the ranks' lengths are known to agree.
    Global batches: when one rank runs out, every rank ends the epoch (they
    read the same data, so all run out together unless their inputs differ).
    Input split per rank: the epoch goes on while any rank has a batch; a rank
    that ran out hands Keras a stand-in (its last batch's first sample) that
    the engine runs with weight 0 (`per_rank_input.local_shards`), so the
    steps are those of plain Keras on the ranks' batches concatenated.
    """

    def __init__(self, iterable, collectives, reading, agree_on_end=True):
        self._iterable = iterable
        self._collectives = collectives
        self._reading = reading
        self._agree_on_end = agree_on_end

    def __iter__(self):
        # iter() of the input now, not at the first next(), as Keras would:
        # a DataLoader draws its base seed from torch's global generator in
        # iter(), and Keras makes (and drops) one more iterator at every
        # epoch's end. Deferring that draw would leave rank 0's random state
        # one draw behind plain Keras' before the next epoch's shuffle.
        return self._batches(iter(self._iterable))

    def _batches(self, iterator):
        collectives = self._collectives
        last = None
        while True:
            try:
                batch = next(iterator)
                has_data = 1
            except StopIteration:
                batch, has_data = None, 0
            if not self._agree_on_end:
                if not has_data:
                    return
                self._reading.admit(batch)
                yield batch
                continue
            # [has a batch, -(has a batch), has had one this epoch]: one small all-reduce.
            began = int(has_data or last is not None)
            flags = torch.tensor([has_data, -has_data, began], dtype=torch.int64)
            (flags,) = collectives.all_reduce_min([flags], name="has_data")
            every, anyone, every_began = int(flags[0]), -int(flags[1]), int(flags[2])
            if not anyone or (not every and not self._reading.per_rank):
                # Global batches: another rank ran out, everyone ends the epoch here.
                return
            if not every and not every_began:
                raise per_rank_input.no_batches_error(self._reading, bool(has_data))
            stand_in = not has_data
            if stand_in:
                batch = per_rank_input.stand_in_batch(last)
            else:
                last = batch
            self._reading.admit(batch, stand_in=stand_in)
            yield batch

    def __len__(self):
        return len(self._iterable)


class SharedRandomState(keras.callbacks.Callback):
    """Copies rank 0's Python, NumPy and torch random state to every rank at each epoch's start.

    That is what makes every rank shuffle the global data into the same order,
    the one a single process seeded like rank 0 would use.
    """

    def __init__(self, collectives):
        super().__init__()
        self._collectives = collectives

    def on_epoch_begin(self, epoch, logs=None):
        state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        state = self._collectives.broadcast_object(state, source_rank=0, name="random_state")
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])


# ----- calls to fit / evaluate / predict ------------------------------------------
def adjust_call(method, model, args, kwargs, strategy, share_random_state=True):
    """Returns the `(args, kwargs, inputs)` a rank passes to Keras' fit/evaluate/predict.

    `inputs`: the call's `per_rank_input.CallInputs`, for `input_synchronisation`.
    """
    collectives = strategy.extended.collectives
    signature = inspect.signature(method)
    bound = signature.bind(model, *args, **kwargs)
    arguments = bound.arguments
    inputs = per_rank_input.prepare_arguments(method.__name__, arguments, getattr(_active, "inputs", None))
    # Who writes logs and checkpoints: kdist.keras.chief_only; saves here are collectives.
    callbacks = chief_only.task_callbacks(arguments, strategy, collective_saves=True,
                                          has_verbose="verbose" in signature.parameters)
    if callbacks is not None:
        for callback in callbacks:
            if isinstance(callback, keras.callbacks.BackupAndRestore):
                _make_backup_collective(callback, strategy)
            elif isinstance(callback, keras.callbacks.ModelCheckpoint):
                _create_checkpoint_directory(callback, strategy)
        if method.__name__ == "fit" and share_random_state:
            callbacks.insert(0, SharedRandomState(collectives))
        if inputs.epochs is not None:
            callbacks.insert(0, inputs.epochs)
        arguments["callbacks"] = callbacks
    return bound.args[1:], bound.kwargs, inputs


def _create_checkpoint_directory(callback, strategy):
    # ModelCheckpoint creates its directory with os.makedirs (no exist_ok) on
    # every rank; create it once, before training, so no rank races another.
    directory = os.path.dirname(str(callback.filepath))
    if directory and "{" not in directory and "://" not in directory:
        run_on_chief(strategy, lambda: os.makedirs(directory, exist_ok=True), "checkpoint_directory")


# ----- saving ----------------------------------------------------------------------
def run_on_chief(strategy, write, name, also_here=False):
    """Runs `write()` on the chief (`strategy.extended.is_chief`) only; every rank returns once it finished.

    `also_here`: this rank runs `write()` too. A failure is raised where it
    happened and reported on the other ranks as a `KdistError`, so no rank
    waits for a save that will not come.
    """
    error = None
    collectives = strategy.extended.collectives
    if strategy.extended.is_chief or also_here:
        try:
            write()
        except Exception as caught:  # noqa: BLE001 - re-raised below, after the others are told
            error = caught
    succeeded = collectives.all_true(error is None, name=f"barrier({name})")
    if error is not None:
        raise error
    if not succeeded:
        raise KdistError(f"Another rank (the chief, or one saving to a path of its own) failed while running "
                         f"{name}; see its log for the error.")


def collective_save(strategy, save, model, filepath, args, kwargs):
    """`model.save`/`save_weights` in a multi-worker job: the chief writes atomically, all wait.

    A rank given another file than the chief's (TensorFlow's multi-worker
    tutorial gives each worker a temporary directory of its own) writes it too,
    as it would on one device; a rank given the chief's file on the chief's
    host leaves it to the chief, so no two processes write one file.
    """
    gradient_accumulation.flush(model)  # the file holds the whole job's accumulated gradients
    write = lambda: atomic_save.save(save, model, (filepath, *args), kwargs)  # noqa: E731
    target = _save_target(filepath)
    chief_target = strategy.extended.collectives.broadcast_object(target, name="save path")
    also_here = target != chief_target
    with sharded_optimizer.gathered_for_saving(model, writes=strategy.extended.is_chief or also_here):
        run_on_chief(strategy, write, f"save({target[1]})", also_here=also_here)


def _save_target(filepath):
    """`(host, path)` naming the file a save writes: two ranks with equal targets write one file."""
    if isinstance(filepath, (str, os.PathLike)):
        path = os.fspath(filepath)
        return (socket.gethostname(), path if "://" in path else os.path.realpath(path))
    return (socket.gethostname(), repr(filepath))  # A file object: this rank's own.


def _make_backup_collective(callback, strategy):
    """BackupAndRestore: the chief writes weights and metadata atomically; every rank waits.

    Restoring is unchanged: every rank reads the same files at `on_train_begin`.
    """
    if getattr(callback, "_kdist_collective", False):
        return
    paths = _compat.backup_paths(callback)

    def write():
        model = callback.model
        # The class's save_weights: the instance's is the collective version.
        save_weights = lambda path: atomic_files.write_via(path, lambda tmp: type(model).save_weights(model, tmp, overwrite=True))  # noqa: E731
        extra = {_RANDOM_STATE_KEY: random_state(), _PROCESSES_KEY: strategy.extended.num_input_pipelines}
        atomic_save.write_backup(callback, save_weights, extra)

    def _save_model():
        gradient_accumulation.flush(callback.model)
        with sharded_optimizer.gathered_for_saving(callback.model, writes=strategy.extended.is_chief):
            run_on_chief(strategy, write, "BackupAndRestore")

    original_begin = callback.on_train_begin
    original_end = callback.on_train_end

    def on_train_begin(logs=None):
        original_begin(logs)  # every rank restores weights and the initial epoch
        _active.resumed_from = None
        if os.path.exists(paths.metadata):
            with open(paths.metadata) as reader:
                metadata = json.load(reader)
            saved = metadata.get(_RANDOM_STATE_KEY)
            if saved is not None:
                set_random_state(saved)
            # A mid-epoch backup of another number of processes: fine for global
            # batches, refused for input split per rank (`synchronised_iterable`).
            processes = metadata.get(_PROCESSES_KEY)
            steps = (metadata.get(STEP_STATE_KEY) or {}).get("steps")
            if steps and processes not in (None, strategy.extended.num_input_pipelines):
                _active.resumed_from = (callback.backup_dir, processes, metadata["epoch"], steps)

    def on_train_end(logs=None):
        run_on_chief(strategy, lambda: original_end(logs), "BackupAndRestore.on_train_end")

    _compat.patch_backup_save(callback, _save_model)
    object.__setattr__(callback, "on_train_begin", on_train_begin)
    object.__setattr__(callback, "on_train_end", on_train_end)
    object.__setattr__(callback, "_kdist_collective", True)


# The random state travels with the backup so a resumed job shuffles its
# remaining epochs exactly as the uninterrupted job would have.
_RANDOM_STATE_KEY = "kdist_random_state"
# The number of processes (input pipelines) of the job that wrote a backup.
_PROCESSES_KEY = "kdist_processes"
STEP_STATE_KEY = "kdist_step"  # where `kdist.keras.step_resume` keeps its step state


def _per_rank_resume_error(resumed_from, world_size):
    backup_dir, processes, epoch, steps = resumed_from
    return InvalidArgumentError(
        f"BackupAndRestore({backup_dir!r}) holds a backup taken at epoch {epoch}, step {steps} by a "
        f"job of {processes} processes; this job has {world_size}, and its input is split per rank, "
        f"so the global batches (each rank's batches joined) depend on the number of processes and "
        f"skipping the saved steps would skip other samples than those the backup trained on. "
        f"Relaunch with {processes} processes, feed global batches (arrays, a PyDataset, a DataLoader "
        "without a DistributedSampler), or resume from a backup taken at an epoch's end "
        "(save_freq='epoch')."
    )


def random_state():
    """Python's, NumPy's and torch's global random state, as JSON-serialisable data."""
    version, internal, gauss = random.getstate()
    name, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(position), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }


def set_random_state(saved):
    """Restores what `random_state()` returned."""
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch_state = np.frombuffer(base64.b64decode(saved["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(torch_state))
