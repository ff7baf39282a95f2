"""A `fit` that `BackupAndRestore` resumes from a mid-epoch backup starts at the step the backup names.

Keras (3.15, 3.16) restores only the epoch from a backup taken every
`save_freq` steps, so the steps of that epoch already in the backup are
trained again, with metrics counted from zero. For models of the synchronous
strategies (one device, `MirroredStrategy`, `MultiWorkerMirroredStrategy`)
each backup also holds, under the metadata key `kdist_step`:

- `steps`: the steps of the epoch the weights contain (0: the epoch begins);
- `iterations`: the optimizer's counter, checked against the restored weights
  (a backup whose two files disagree is refused, never half-used);
- `metrics`, `seeds`: every compiled metric's variables and every
  `SeedGenerator`'s state (neither is in Keras' weights file);
- `random_state`: Python's, NumPy's and torch's global random state at the
  save, and `epoch_random_state` at the epoch's start (what drew its shuffle);
- `logs`: the last step's logs, for an epoch whose steps were all saved.

On resume, every rank restores these, reads the resumed epoch's first `steps`
batches from the same shuffled input and drops them (nothing trains on them,
no callback sees them), restores the random state of the save, and Keras runs
the epoch on from step `steps` with its own step numbers. The backup is
written by the chief, atomically (`kdist.keras.atomic_save.write_backup`).
A remote `backup_dir` keeps Keras' behaviour, and so does input with
`steps_per_epoch` smaller than one pass (Keras continues such input across
epochs; a new process cannot).

A coordinator `fit` (`ParameterServerStrategy` on the chief) builds no Keras
epoch iterator: `kdist.keras.parameter_server.chief_fit` takes the resumed
epoch's skip itself (`take_skip`), drops the saved steps from its closures and
restores the metrics once the chief's metrics are built (`_Skip.restore_metrics`).
Where its input cannot be resumed mid-epoch (per-worker streams of several
workers), it calls `resume_from_epoch_start(reason)` before the restore: the
epoch then starts again from its first step, and the resume line says why.
"""

import base64
import contextlib
import inspect
import json
import os
import sys
import threading
import warnings

import keras
import numpy as np

from kdist import atomic_files, faults
from kdist.errors import InvalidArgumentError, KdistError
from kdist.keras import _compat, adapters, atomic_save
from kdist.keras._compat import callbacks as compat_callbacks
from kdist.keras.replica import adapter as replica_adapter
from kdist.keras.replica.multi_worker import STEP_STATE_KEY as STATE_KEY  # the metadata key (see above)
from kdist.keras.replica.multi_worker import random_state, set_random_state

_local = threading.local()


@contextlib.contextmanager
def fit_call(model, strategy, method, args, kwargs):
    """While `model.fit(*args, **kwargs)` runs, its `BackupAndRestore` callbacks resume at their step.

    Args:
        model: a model a kdist strategy owns.
        strategy: its strategy.
        method: `keras.Model.fit` (the class's).
        args, kwargs: the call's arguments.
    """
    resumes = []
    if isinstance(adapters.adapter_for(strategy), replica_adapter.ReplicaAdapter):
        for callback in _backup_callbacks(method, model, args, kwargs):
            resumes.append(_resume_of(callback, strategy))
    previous = getattr(_local, "fit", None)
    _local.fit = _Fit(resumes)
    try:
        yield
    finally:
        _local.fit = previous


def take_skip():
    """The running `fit`'s armed skip of its resumed epoch (`_Skip`), or None; for a coordinator `fit`.

    Called at each epoch's start, after `on_epoch_begin`: a skip is armed
    there, for the epoch a mid-epoch backup named.
    """
    fit = getattr(_local, "fit", None)
    return None if fit is None else fit.take_skip()


def resume_from_epoch_start(reason):
    """Makes the running `fit` resume a mid-epoch backup at its epoch's first step (before `on_train_begin`).

    Args:
        reason: why the steps cannot be skipped, for the resume line.
    """
    fit = getattr(_local, "fit", None)
    if fit is not None:
        fit.epoch_start_reason = reason


def watch(epoch_iterator):
    """Called whenever an epoch iterator starts: the running fit's first one (its training data) may skip steps."""
    fit = getattr(_local, "fit", None)
    if fit is None or fit.watched or not fit.resumes:
        return
    fit.watched = True
    compat_callbacks.skip_epoch_steps(epoch_iterator, fit.take_skip)


class _Fit:
    def __init__(self, resumes):
        self.resumes = resumes
        self.watched = False
        self.epoch_start_reason = None

    def take_skip(self):
        for resume in self.resumes:
            skip, resume.armed = resume.armed, None
            if skip is not None:
                return skip
        return None


