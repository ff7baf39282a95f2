"""Keras callback internals: where `BackupAndRestore` keeps its files, how it saves, how a fit resumes mid-epoch."""

import collections

import keras
from keras.src.trainers import epoch_iterator as _epoch_iterator_module
from keras.src.trainers.data_adapters import py_dataset_adapter as _py_dataset_adapter_module

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


def set_backup_dir(callback, backup_dir):
    """Points a `BackupAndRestore` at `backup_dir`: every file path, as Keras' constructor derives them."""
    fresh = keras.callbacks.BackupAndRestore(backup_dir)
    callback.backup_dir = fresh.backup_dir
    callback._weights_path = fresh._weights_path
    callback._training_metadata_path = fresh._training_metadata_path
    callback._prev_weights_path = fresh._prev_weights_path
    callback._prev_training_metadata_path = fresh._prev_training_metadata_path


def backup_metadata(callback):
    """The JSON document Keras' `BackupAndRestore` writes beside the weights."""
    metadata = {"epoch": callback._current_epoch, "batch": callback._last_batch_seen}
    provider = getattr(callback, "_kdist_metadata_provider", None)
    if provider is not None:
        metadata.update(provider())
    return metadata


def patch_backup_save(callback, save_model):
    """Makes `callback` (a `BackupAndRestore`) call `save_model()` wherever Keras would save its backup.

    Installed on this instance only; Keras calls it at the end of each epoch
    (or every `save_freq` batches) and kdist's replacements write the same
    files as Keras' `_save_model` (`kdist.keras.atomic_save.write_backup`).
    """
    object.__setattr__(callback, "_save_model", save_model)


def set_backup_metadata_provider(callback, provider):
    """Makes `backup_metadata(callback)` add the dict `provider()` returns at each save (kdist's resume state)."""
    object.__setattr__(callback, "_kdist_metadata_provider", provider)


def set_backup_position(callback, epoch, batch):
    """Tells a `BackupAndRestore` that training resumes after `batch` of `epoch` (what its backup named).

    Keras restores only the model's starting epoch: a fresh callback would
    label the resumed epoch's saves epoch 0 and count the batches since its
    last save from 0, so it would save at other steps than the interrupted run.
    """
    callback._current_epoch = epoch
    callback._last_batch_seen = batch
    callback._batches_seen_since_last_saving = 0


# ----- resuming a fit mid-epoch (kdist.keras.step_resume) ----------------------------
PINNED.update({
    "BackupAndRestore._batches_seen_since_last_saving": lambda: _probe_backup()._batches_seen_since_last_saving,
    "EpochIterator._enumerate_iterator": lambda: _epoch_iterator_module.EpochIterator._enumerate_iterator,
    "Trainer._get_metrics_result_or_logs": lambda: keras.Model._get_metrics_result_or_logs,
    "PyDatasetAdapter": lambda: _py_dataset_adapter_module.PyDatasetAdapter,
})


def advance_py_dataset_epoch(epoch_iterator, epochs):
    """Moves a `PyDataset` adapter's shuffle seed on by `epochs` (Keras >= 3.16 seeds it by its epoch count).

    The array adapter's twin is `kdist.keras._compat.advance_shuffle_epoch`.
    """
    adapter = epoch_iterator.data_adapter
    if isinstance(adapter, _py_dataset_adapter_module.PyDatasetAdapter) and hasattr(adapter, "_epoch"):
        adapter._epoch += epochs


def skip_epoch_steps(epoch_iterator, take_skip):
    """Lets an epoch of `epoch_iterator` leave out steps it is told to skip, numbering the rest as Keras would.

    At each epoch's first batch, `take_skip()` returns None (skip nothing) or
    a skip with `steps`, `finished()` and `input_ended(batches_read)`: the
    epoch's first `steps` steps are read from the input and dropped (never
    trained, no callback sees them), then `finished()` is called; Keras runs
    the epoch on from step `steps` with its own step numbers. Reading the
    skipped batches keeps every random draw of the input pipeline (shuffles,
    augmentation) where the interrupted run had it.
    """
    original = epoch_iterator._enumerate_iterator

    def enumerate_skipping():
        skip = take_skip()
        batches_read = 0
        for begin_step, end_step, iterator in original():
            if skip is None or begin_step >= skip.steps:
                yield begin_step, end_step, iterator
                continue
            for _ in range(end_step - begin_step + 1):
                try:
                    next(iterator)
                except StopIteration:
                    skip.input_ended(batches_read)
                    return
                batches_read += 1
            if end_step + 1 >= skip.steps:
                skip.finished()
        if skip is not None and batches_read < skip.steps:
            skip.input_ended(batches_read)

    object.__setattr__(epoch_iterator, "_enumerate_iterator", enumerate_skipping)


def replace_empty_epoch_logs_once(model, logs):
    """At its next epoch end, `model.fit` takes `logs` as its last step's logs if no step ran.

    A resumed epoch whose steps were all in the backup runs no step, so Keras
    would log the epoch with an empty dict instead of its metrics.
    """
    original = type(model)._get_metrics_result_or_logs

    def _get_metrics_result_or_logs(step_logs):
        object.__delattr__(model, "_get_metrics_result_or_logs")
        return original(model, step_logs or logs)

    object.__setattr__(model, "_get_metrics_result_or_logs", _get_metrics_result_or_logs)
