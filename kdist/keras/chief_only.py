"""Who writes logs, checkpoints and summaries: the one rule every Keras adapter applies.

A task asks its strategy (`strategy.extended.should_save_summary`,
`strategy.extended.should_checkpoint`; the chief answers True to both) and
runs the callbacks of `fit`/`evaluate`/`predict` as this table says:

| callback | where `should_*` is True | where it is False |
|---|---|---|
| progress bar (`verbose`, `ProgbarLogger`), `CSVLogger`, `TensorBoard` | runs | `verbose=0`, the callback is dropped |
| `ModelCheckpoint` | runs | saves are collectives: runs (every rank takes part, the chief writes); otherwise dropped |
| `BackupAndRestore` | runs | saves are collectives: takes part; otherwise keeps the task's own progress (no weights) in `<backup_dir>/<task>` (e.g. `worker-1`) |
| any other callback | runs | runs |

Who asks:

- `MultiWorkerMirroredStrategy` ranks (`kdist.keras.replica.multi_worker`):
  saves are collectives there (`collective_saves=True`);
- between-graph `ParameterServerStrategy` workers
  (`kdist.keras.parameter_server.adapter`): each worker trains alone, so a
  worker other than the chief (worker 0) keeps no checkpoint or summary
  writer, and its `BackupAndRestore` writes, restores and deletes its own
  backup only, in a subdirectory named after the task (its progress is its
  own; the chief's backup is never touched, nor restored by another worker);
- the coordinator of a `ParameterServerStrategy` (the chief): it is its own
  chief, so every callback runs there, as in TensorFlow, where `Model.fit`
  under `ParameterServerStrategy` runs its callbacks on the coordinator only.

The reference is TensorFlow's multi-worker rule: only the chief writes the
checkpoints and summaries a user reads; other workers write nothing there.
"""

import os
import re

import keras

from kdist.atomic_files import is_remote
from kdist.errors import InvalidArgumentError
from kdist.keras import _compat, atomic_save

# A task name as a backup subdirectory (`<backup_dir>/<task>`).
_TASK_NAME = re.compile(r"[A-Za-z0-9_.-]+")

SUMMARY_CALLBACKS = (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard, keras.callbacks.ProgbarLogger)
"""Callbacks that only write logs or summaries: they run where `should_save_summary` is True."""


def task_callbacks(arguments, strategy, collective_saves, has_verbose=True, task=None):
    """Applies the rule to the bound arguments of one `fit`/`evaluate`/`predict` call, in place.

    Args:
        arguments: the call's bound arguments (`inspect.BoundArguments.arguments`).
        strategy: the model's strategy.
        collective_saves: True where `model.save` is a collective of every
            task that the chief writes (multi-worker), so checkpoint callbacks
            run on every task; False where each task trains alone
            (parameter-server workers), so a task that should not checkpoint
            keeps no checkpoint writer.
        has_verbose: whether the called method takes `verbose`.
        task: the task's name, e.g. `"worker-1"`: where a task that trains
            alone and is not the chief keeps its own `BackupAndRestore`
            backup (`<backup_dir>/<task>`). Required unless `collective_saves`.

    Returns:
        The list of callbacks this task runs, also stored in
        `arguments["callbacks"]`; None when the call passes a
        `keras.callbacks.CallbackList` (what `fit` hands its own validation
        `evaluate`: already adjusted) or something that is not a callback
        (Keras reports it), left unchanged.
    """
    if not collective_saves and not _is_directory_name(task):
        raise InvalidArgumentError(
            "task_callbacks needs the task's name where each task trains alone (collective_saves=False): "
            f"its backups go to <backup_dir>/<task>, one directory. Received: task={task!r}. "
            "Expected a name of letters, digits, '_', '.' and '-', e.g. 'worker-1'."
        )
    extended = strategy.extended
    writes_summaries, writes_checkpoints = extended.should_save_summary, extended.should_checkpoint
    if not writes_summaries and has_verbose:
        arguments["verbose"] = 0
    callbacks = arguments.get("callbacks")
    if isinstance(callbacks, keras.callbacks.Callback) and not isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = [callbacks]
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        return None
    kept = []
    for callback in callbacks or ():
        if isinstance(callback, SUMMARY_CALLBACKS) and not writes_summaries:
            continue
        if not writes_checkpoints and not collective_saves:
            if isinstance(callback, keras.callbacks.ModelCheckpoint):
                continue
            if isinstance(callback, keras.callbacks.BackupAndRestore):
                own_backup(callback, task)
        kept.append(callback)
    arguments["callbacks"] = kept
    return kept


def _is_directory_name(task):
    """A name that is one directory under the backup directory: no separator, no `..`."""
    return (isinstance(task, str) and _TASK_NAME.fullmatch(task) is not None
            and task not in (".", ".."))


def own_backup(callback, task):
    """Moves a `BackupAndRestore` of a task that trains alone, and is not the chief, to `<backup_dir>/<task>`.

    There it keeps the task's progress (epoch and step; no weights) and
    resumes from it.

    The directory the user gave is the chief's: this task writing there would
    replace the chief's backup with its own progress (and delete it when its
    `fit` ends), and restoring from there would resume this task at the
    chief's epoch and send the chief's weights to the servers. In its own
    subdirectory it resumes from where it itself was. Idempotent.
    """
    if getattr(callback, "_kdist_own_backup", None) is not None:
        return
    directory = str(callback.backup_dir)
    remote = is_remote(directory)
    _compat.set_backup_dir(callback, directory.rstrip("/" + os.sep) + ("/" if remote else os.sep) + task)
    # Its progress only: the weights live on the servers, which every worker
    # trains; restoring a worker's copy of them would undo the others' steps.
    # (`model.save_weights` writes nothing on a worker other than the chief.)
    _compat.patch_backup_save(
        callback, (lambda: None) if remote else (lambda: atomic_save.write_backup(callback, lambda path: None)))
    object.__setattr__(callback, "_kdist_own_backup", task)