def _backup_callbacks(method, model, args, kwargs):
    try:
        bound = inspect.signature(method).bind_partial(model, *args, **kwargs)
    except TypeError:
        return []  # Keras reports the bad call itself
    callbacks = bound.arguments.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    elif isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]
    return [
        callback for callback in callbacks or ()
        if isinstance(callback, keras.callbacks.BackupAndRestore)
        and not atomic_files.is_remote(str(callback.backup_dir))
    ]


def _resume_of(callback, strategy):
    resume = getattr(callback, "_kdist_step_resume", None)
    if resume is None:
        resume = _BackupResume(callback, strategy)
        object.__setattr__(callback, "_kdist_step_resume", resume)
    resume.start()
    return resume


class _BackupResume:
    """The resume state of one `BackupAndRestore`: what its saves record, what its restore left to do.

    Installed once per callback (its methods are wrapped on the instance);
    `start()` at each `fit`. Used by the thread that runs the `fit`.
    """

    def __init__(self, callback, strategy):
        self.callback = callback
        self.strategy = strategy
        collectives = strategy.extended.collectives
        self.is_chief = collectives is None or strategy.extended.is_chief
        # A coordinator's metrics are built by its first closure's results (chief_fit).
        self.drives_workers = bool(getattr(strategy.extended, "drives_workers", False))
        if collectives is None:
            # One process: Keras' own save writes only epoch and batch, not atomically.
            compat_callbacks.patch_backup_save(callback, self._save_one_process)
        compat_callbacks.set_backup_metadata_provider(callback, self.metadata)
        # Keras restores first; kdist counts a step before Keras may save it.
        object.__setattr__(callback, "on_train_begin", _chained(callback.on_train_begin, self.on_train_begin))
        for name in ("on_epoch_begin", "on_train_batch_end", "on_epoch_end"):
            object.__setattr__(callback, name, _chained(getattr(self, name), getattr(callback, name)))

    def start(self):
        self.steps_done = 0
        self.epoch_random_state = None
        self.last_logs = None
        self.pending = None  # (epoch, state) of a mid-epoch resume not begun yet
        self.armed = None  # the _Skip the resumed epoch's iterator takes

    def _save_one_process(self):
        model = self.callback.model
        save_weights = lambda path: atomic_files.write_via(  # noqa: E731
            path, lambda temporary: type(model).save_weights(model, temporary, overwrite=True))
        atomic_save.write_backup(self.callback, save_weights)

    # ----- saving -----
    def metadata(self):
        """What a save adds to Keras' metadata (see the module docstring)."""
        model = self.callback.model
        mid_epoch = self.steps_done > 0
        return {STATE_KEY: {
            "steps": self.steps_done,
            "iterations": _iterations(model),
            "metrics": [_encode(v) for v in model.metrics_variables],
            "seeds": [_encode(v) for v in _compat.seed_generator_states(model)],
            "random_state": random_state(),
            "epoch_random_state": self.epoch_random_state if mid_epoch else None,
            "logs": _plain_logs(self.last_logs) if mid_epoch else None,
        }}

    def on_epoch_begin(self, epoch, logs=None):
        # Keras has reset the metrics; Keras' own callbacks and SharedRandomState ran before.
        self.steps_done = 0
        if self.pending is not None and self.pending[0] == epoch:
            _, state = self.pending
            self.pending = None
            set_random_state(state["epoch_random_state"])
            if not self.drives_workers:
                _assign(self.callback.model.metrics_variables, state["metrics"], "metric")
            self.armed = _Skip(self, state)
        self.epoch_random_state = random_state()

    def on_train_batch_end(self, batch, logs=None):
        self.steps_done = batch + 1
        self.last_logs = logs

    def on_epoch_end(self, epoch, logs=None):
        self.steps_done = 0  # a save at the end of epoch E is labelled epoch E + 1

    # ----- restoring -----
    def on_train_begin(self, logs=None):
        callback = self.callback
        path = compat_callbacks.backup_paths(callback).metadata
        if not os.path.exists(path):
            return  # no backup: a fresh start
        with open(path) as reader:
            metadata = json.load(reader)
        epoch, batch, state = metadata["epoch"], metadata.get("batch", 0), metadata.get(STATE_KEY)
        if state is None:
            if batch:
                warnings.warn(
                    f"The backup in {callback.backup_dir} was written without kdist's step state "
                    f"(by plain Keras or an older kdist): epoch {epoch} starts again from its first step, "
                    "as Keras resumes.", stacklevel=2)
            self._announce(epoch, 0)
            return
        model = callback.model
        # A progress-only backup (a parameter-server worker other than the chief:
        # `kdist.keras.chief_only.own_backup`) has no weights to disagree with.
        has_weights = os.path.exists(compat_callbacks.backup_paths(callback).weights)
        if state["iterations"] is not None and has_weights and _iterations(model) != state["iterations"]:
            raise KdistError(
                f"The backup in {callback.backup_dir} is inconsistent: its weights file holds an optimizer "
                f"at iteration {_iterations(model)} but its metadata names iteration {state['iterations']} "
                f"(epoch {epoch}, step {state['steps']}). Received: a weights file and a metadata file "
                "from different saves. Expected: both from one save. Fix: restore both files from one "
                "save (double_checkpoint=True keeps the previous pair as *.bkp), or delete the backup.")
        _assign(_compat.seed_generator_states(model), state["seeds"], "seed generator")
        if faults.ACTIVE.resume_without_iterations:
            model.optimizer.iterations.assign(0)
        steps = 0 if faults.ACTIVE.unskipped_resume_steps else state["steps"]
        fit = getattr(_local, "fit", None)
        reason = getattr(fit, "epoch_start_reason", None) if steps else None
        if reason is not None:
            steps = 0
        compat_callbacks.set_backup_position(callback, epoch, batch if steps else 0)
        if steps:
            self.pending = (epoch, state)
        elif reason is not None and state["epoch_random_state"] is not None:
            set_random_state(state["epoch_random_state"])  # the epoch draws its shuffle again
        else:
            set_random_state(state["random_state"])
        note = "" if reason is None else f" (the backup holds step {state['steps']}, but {reason})"
        self._announce(epoch, steps, note)

    def _announce(self, epoch, steps, note=""):
        if self.is_chief:
            print(f"[kdist] resumed from backup {self.callback.backup_dir}: epoch {epoch}, step {steps}{note}",
                  file=sys.stderr, flush=True)


