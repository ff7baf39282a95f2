"""Keras callback internals: where `BackupAndRestore` keeps its files and how it saves."""

import collections

import keras

PINNED = {
    "BackupAndRestore._weights_path": lambda: _probe_backup()._weights_path,
    "BackupAndRestore._training_metadata_path": lambda: _probe_backup()._training_metadata_path,
    "BackupAndRestore._prev_weights_path": lambda: _probe_backup()._prev_weights_path,
    "BackupAndRestore._prev_training_metadata_path": lambda: _probe_backup()._prev_training_metadata_path,
    "BackupAndRestore._current_epoch": lambda: _probe_backup()._current_epoch,
    "BackupAndRestore._last_batch_seen": lambda: _probe_backup()._last_batch_seen,
    "BackupAndRestore._save_model": lambda: _probe_backup()._save_model,
}


def _probe_backup():
    import tempfile

    return keras.callbacks.BackupAndRestore(tempfile.gettempdir() + "/kdist-probe")


# ----- BackupAndRestore -------------------------------------------------------------
BackupPaths = collections.namedtuple(
    "BackupPaths", "backup_dir weights metadata previous_weights previous_metadata"
)


def backup_paths(callback):
    """Where a `BackupAndRestore` keeps its files."""
    return BackupPaths(
        callback.backup_dir,
        callback._weights_path,
        callback._training_metadata_path,
        callback._prev_weights_path,
        callback._prev_training_metadata_path,
    )


def backup_metadata(callback):
    """The JSON document Keras' `BackupAndRestore` writes beside the weights."""
    return {"epoch": callback._current_epoch, "batch": callback._last_batch_seen}


def patch_backup_save(callback, save_model):
    """Makes `callback` (a `BackupAndRestore`) call `save_model()` wherever Keras would save its backup.

    Installed on this instance only; Keras calls it at the end of each epoch
    (or every `save_freq` batches) and kdist's replacements write the same
    files as Keras' `_save_model` (`kdist.keras.atomic_save.write_backup`).
    """
    object.__setattr__(callback, "_save_model", save_model)
