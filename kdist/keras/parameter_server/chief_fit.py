"""`model.fit` and `model.evaluate` on the chief, driving the workers through a coordinator.

Under `ParameterServerStrategy`, on the chief of a cluster with workers (or
once a `ClusterCoordinator` exists for the strategy), `fit` does not train
locally. Each epoch is cut into closures of `steps_per_execution` steps
(kdist packs the steps itself; the torch trainer accepts only 1), scheduled
onto the workers. A worker runs its copy of the model's own `train_step` on
each batch — reading the latest variables and pushing gradients to the
parameter servers — and returns the state of the model's metrics for its
closure; the chief adds those up, so the logs cover every step once.

Data: arrays, a `dataset_fn` (a generator function included), a
`keras.utils.PyDataset` or a `PerWorkerDataset`; see
`kdist.keras.parameter_server.chief_data` for how each is shared by the workers.

Callbacks run on the chief: `BackupAndRestore` and `ModelCheckpoint` save the
parameter servers' state (weights and optimizer slots), each file written to a
temporary file, fsynced and renamed into place (`kdist.keras.atomic_save`,
installed by `kdist.keras.parameter_server.adapter`); the chief's
`optimizer.iterations` counts the steps the closures applied. A chief that
died and was restarted resumes at the step its backup names, after the dead
chief's closures on the workers ended (`kdist.keras.parameter_server.chief_resume`).

Progress is Keras' own: the `CallbackList` adds `keras.callbacks.ProgbarLogger`
as Keras' `fit` does (`verbose=0` silent, 1 a bar, 2 one line per epoch); a
bar is drawn only when stdout is a terminal (`kdist.keras.progress`). With
`verbose != 0`, a line after an epoch reports closures retried after worker
failures and workers unavailable, when there were any.
"""

import contextlib

import keras
import numpy as np
import torch

from kdist.coordinator import ClusterCoordinator
from kdist.errors import InvalidArgumentError, UnsupportedError
from kdist.keras import _compat
from kdist.keras.parameter_server.chief_data import EpochSource, IndexedBatches, split_validation
from kdist.keras import step_resume
from kdist.keras.parameter_server import chief_resume, closure_outcome, save_points
from kdist.keras.parameter_server.describers import add_state
from kdist.keras.progress import CoordinatorStatusLogger, resolve_verbose

_UNSUPPORTED_FIT = ("validation_split", "class_weight", "sample_weight", "validation_sample_weight")


def coordinator_for(strategy):
    """The strategy's coordinator, created on first use."""
    existing = strategy.extended.cluster_coordinator
    return existing if existing is not None else ClusterCoordinator(strategy)


# ----- what a closure runs on a worker -------------------------------------------------
def run_steps(model, kind, source, steps, skip=0):
    """Runs `steps` train or test steps of the worker's `model`; returns its metric state and batch spec.

    `source` is a list of batches (array data carried by the closure) or the
    worker's iterator of its per-worker dataset, of which `skip` batches are
    read and dropped first (a resumed `fit`, `chief_resume`).
    """
    for _ in range(skip):
        next(source)
    model.reset_metrics()
    training = kind == "train"
    function = model.make_train_function() if training else model.make_test_function()
    if model.training != training:  # `train()` walks every submodule: only on a switch
        model.train(training)
    batch = None
    for step in range(steps):
        batch = source[step] if isinstance(source, (list, IndexedBatches)) else next(source)
        function([_to_torch(batch)])
    states = [np.asarray(variable.numpy()) for variable in closure_outcome.metric_variables(model)]
    # An empty batch of the same structure, shapes and dtypes: enough for the
    # chief to build its own metrics symbolically.
    spec = keras.tree.map_structure(
        lambda value: np.zeros((0, *tuple(value.shape)[1:]), dtype=keras.backend.standardize_dtype(value.dtype)),
        batch)
    return states, spec


# Each step's train/test function pulls what changed first: no pull before the closure.
run_steps.kdist_reads_variables_itself = True


def _to_torch(batch):
    def convert(value):
        if isinstance(value, np.ndarray):
            return torch.from_numpy(value)
        return value

    if isinstance(batch, list):
        batch = tuple(batch)
    return keras.tree.map_structure(convert, batch)