class _Skip:
    """The resumed epoch's skip, handed to `compat_callbacks.skip_epoch_steps`."""

    def __init__(self, resume, state):
        self.resume = resume
        self.state = state
        self.steps = state["steps"]
        self.callback = resume.callback
        self.logs = state["logs"]

    def finished(self, keras_epoch=True):
        """The saved steps were read and dropped: the run continues where the backup was taken.

        Args:
            keras_epoch: Keras' fit runs the epoch (False: a coordinator `fit`,
                which logs an epoch without steps with `self.logs` itself).
        """
        state, resume = self.state, self.resume
        set_random_state(state["random_state"])
        resume.steps_done = self.steps
        if state["logs"] is not None and keras_epoch:
            compat_callbacks.replace_empty_epoch_logs_once(resume.callback.model, state["logs"])

    def restore_metrics(self, variables):
        """Assigns the saved metric state to `variables` (a coordinator's, once its metrics are built)."""
        _assign(variables, self.state["metrics"], "metric")

    def input_ended(self, batches_read):
        raise InvalidArgumentError(
            f"The backup in {self.resume.callback.backup_dir} was taken after {self.steps} steps of the "
            f"epoch, but the input of the resumed fit ended after {batches_read} batches. Received: other "
            "input than the interrupted fit's. Expected: the same input and batch size. Fix: resume with "
            "the arguments of the interrupted fit, or delete the backup to start again.")


def _chained(first, then):
    def chained(*args, **kwargs):
        first(*args, **kwargs)
        return then(*args, **kwargs)

    return chained


def _iterations(model):
    optimizer = getattr(model, "optimizer", None)
    return None if optimizer is None else int(keras.ops.convert_to_numpy(optimizer.iterations))


def _plain_logs(logs):
    plain = {}
    for key, value in (logs or {}).items():
        array = np.asarray(keras.ops.convert_to_numpy(value))
        if array.size == 1:
            plain[key] = float(array.reshape(()))
    return plain


def _encode(variable):
    array = np.array(keras.ops.convert_to_numpy(variable), order="C")  # ascontiguousarray makes 0-d 1-d
    return {"dtype": array.dtype.str, "shape": list(array.shape),
            "data": base64.b64encode(array.tobytes()).decode("ascii")}


def _assign(variables, encoded, kind):
    variables = list(variables)
    if len(variables) != len(encoded):
        raise InvalidArgumentError(
            f"The backup holds {len(encoded)} {kind} variables but the model has {len(variables)}. "
            "Received: a model that differs from the one that was backed up. Expected: the same model, "
            "compiled with the same metrics. Fix: rebuild the model as before, or delete the backup.")
    for variable, saved in zip(variables, encoded):
        array = np.frombuffer(base64.b64decode(saved["data"]), dtype=np.dtype(saved["dtype"]))
        variable.assign(array.reshape(saved["shape"]))
