"""The coordinator's closures and the queue dispatchers take them from."""

import collections
import threading
import uuid

from kdist.coordinator.remote_value import RemoteValue, RemoteValueStatus
from kdist.errors import CancelledError


class Closure:
    def __init__(self, function, args, kwargs):
        self.id = uuid.uuid4().hex
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.remote_value = RemoteValue()
        self.attempts = 0


class ClosureQueue:
    """Closures waiting for a worker, the number running, and the first fatal error."""

    def __init__(self):
        self._pending = collections.deque()
        self._inflight = 0
        self._error = None
        self._stopped = False
        self._condition = threading.Condition()

    def put(self, closure):
        with self._condition:
            self._pending.append(closure)
            self._condition.notify_all()

    def get(self):
        """The next closure for a dispatcher, or None when the coordinator stops."""
        with self._condition:
            self._condition.wait_for(lambda: self._pending or self._stopped)
            if self._stopped:
                return None
            self._inflight += 1
            return self._pending.popleft()

    def finished(self):
        with self._condition:
            self._inflight -= 1
            self._condition.notify_all()

    def put_back(self, closure):
        """A closure whose worker was lost: first in line again (cancelled after a fatal error)."""
        with self._condition:
            self._inflight -= 1
            if self._error is not None:
                closure.remote_value._set(RemoteValueStatus.CANCELLED, error=CancelledError(
                    "Cancelled: an earlier closure failed."))
            else:
                closure.remote_value._set_aborted()
                self._pending.appendleft(closure)
            self._condition.notify_all()

    def fail(self, error):
        """Records the first fatal error and cancels every queued closure."""
        with self._condition:
            if self._error is None:
                self._error = error
            while self._pending:
                self._pending.popleft().remote_value._set(RemoteValueStatus.CANCELLED, error=CancelledError(
                    f"Cancelled because an earlier closure failed: {type(error).__name__}: {error}"))
            self._condition.notify_all()

    def raise_error(self):
        """Raises (and clears) the recorded fatal error, if any."""
        with self._condition:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def wait_idle(self, timeout=None):
        """Blocks until nothing is queued or running, or a fatal error is recorded."""
        with self._condition:
            return self._condition.wait_for(
                lambda: self._error is not None or (not self._pending and self._inflight == 0), timeout)

    def idle(self):
        with self._condition:
            return not self._pending and self._inflight == 0

    def stop(self):
        with self._condition:
            self._stopped = True
            self._condition.notify_all()
