"""`AppliedUpdateIds`: the update ids of a server's applied pushes, for exactly-once pushes."""

import collections
import threading
import typing

from kdist.ps.wire.status import FailedPreconditionError

# A server remembers the update ids of this many applied pushes, forgetting the
# oldest first. A re-run closure re-pushes within seconds or minutes of the
# first run, long before that many later pushes evict its ids; an entry costs
# well under a kilobyte (an id of at most 256 characters and a PushResult).
MAX_REMEMBERED_UPDATES = 65_536
# How long a push waits for another push with the same update id to finish
# applying: an in-memory apply, milliseconds normally.
UPDATE_ID_WAIT_SECONDS = 60.0
# A push may carry an outcome (`PushHeader.outcome`: what its pusher computed
# from the values its gradients came from, at most
# `kdist.ps.wire.values.MAX_OUTCOME_BYTES`). A server keeps the most recent
# outcomes up to this many bytes in all, forgetting the oldest first. A closure's metric state is bytes to kilobytes:
# this holds the outcomes of far more recent pushes than a re-run needs.
MAX_OUTCOME_BYTES_KEPT = 64 << 20


class AppliedPush(typing.NamedTuple):
    """What `VariableStore.apply_update` did (the fields of `kdist.ps.PushResult`)."""

    versions: dict
    rejected: tuple
    staleness: dict
    deduplicated: bool = False
    outcome: bytes = b""


class AppliedUpdateIds:
    """The update ids of a server's most recent applied pushes, with their results. Thread-safe.

    A push that carries an id `claim`s it before applying. The claim returns
    the first push's result when the id was applied (the push is then a
    duplicate and applies nothing), waits while another push holds the id, and
    otherwise holds the id until the push either `record`s its result (it
    applied) or `release`s the id (it failed and applied nothing, so a corrected
    retry may apply).

    Args:
        capacity: how many ids to remember; the oldest is forgotten first.
    """

    def __init__(self, capacity=MAX_REMEMBERED_UPDATES):
        self.capacity = capacity
        self._condition = threading.Condition()  # guards everything below
        self._results = collections.OrderedDict()  # update id -> result, oldest first
        self._in_flight = set()
        self._num_deduplicated = 0
        self._outcomes = collections.OrderedDict()  # update id -> outcome bytes, oldest first
        self._outcome_bytes = 0

    def claim(self, update_id, timeout=UPDATE_ID_WAIT_SECONDS):
        """Returns `(True, result)` for an applied id, else `(False, None)`: the caller holds it.

        Raises:
            FailedPreconditionError: another push held the id for `timeout` seconds.
        """
        with self._condition:
            if not self._condition.wait_for(lambda: update_id not in self._in_flight, timeout):
                raise FailedPreconditionError(
                    f"Another push with update_id={update_id!r} has been applying for over "
                    f"{timeout} s. Retry this push with the same update_id: it is applied "
                    "once in all."
                )
            if update_id in self._results:
                self._num_deduplicated += 1
                return True, self._results[update_id]
            self._in_flight.add(update_id)
            return False, None

    def record(self, update_id, result, outcome=b""):
        """Remembers that the claimed `update_id` was applied with `result`, and its pusher's `outcome`."""
        with self._condition:
            self._in_flight.discard(update_id)
            self._results[update_id] = result
            while len(self._results) > self.capacity:
                forgotten, _ = self._results.popitem(last=False)
                self._forget_outcome(forgotten)
            if outcome:
                self._outcomes[update_id] = bytes(outcome)
                self._outcome_bytes += len(outcome)
                while self._outcome_bytes > MAX_OUTCOME_BYTES_KEPT:
                    _, oldest = self._outcomes.popitem(last=False)
                    self._outcome_bytes -= len(oldest)
            self._condition.notify_all()

    def outcome_of(self, update_id):
        """The outcome recorded with an applied `update_id`; b"" if none was, or it was forgotten."""
        with self._condition:
            return self._outcomes.get(update_id, b"")

    def _forget_outcome(self, update_id):
        outcome = self._outcomes.pop(update_id, None)
        if outcome is not None:
            self._outcome_bytes -= len(outcome)

    def release(self, update_id):
        """Gives up the claimed `update_id` without remembering it (nothing was applied)."""
        with self._condition:
            self._in_flight.discard(update_id)
            self._condition.notify_all()

    @property
    def num_deduplicated(self):
        """How many claims found their id applied."""
        with self._condition:
            return self._num_deduplicated
