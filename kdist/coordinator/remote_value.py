"""`RemoteValue`: the future a `ClusterCoordinator.schedule` call returns."""

import enum
import threading

import numpy as np
import torch


class RemoteValueStatus(enum.Enum):
    """Where a scheduled closure's result stands.

    - `PENDING`: queued or running; not ready yet.
    - `ABORTED`: the worker running it was lost; it is back in the queue and
      will run on another worker (the value is still to come).
    - `READY`: the closure returned; `fetch()` gives the value.
    - `FAILED`: the closure raised, or the cluster failed (a parameter server
      is unreachable); `fetch()` raises that error.
    - `CANCELLED`: it never ran because an earlier closure failed;
      `fetch()` raises `kdist.errors.CancelledError`.
    """

    PENDING = "pending"
    ABORTED = "aborted"
    READY = "ready"
    FAILED = "failed"
    CANCELLED = "cancelled"


_FINAL = (RemoteValueStatus.READY, RemoteValueStatus.FAILED, RemoteValueStatus.CANCELLED)


class RemoteValue:
    """The result of a scheduled function, available once a worker has run it.

    `fetch()` blocks until the closure finished and returns its value with
    every tensor as a numpy array (TensorFlow's `RemoteValue.fetch`);
    `get()` returns it as the function returned it (torch tensors stay
    tensors). Both raise the closure's error if it failed.
    """

    def __init__(self):
        self._condition = threading.Condition()
        self._status = RemoteValueStatus.PENDING
        self._value = None
        self._error = None

    @property
    def status(self):
        """The `RemoteValueStatus` now."""
        return self._status

    def done(self):
        """True once the value or the error is there (does not block)."""
        return self._status in _FINAL

    def _wait(self, timeout):
        with self._condition:
            if not self._condition.wait_for(self.done, timeout):
                raise TimeoutError(f"The scheduled function did not finish within {timeout} seconds.")
        if self._error is not None:
            raise self._error

    def get(self, timeout=None):
        """The function's return value, as returned (blocks; raises its error)."""
        self._wait(timeout)
        return self._value

    def fetch(self, timeout=None):
        """The function's return value with tensors as numpy arrays (blocks; raises its error)."""
        return to_numpy(self.get(timeout))

    def _set(self, status, value=None, error=None):
        with self._condition:
            if self._status in _FINAL:
                return
            self._status, self._value, self._error = status, value, error
            self._condition.notify_all()

    def _set_aborted(self):
        with self._condition:
            if not self.done():
                self._status = RemoteValueStatus.ABORTED

    def __repr__(self):
        return f"<RemoteValue status={self._status.value}>"


def to_numpy(value):
    """`value` with every torch tensor (and Keras variable) in nested lists/tuples/dicts as numpy."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return type(value)((key, to_numpy(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        items = [to_numpy(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        return value.numpy()
    return value
