"""Keras saves routed through `kdist.atomic_files`: a failed save leaves the previous file loadable.

- `save`: `model.save`/`save_weights` (given as the class's method) written to
  a temporary file beside the target, fsynced and renamed into place.
  Written directly, as Keras would, where one rename cannot cover the result:
  remote paths, `zipped=False` (a directory) and `max_shard_size` (several
  files); and when `overwrite=False` meets an existing file, so Keras can ask.
- `write_backup`: what `BackupAndRestore` saves (`_compat.patch_backup_save`), each file atomic:
  the `.bkp` copies (`double_checkpoint`), the weights, then the metadata.
- `make_backups_atomic`: installs `write_backup` on the `BackupAndRestore`
  callbacks of a `fit` call (used under `ParameterServerStrategy`; the
  multi-worker strategy makes them collective in `kdist.keras.replica.multi_worker`).
"""

import inspect
import json
import os

import keras

from kdist import atomic_files
from kdist.keras import _compat


def save(method, model, args, kwargs):
    """Calls `method(model, *args, **kwargs)` (a Keras save function) so that the file is replaced atomically.

    Args:
        method: `keras.Model.save` or `keras.Model.save_weights` (unbound).
        model: the model to save.
        args, kwargs: the user's arguments, the file path first.

    Returns:
        What `method` returned.
    """
    try:
        bound = inspect.signature(method).bind(model, *args, **kwargs)
    except TypeError:
        return method(model, *args, **kwargs)  # Keras reports the bad call itself
    arguments = bound.arguments
    filepath, overwrite = arguments["filepath"], arguments.get("overwrite", True)
    direct = (
        atomic_files.is_remote(filepath)
        or arguments.get("zipped") is False
        or arguments.get("max_shard_size") is not None
        or (not overwrite and os.path.exists(os.fspath(filepath)))  # Keras asks the user
    )
    if direct:
        return method(*bound.args, **bound.kwargs)

    def write_to(temporary):
        arguments["filepath"], arguments["overwrite"] = temporary, True
        return method(*bound.args, **bound.kwargs)

    return atomic_files.write_via(filepath, write_to)


def write_backup(callback, save_weights, extra_metadata=None):
    """Writes what Keras' `BackupAndRestore` writes at each save, each file atomically and durably.

    Args:
        callback: a `keras.callbacks.BackupAndRestore` with a local `backup_dir`.
        save_weights: a function of the weights file's path that writes the
            model's weights there atomically.
        extra_metadata: a dict added to the epoch and batch in the metadata file.
    """
    paths = _compat.backup_paths(callback)
    os.makedirs(paths.backup_dir, exist_ok=True)
    if callback.double_checkpoint:
        for current, previous in ((paths.weights, paths.previous_weights), (paths.metadata, paths.previous_metadata)):
            if os.path.exists(current):
                atomic_files.copy_file(current, previous)
    save_weights(paths.weights)
    metadata = {**_compat.backup_metadata(callback), **(extra_metadata or {})}
    atomic_files.write_text(paths.metadata, json.dumps(metadata))


def make_backups_atomic(callbacks):
    """Makes each `BackupAndRestore` among a `fit` call's `callbacks` save through `write_backup`.

    `callbacks`: what the call passes (a list, one callback, a
    `keras.callbacks.CallbackList`, or None). `model.save_weights` (the
    instance's: atomic under kdist's strategies) writes the weights. A remote
    `backup_dir` keeps Keras' own writes, and a backup that
    `kdist.keras.chief_only.own_backup` already moved keeps its own save.
    Idempotent.
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    elif isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]
    elif not isinstance(callbacks, (list, tuple)):
        return  # None, or not callbacks: Keras reports the bad call itself
    for callback in callbacks:
        if (isinstance(callback, keras.callbacks.BackupAndRestore) and not getattr(callback, "_kdist_atomic", False)
                and getattr(callback, "_kdist_own_backup", None) is None
                and not atomic_files.is_remote(str(callback.backup_dir))):
            _compat.patch_backup_save(callback, _atomic_save_model(callback))
            object.__setattr__(callback, "_kdist_atomic", True)


def _atomic_save_model(callback):
    def _save_model():
        write_backup(callback, lambda path: callback.model.save_weights(path, overwrite=True))

    return _save_model
