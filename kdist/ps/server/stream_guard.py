"""Server side: bounds on concurrent streaming calls, and an idle timeout per stream.

A streaming call holds one server thread for as long as it runs, and how long
that is depends on the client: a client that sends a header and then nothing
holds its thread forever. Two rules keep the server answering everyone,
`Health` included:

- **Slots.** A streaming call (every method with a request or response stream)
  takes a slot when it starts and gives it back when it ends. At most
  `ServiceOptions.stream_limit` slots exist, fewer than the server's threads,
  so unary calls always find a thread; one client holds at most
  `ServiceOptions.peer_stream_limit` of them. A client is its authenticated
  session (`kdist.rpc.auth`: each `VariableClient` says hello once, so the
  channels of one process, which gRPC multiplexes over one connection, are
  counted apart); a call without a session (a server without the cluster
  secret) is counted by its connection (`context.peer()`). A call that finds
  no slot is refused at once with `RESOURCE_EXHAUSTED` naming the bound and
  the trailing metadata `SLOT_REFUSED_KEY`; it never waits here, because a
  waiting call would hold one of the threads kept for unary calls. Nothing of
  a refused call's request has been read, so kdist's client sends it again
  after a jittered backoff, within the call's deadline
  (`kdist.ps.client.retry`); a memory or disk shortage, also
  `RESOURCE_EXHAUSTED`, carries no such metadata and is not retried.
- **Idle timeout.** While a call waits for its client — for the next request
  message, or for the client to take a response message — it is *waiting*.
  A call waiting longer than `ServiceOptions.stream_idle_seconds` is cancelled
  by the guard's watchdog thread (`context.cancel()`), which wakes the handler
  blocked on it and frees the thread. Time the server itself spends (applying
  a gradient, encoding a response) never counts.
"""

import logging
import threading
import time

from kdist.errors import KdistError
from kdist.ps.wire.status import ResourceExhaustedError, SLOT_REFUSED_KEY
from kdist.rpc.auth import SESSION_KEY

logger = logging.getLogger(__name__)

# The guard's thread ends this long after the last call did (or sooner, with a shorter idle timeout).
_LINGER_SECONDS = 5.0


class StreamSlotRefusedError(ResourceExhaustedError):
    """No stream slot was free for a call (`RESOURCE_EXHAUSTED`); nothing of it was read.

    Attributes:
        bound: `"client"` (the caller's own calls hold every slot one client
            may hold) or `"server"` (every slot of the server is taken).
    """

    def __init__(self, message, bound):
        super().__init__(message)
        self.bound = bound


class StreamCancelledError(KdistError, ConnectionError):
    """A request stream was cancelled (by its client, or as idle) before it ended."""


class GuardedCall:
    """One admitted streaming call. `waiting_since` is set while it waits for its client."""

    __slots__ = ("method", "peer", "owner", "context", "waiting_since", "idle_cancelled", "released")

    def __init__(self, method, peer, owner, context):
        self.method = method
        self.peer = peer  # the connection's address, for messages
        self.owner = owner  # what the per-client bound counts (`client_key`)
        self.context = context
        self.waiting_since = None  # time.monotonic() when it began to wait; None: working
        self.idle_cancelled = False
        self.released = False


