"""A `fit` resumed by `BackupAndRestore` shuffles arrays and `PyDataset`s as the uninterrupted `fit` would have.

Keras 3.16 seeds the shuffle of array and `PyDataset` inputs with its data adapter's epoch
counter, which starts again in every `fit` call. A `fit` that
`BackupAndRestore` resumes at epoch 2 would then shuffle epoch 2 like epoch 0
and end with other weights than a run that was never interrupted. For models
kdist owns, the counter is moved on by the restored epoch. (Plain Keras 3.16
does not do this. An `initial_epoch` passed by hand keeps Keras' own shuffle,
as on one device. Keras up to 3.15 shuffles with the global random state,
which `kdist.keras.replica.multi_worker` shares across ranks.)
"""

import contextlib
import threading

from kdist.keras import _compat
from kdist.keras._compat import callbacks as compat_callbacks

_local = threading.local()


@contextlib.contextmanager
def fit_call(model):
    """While a kdist model's `fit` runs in this thread, its training iterator is aligned."""
    previous = getattr(_local, "fit", None)
    _local.fit = _Fit(model)
    try:
        yield
    finally:
        _local.fit = previous


class _Fit:
    def __init__(self, model):
        self.model = model
        # The first epoch iterator a fit makes is its training data's.
        self.iterator = None
        self.aligned = False


def align(epoch_iterator):
    """Called whenever an epoch iterator starts; moves a resumed `fit`'s shuffle counter on once.

    Keras builds the model from a first batch before `BackupAndRestore` has
    restored the starting epoch, so the restored epoch is added at the first
    start after it is known.
    """
    fit = getattr(_local, "fit", None)
    if fit is None or fit.aligned:
        return
    if fit.iterator is None:
        fit.iterator = epoch_iterator
    restored_epoch = _compat.take_initial_epoch(fit.model, 0)
    if epoch_iterator is fit.iterator and restored_epoch:
        _compat.advance_shuffle_epoch(epoch_iterator, restored_epoch)
        compat_callbacks.advance_py_dataset_epoch(epoch_iterator, restored_epoch)
        fit.aligned = True
