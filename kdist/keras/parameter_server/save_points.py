"""The steps at which a coordinator `fit`'s saving callbacks will save, known before the closures are sent.

A coordinator `fit` keeps many closures in flight; a save taken while some
of them are applying would hold steps its label does not name (a backup
labelled step 12 holding 16 steps). `chief_fit` therefore schedules closures
ahead only up to the next save point and drains them before the callback's
hook runs. This module predicts those points for Keras' own saving
callbacks, `keras.callbacks.BackupAndRestore` and `keras.callbacks.ModelCheckpoint`
with `save_freq` in steps, by running their own rule (Keras 3.15 and 3.16,
`_should_save_on_batch`) on a shadow counter kept on the callback:

- each batch hook adds the steps since the last hook (a new epoch: the
  batch index plus one) to a count, and saves when the count reaches
  `save_freq`, then restarts it from zero;
- `BackupAndRestore` starts its last batch at 0 and sets it back to 0 at
  each epoch's end; `ModelCheckpoint` starts it unknown and keeps it.

The shadow advances once per epoch's pass. It matches the callback as long
as the callback runs only in coordinator `fit` calls (the usual case).
`save_freq="epoch"` needs no point: the pass is drained before
`on_epoch_end`. A user's own callback that saves from a batch hook is not
predicted: it sees closures in flight (see docs/parameter_server.md).
"""

import keras

_SHADOW = "_kdist_save_shadow"


class _Shadow:
    def __init__(self, last_batch, resets_at_epoch_end):
        self.since = 0
        self.last = last_batch
        self.initial_last = last_batch
        self.resets_at_epoch_end = resets_at_epoch_end
        self.passes = 0
        self.resumed = False  # the next pass continues a resumed epoch: no reset

    def points(self, ends, save_freq):
        if self.resets_at_epoch_end and self.passes and not self.resumed:
            self.last = self.initial_last
        self.resumed = False
        self.passes += 1
        points = []
        for position, batch in enumerate(ends):
            if self.last is None or batch <= self.last:
                added = batch + 1  # a new epoch: batches are numbered from 0
            else:
                added = batch - self.last
            self.since += added
            self.last = batch
            if self.since >= save_freq:
                self.since = 0
                points.append(position)
        return points


def _shadow_of(callback):
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        last, resets = 0, True
    elif isinstance(callback, keras.callbacks.ModelCheckpoint):
        last, resets = None, False
    else:
        return None
    if not isinstance(getattr(callback, "save_freq", "epoch"), int):
        return None
    shadow = callback.__dict__.get(_SHADOW)
    if shadow is None:
        shadow = _Shadow(last, resets)
        object.__setattr__(callback, _SHADOW, shadow)
    return shadow


def barriers(callbacks, chunks):
    """Positions of the closures after which a saving callback saves, for one training epoch.

    Args:
        callbacks: the fit's `keras.callbacks.CallbackList`.
        chunks: the epoch's closures, `(first step, steps, source)` each.

    Returns:
        A set of closure positions (0 for the first closure of the epoch).
    """
    ends = [begin + count - 1 for begin, count, _ in chunks]
    points = set()
    for callback in callbacks.callbacks:
        shadow = _shadow_of(callback)
        if shadow is not None:
            points.update(shadow.points(ends, callback.save_freq))
    return points


def resume_at(callback, batch):
    """Starts `callback`'s shadow where a `fit` resumed from its mid-epoch backup starts it.

    `kdist.keras.step_resume` sets the callback's last batch to the backup's
    (`batch`, the last step the backup holds) and its count since the last
    save to 0; its next pass is the resumed epoch's rest.
    """
    shadow = _shadow_of(callback)
    if shadow is not None:
        shadow.last = batch
        shadow.since = 0
        shadow.resumed = True