# ----- on the chief -------------------------------------------------------------------
class _MetricMerger:
    """Adds closures' metric states into the chief's metrics, building them on first use.

    The variable list is looked up once per pass: walking `model.metrics`
    costs more than the merge itself. A resumed epoch's `skip` restores the
    saved metric state first, once the metrics are built.
    """

    def __init__(self, model, skip=None):
        self._model = model
        self._variables = closure_outcome.metric_variables(model)
        self._skip = skip
        if skip is not None and len(self._variables) == len(skip.state["metrics"]):
            self._restore()

    def _restore(self):
        self._skip.restore_metrics(self._variables)
        self._skip = None

    def add(self, states, spec):
        if len(self._variables) != len(states) and spec is not None:
            _compat.symbolic_build(self._model, spec)
            self._variables = closure_outcome.metric_variables(self._model)
        if self._skip is not None:
            self._restore()
        add_state(self._variables, states,
                  what=f"the metrics of {self._model.name!r} (compile the model in strategy.scope() before fit)")


def _results(model):
    logs = {}
    for name, value in _compat.local_metrics_result(model).items():
        array = keras.ops.convert_to_numpy(value)
        logs[name] = float(array) if np.ndim(array) == 0 else array
    return logs


@contextlib.contextmanager
def one_step_per_execution(model):
    """Runs the block with `model.steps_per_execution == 1` when torch would reject more."""
    packed = getattr(model, "steps_per_execution", 1)
    if packed == 1 or not _compat.TORCH_TRAINER_REJECTS_STEPS_PER_EXECUTION:
        yield
        return
    model.steps_per_execution = 1
    for kind in ("train", "test", "predict"):
        setattr(model, f"{kind}_function", None)
    try:
        yield
    finally:
        model.steps_per_execution = packed
        for kind in ("train", "test", "predict"):
            setattr(model, f"{kind}_function", None)


def _pack(model):
    return max(1, int(getattr(model, "steps_per_execution", 1) or 1))


def _batch_hook_overridden(callbacks, kind, when, reading_logs=False):
    """True when a callback overrides a batch hook (Keras' own test for async dispatch, by method identity).

    With `reading_logs`, Keras' `ProgbarLogger` counts only when it draws a bar
    (`verbose=1`): with `verbose=2` it counts steps and prints the epoch's logs at the end.
    """
    names = (f"on_batch_{when}", f"on_{kind}_batch_{when}")
    return any(getattr(type(callback), name) is not getattr(keras.callbacks.Callback, name)
               for callback in callbacks.callbacks for name in names
               if not (reading_logs and type(callback) is keras.callbacks.ProgbarLogger and callback.verbose != 1))


def _run_pass(model, coordinator, kind, chunks, callbacks, skip=None, stream_skip=0):
    """Schedules the closures of one pass and merges their metric states in order.

    Batch hooks run only when a callback overrides them (Keras'
    `ProgbarLogger` does, with `verbose != 0`), and logs (a `metric.result()`
    per metric) are computed for a closure only when a batch hook reads them
    (not a `verbose=2` `ProgbarLogger`): nothing else does, and per closure
    they cost more than the merge.

    A save is exact: closures are scheduled ahead only up to the next step
    at which a saving callback will save (`kdist.keras.parameter_server.save_points`),
    so when its hook runs every closure up to that step has been applied and
    none after it was sent. Between saves, every closure is in flight at once.

    A resumed epoch (`chief_resume`): `skip` restores the saved metrics, and
    the first closure, which drops `stream_skip` batches of the worker's
    stream, is sent alone (no other closure may read the stream before it).
    """
    if not chunks and skip is not None:
        return dict(skip.logs or {})  # every step of the epoch is in the backup
    on_begin = getattr(callbacks, f"on_{kind}_batch_begin")
    on_end = getattr(callbacks, f"on_{kind}_batch_end")
    call_begin = _batch_hook_overridden(callbacks, kind, "begin")
    call_end = _batch_hook_overridden(callbacks, kind, "end")
    read_logs = _batch_hook_overridden(callbacks, kind, "end", reading_logs=True)
    merger = _MetricMerger(model, skip)
    barriers = save_points.barriers(callbacks, chunks) if kind == "train" else set()
    values = []

    def schedule_through_next_barrier():
        while len(values) < len(chunks):
            begin, count, source = chunks[len(values)]
            args = (model, kind, source, count) + ((stream_skip,) if stream_skip and not values else ())
            values.append((begin, count, coordinator.schedule(run_steps, args=args)))
            if len(values) - 1 in barriers or len(args) > 4:
                return

    logs = None
    try:
        schedule_through_next_barrier()
        for position in range(len(chunks)):
            begin, count, value = values[position]
            if call_begin:
                on_begin(begin)
            states, spec = value.get()
            merger.add(states, spec)
            last = position == len(chunks) - 1
            if position in barriers:
                # Every closure up to here returned (in order) and none after it
                # was scheduled: the servers hold exactly these steps.
                coordinator.join()
            logs = _results(model) if read_logs or last or position in barriers else None
            if call_end:
                on_end(begin + count - 1, logs)
            if model.stop_training:
                logs = _results(model)
                break
            if position == len(values) - 1:
                schedule_through_next_barrier()
        coordinator.join()
    except Exception as error:
        # The coordinator recorded the first fatal error (a closure that was
        # cancelled because of it raises CancelledError here): raise that root
        # cause, once, and leave the coordinator usable.
        try:
            coordinator.join()
        except Exception as root:
            if root is not error:
                raise root from None
        raise
    return logs or {}


