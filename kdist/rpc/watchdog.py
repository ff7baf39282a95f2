"""A client-side watchdog that cancels gRPC calls still running past their deadline.

gRPC's own deadline should end every call, but it did not always: with the
channel's retry policy on, a pull stream in flight when its parameter server was
`kill -9`ed stayed blocked far past its deadline. That call had its
`UNAVAILABLE` status, but its pending receive operations never completed, so
`cancel()` could not wake it either: kdist's channels therefore run with gRPC's
retries off (`grpc.enable_retries=0`; `VariableClient` retries by itself), which
ends that hang. The watchdog is the second line, for a call gRPC does not end
at its deadline but that can still be cancelled: `watched_call` arms
`Watchdog.watch(call.cancel, deadline + GRACE_SECONDS)`, and a call not finished
by then is cancelled from the watchdog's thread, which wakes the one blocked in it.

One thread per process serves every watched call, with a heap of expiry times;
it starts on the first `watch` (and again in a forked child).
"""

import heapq
import itertools
import logging
import os
import threading
import time

import grpc

_logger = logging.getLogger(__name__)

# The slack given to gRPC's own deadline before the watchdog cancels a call: a
# call that ends by itself is never cancelled, and a hung one fails at most
# this long after its deadline.
GRACE_SECONDS = 2.0
# Finished watches stay in the heap until their expiry would come up; the heap
# is rebuilt without them once they are this many and over half of it.
_PRUNE_AT = 256


class Watch:
    """One watched call; a context manager that stops watching it on exit.

    Attributes:
        fired: True once the watchdog cancelled the call (the call then fails
            with gRPC's `CANCELLED`, or `grpc.FutureCancelledError` for a future).
    """

    __slots__ = ("_cancel", "_watchdog", "done", "fired")

    def __init__(self, watchdog, cancel):
        self._watchdog = watchdog
        self._cancel = cancel
        self.done = False
        self.fired = False

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._watchdog._finish(self)


class Watchdog:
    """Cancels watched calls at their expiry time. Thread-safe.

    Example:

    >>> call = stub.Pull(request, timeout=5)  # doctest: +SKIP
    >>> with shared_watchdog().watch(call.cancel, 5 + GRACE_SECONDS) as watch:  # doctest: +SKIP
    ...     frames = list(call)
    """

    def __init__(self):
        self._condition = threading.Condition()
        self._heap = []  # (expiry on time.monotonic(), sequence number, Watch)
        self._sequence = itertools.count()
        self._num_done = 0
        self._thread = None
        self.num_cancelled = 0

    def watch(self, cancel, seconds):
        """Calls `cancel()` in `seconds` unless the returned `Watch` has exited first.

        Args:
            cancel: a callable that makes the blocked call return, e.g.
                `grpc.Call.cancel` or `grpc.Future.cancel`.
            seconds: from now; None watches nothing (the call has no deadline).

        Returns:
            A `Watch`, to use as a context manager around the blocking part.
        """
        watch = Watch(self, cancel)
        if seconds is None:
            return watch
        expiry = time.monotonic() + seconds
        with self._condition:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kdist-rpc-watchdog",
                                                daemon=True)
                self._thread.start()
            first = not self._heap or expiry < self._heap[0][0]
            heapq.heappush(self._heap, (expiry, next(self._sequence), watch))
            if first:
                self._condition.notify()
        return watch

    def _finish(self, watch):
        with self._condition:
            if watch.done:
                return
            watch.done = True
            self._num_done += 1
            if self._num_done >= _PRUNE_AT and 2 * self._num_done > len(self._heap):
                self._heap = [entry for entry in self._heap if not entry[2].done]
                heapq.heapify(self._heap)
                self._num_done = 0

    def _run(self):
        while True:
            expired = []
            with self._condition:
                now = time.monotonic()
                while self._heap and (self._heap[0][2].done or self._heap[0][0] <= now):
                    _, _, watch = heapq.heappop(self._heap)
                    if watch.done:
                        self._num_done -= 1
                    else:
                        watch.done = watch.fired = True
                        self.num_cancelled += 1
                        expired.append(watch)
                if not expired:
                    self._condition.wait(self._heap[0][0] - now if self._heap else None)
            # Cancelling runs gRPC callbacks: never under the lock.
            for watch in expired:
                try:
                    watch._cancel()
                except Exception:  # one failed cancel must not end the watch over every other call
                    _logger.exception("kdist: cancelling an RPC past its deadline failed")


class CallCancelled(Exception):
    """`watched_call`: the watchdog cancelled a call that outlived its deadline."""


def watched_call(multi_callable, response_streaming, request, read=None, *, timeout, **kwargs):
    """Runs one gRPC call under the shared watchdog; returns `read(response)`.

    Args:
        multi_callable: the method's `grpc` multi-callable.
        response_streaming: whether the method streams its response.
        request: the request message or stream.
        read: consumes the response (for a streamed one, its iterator) inside
            the watch, or None to return the response as it is.
        timeout: the call's deadline in seconds.
        **kwargs: more arguments of the call (`metadata`, `wait_for_ready`).

    Raises:
        CallCancelled: the call still ran `GRACE_SECONDS` after its deadline.
        grpc.RpcError: the call failed by itself.
    """
    # A future (unary response) or a call (streamed response): both can be
    # cancelled from the watchdog's thread, which wakes this one.
    if response_streaming:
        call = response = multi_callable(request, timeout=timeout, **kwargs)
    else:
        call = multi_callable.future(request, timeout=timeout, **kwargs)
    with shared_watchdog().watch(call.cancel, timeout + GRACE_SECONDS) as watch:
        try:
            if not response_streaming:
                response = call.result()
            return response if read is None else read(response)
        except (grpc.RpcError, grpc.FutureCancelledError):
            if watch.fired:
                raise CallCancelled() from None
            raise


_shared = None
_shared_lock = threading.Lock()


def shared_watchdog():
    """Returns the process's `Watchdog` (created on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Watchdog()
        return _shared


def _forget_after_fork():
    # The parent's thread and lock state do not survive a fork: start afresh.
    global _shared, _shared_lock
    _shared = None
    _shared_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
