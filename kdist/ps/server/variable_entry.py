"""One variable of a parameter server: its Keras variable, version, counters and lock."""

import threading

import keras

from kdist.ps.server import memory
from kdist.rpc import dtypes


def make_variable(name, array, trainable):
    """Returns a CPU `keras.Variable` holding `array` (shares its memory: NumPy advises large arrays for huge pages)."""
    # Keras variable names may not contain "/"; the store keys by the real name.
    keras_name = name.replace("/", "_").replace(":", "_")
    with keras.device("cpu"):
        return keras.Variable(dtypes.to_torch(array), dtype=array.dtype.name,
                              trainable=trainable, name=keras_name)


class _Storage:
    """Marks one memory block of a variable; counts the streams still reading it."""

    __slots__ = ("readers",)

    def __init__(self):
        self.readers = 0


class VariableEntry:
    """One variable and its bookkeeping. Read or change it only under `lock`.

    Values are streamed to pulls without a snapshot copy (copy-on-write): a
    pull `share`s the current memory and streams it after the lock is released;
    a write (`before_update`, `replace_value`) that finds readers on the
    memory moves the variable to new memory first, so those readers still see
    the value they were promised.
    """

    def __init__(self, name, variable, trainable, version=0):
        self.name = name
        self.variable = variable
        self.trainable = trainable
        self.version = version
        self.applied_updates = 0
        self.rejected_updates = 0
        self.sparse_applies = 0  # row gradients applied to the touched rows only
        self.dense_applies = 0  # gradients applied as Keras' dense update
        self.rows_updated = 0  # distinct rows of all row gradients applied
        self.optimizer = None  # VariableOptimizer once configured
        self.lock = threading.Lock()
        self.array = dtypes.to_numpy(variable.value)  # a view of the variable, not a copy
        self.dtype = self.array.dtype
        self.shape = tuple(self.array.shape)
        self._storage = _Storage()

    def describe(self, what):
        return f"{what} {self.name!r} (shape {self.shape}, dtype {self.dtype.name})"

    def share(self):
        """Under `lock`: returns `(token, array)`; `array` stays unchanged until `release(token)`."""
        self._storage.readers += 1
        return self._storage, self.array

    def release(self, token):
        """Ends a `share` (takes `lock`)."""
        with self.lock:
            token.readers -= 1

    def before_update(self):
        """Under `lock`, before changing the value in place: moves it off shared memory."""
        if self._storage.readers:
            self._adopt(memory.clone(self.variable.value.data))

    def apply_gradient(self, gradient, rows):
        """Under `lock`: applies `gradient` through the optimizer, bumps the version, counts it.

        Args:
            gradient: a NumPy array shaped like the variable, or with `rows`
                a row gradient `(ids, rows)` (ids checked in range).
            rows: whether `gradient` is a row gradient.
        """
        self.before_update()
        if rows:
            sparse, num_rows = self.optimizer.apply_rows(*gradient)
            self.rows_updated += num_rows
        else:
            sparse = False
            self.optimizer.apply(dtypes.to_torch(gradient))
        self.sparse_applies += sparse
        self.dense_applies += not sparse
        self.version += 1
        self.applied_updates += 1

    def replace_value(self, array):
        """Under `lock`: makes the (fresh, C-contiguous) `array` the variable's memory."""
        self._adopt(dtypes.to_torch(array))

    def _adopt(self, tensor):
        self.variable.value.data = tensor
        self.array = dtypes.to_numpy(self.variable.value)
        self._storage = _Storage()


class locked:
    """Context manager holding the locks of `entries` (deduplicated, in name order)."""

    def __init__(self, entries):
        unique = {id(entry): entry for entry in entries}
        self._entries = sorted(unique.values(), key=lambda entry: entry.name)

    def __enter__(self):
        for entry in self._entries:
            entry.lock.acquire()
        return self

    def __exit__(self, *exc_info):
        for entry in reversed(self._entries):
            entry.lock.release()