class StreamGuard:
    """Admits streaming calls into bounded slots and cancels the idle ones. Thread-safe.

    The watchdog thread runs only while calls come: it starts with the first
    and ends a few seconds after the last one is released (one thread for a
    run of calls, not one per call).

    Args:
        stream_limit: slots in all.
        peer_limit: slots one client (`client_key`) may hold.
        idle_seconds: how long a call may wait for its client.

    Example:

    >>> guard = StreamGuard(stream_limit=12, peer_limit=8, idle_seconds=30.0)
    >>> guard.num_streams
    0
    """

    def __init__(self, stream_limit, peer_limit, idle_seconds):
        self.stream_limit = stream_limit
        self.peer_limit = peer_limit
        self.idle_seconds = idle_seconds
        self._condition = threading.Condition()  # guards everything below
        self._calls = set()
        self._per_peer = {}
        self._watchdog = None
        self.num_refused = 0
        self.num_idle_cancelled = 0

    @classmethod
    def from_options(cls, options):
        """Returns the guard that `ServiceOptions` describe."""
        return cls(options.stream_limit, options.peer_stream_limit, options.stream_idle_seconds)

    @property
    def num_streams(self):
        """Streaming calls admitted and not yet released."""
        with self._condition:
            return len(self._calls)

    def admit(self, method, context):
        """Admits a call of `method` (a name, for messages) or refuses it.

        A refusal also sets the trailing metadata `SLOT_REFUSED_KEY` on
        `context`, which tells the client it may send the call again.

        Returns:
            The call's `GuardedCall`; `release` it when the call ends. It is
            also released when gRPC ends the call (a callback on `context`).

        Raises:
            StreamSlotRefusedError: every slot, or every slot of this client, is taken.
        """
        peer, owner = context.peer(), client_key(context)
        with self._condition:
            held = self._per_peer.get(owner, 0)
            if len(self._calls) >= self.stream_limit or held >= self.peer_limit:
                self.num_refused += 1
                refusal = self._refusal(method, held)
            else:
                refusal = None
                call = GuardedCall(method, peer, owner, context)
                self._calls.add(call)
                self._per_peer[owner] = held + 1
                if self._watchdog is None:
                    self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                                      name="kdist-ps-stream-guard")
                    self._watchdog.start()
        if refusal is not None:
            context.set_trailing_metadata(((SLOT_REFUSED_KEY, refusal.bound),))
            raise refusal
        if not context.add_callback(lambda: self.release(call)):
            self.release(call)  # the call has already ended
        return call

    def _refusal(self, method, held):
        if held >= self.peer_limit:
            bound = "client"
            text = (f"{held} streaming calls from this client, the most one client may "
                    f"have open (ServiceOptions.max_streams_per_peer={self.peer_limit})")
        else:
            bound = "server"
            text = (f"{len(self._calls)} streaming calls, the most this server serves "
                    f"at once (ServiceOptions.max_concurrent_streams={self.stream_limit})")
        return StreamSlotRefusedError(
            f"Too many concurrent streams: {method} refused before its request was read. "
            f"Received: {text} already open. kdist clients retry within the call's deadline; "
            "raise the bound (or rpc_timeout_seconds) if this persists.", bound)

    def release(self, call):
        """Gives `call`'s slot back; a second release does nothing."""
        with self._condition:
            if call.released:
                return
            call.released = True
            self._calls.discard(call)
            left = self._per_peer.pop(call.owner) - 1
            if left:
                self._per_peer[call.owner] = left

    def requests(self, call, iterator):
        """Yields the request messages of `call`, marking it waiting while it reads."""
        iterator = iter(iterator)
        while True:
            call.waiting_since = time.monotonic()
            try:
                message = next(iterator)
            except StopIteration:
                # gRPC may end the request iterator of a cancelled call like a
                # complete stream, before it marks the call cancelled: a
                # request cut short that way must not be applied.
                if call.idle_cancelled or not call.context.is_active():
                    raise StreamCancelledError(
                        f"The {call.method} stream from {call.peer} was cancelled before "
                        "its request ended; nothing of it is applied."
                    ) from None
                return
            finally:
                call.waiting_since = None
            yield message

    def responses(self, call, iterator):
        """Yields the response messages of `call`, marking it waiting while gRPC sends one.

        Releases the call when the stream ends, however it ends.
        """
        try:
            for message in iterator:
                call.waiting_since = time.monotonic()
                yield message
                call.waiting_since = None
        finally:
            call.waiting_since = None
            self.release(call)

    def _watch(self):
        lingered = False
        while True:
            with self._condition:
                if not self._calls:
                    if lingered:
                        self._watchdog = None
                        return
                    # Calls come one after another: waiting a while for the next one
                    # saves starting a thread per call.
                    lingered = True
                    self._condition.wait(min(self.idle_seconds, _LINGER_SECONDS))
                    continue
                lingered = False
                now = time.monotonic()
                expired, next_check = [], self.idle_seconds
                for call in self._calls:
                    since = call.waiting_since
                    if since is None or call.idle_cancelled:
                        continue
                    left = since + self.idle_seconds - now
                    if left <= 0:
                        call.idle_cancelled = True
                        expired.append(call)
                    else:
                        next_check = min(next_check, left)
                self.num_idle_cancelled += len(expired)
            for call in expired:
                logger.warning(
                    "Cancelled a %s stream from %s: it waited over %g s for its client "
                    "(ServiceOptions.stream_idle_seconds).", call.method, call.peer,
                    self.idle_seconds)
                call.context.cancel()
            with self._condition:
                # A call that starts waiting now expires no sooner than
                # idle_seconds from now, so this wait is never late. Releases do
                # not wake it: the thread ends at its next look with no call left.
                self._condition.wait(next_check)


def client_key(context):
    """What the per-client bound counts a call against: its session, else its connection.

    The server's authenticator (`kdist.rpc.auth.ServerAuthenticator`) has
    checked a call's session and proof before any handler runs, so a session
    here is one that a holder of the cluster secret opened: one
    `VariableClient`; a call without one is counted by its connection.
    Without the secret a session is not checked: a client that forges them
    gains no more than one that opens more connections, which it may anyway.
    The server-wide bound is the one that holds against every client.
    """
    for key, value in context.invocation_metadata() or ():
        if key == SESSION_KEY:
            return f"session {value}"
    return context.peer()