def fit(model, strategy, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_data=None, shuffle=True, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1, **kwargs):
    """`model.fit` on the chief of a coordinator cluster (see the module docstring)."""
    unsupported = sorted(key for key in kwargs if key in _UNSUPPORTED_FIT and kwargs[key] is not None)
    unknown = sorted(key for key in kwargs if key not in _UNSUPPORTED_FIT)
    if unsupported:
        raise UnsupportedError(
            f"fit under ParameterServerStrategy with a coordinator does not support {unsupported}. "
            "Pass validation_data, and weight classes inside dataset_fn."
        )
    if unknown:
        raise InvalidArgumentError(f"fit got unexpected arguments {unknown}.")
    coordinator = coordinator_for(strategy)
    source = EpochSource(coordinator, x, y, batch_size, steps_per_epoch, shuffle, "fit", "steps_per_epoch")
    verbose = resolve_verbose(verbose)
    pack = _pack(model)
    if not isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = keras.callbacks.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose, epochs=epochs,
            steps=source.steps, model=model)
        if verbose != 0:
            # After Keras' ProgbarLogger, so the line follows the epoch's progress line.
            callbacks.callbacks.append(CoordinatorStatusLogger(coordinator))
    model.stop_training = False
    # Before BackupAndRestore restores: the dead chief's closures have ended.
    chief_resume.before_restore(coordinator, source)
    callbacks.on_train_begin()
    training_logs = {}
    first_epoch = _compat.take_initial_epoch(model, initial_epoch)
    for epoch in range(first_epoch, epochs):
        model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        chunks = source.epoch_sources(pack)  # after on_epoch_begin: a resume set the shuffle's random state
        skip = step_resume.take_skip()
        chunks, stream_skip = chief_resume.resume_epoch(
            chunks, skip, chief_resume.stream_batches_before(coordinator, source, epoch, first_epoch, initial_epoch),
            source.iterator is not None)
        logs = _run_pass(model, coordinator, "train", chunks, callbacks, skip, stream_skip)
        source.on_epoch_end()
        epoch_logs = dict(logs)
        if validation_data is not None and _should_evaluate(epoch, validation_freq):
            val_x, val_y = split_validation(validation_data)
            val_logs = evaluate(model, strategy, val_x, val_y, batch_size=validation_batch_size or batch_size,
                                verbose=0, steps=validation_steps, callbacks=callbacks, return_dict=True)
            epoch_logs.update({f"val_{name}": value for name, value in val_logs.items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        training_logs = epoch_logs
        if model.stop_training:
            break
    callbacks.on_train_end(logs=training_logs)
    return model.history


def evaluate(model, strategy, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None, steps=None,
             callbacks=None, return_dict=False, **kwargs):
    """`model.evaluate` on the chief of a coordinator cluster: closures of test steps on the workers."""
    if sample_weight is not None:
        raise UnsupportedError("evaluate with a coordinator does not support sample_weight; yield it from dataset_fn.")
    kwargs.pop("_use_cached_eval_dataset", None)
    if kwargs:
        raise InvalidArgumentError(f"evaluate got unexpected arguments {sorted(kwargs)}.")
    coordinator = coordinator_for(strategy)
    source = EpochSource(coordinator, x, y, batch_size, steps, False, "evaluate", "steps")
    verbose = resolve_verbose(verbose)
    if not isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = keras.callbacks.CallbackList(
            callbacks, add_history=False, add_progbar=verbose != 0, verbose=verbose, epochs=1,
            steps=source.steps, model=model)
    model.reset_metrics()
    callbacks.on_test_begin()
    logs = _run_pass(model, coordinator, "test", source.epoch_sources(_pack(model)), callbacks)
    callbacks.on_test_end(logs)
    if return_dict:
        return logs
    return _compat.flatten_metrics_in_order(model, logs)


def _should_evaluate(epoch, validation_freq):
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq
