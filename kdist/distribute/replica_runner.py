"""Runs a function once per replica, with `merge_call` support.

Each replica runs in its own thread, but only one thread runs at a time: the
caller's thread resumes each replica in turn until it finishes or reaches a
`merge_call`. When every replica waits in `merge_call`, the merge function runs
once in the caller's thread (cross-replica context) and each replica resumes
with its share of the result. Running one thread at a time keeps torch's and
Keras' per-thread state simple and the results deterministic.

Thread safety: one `run_per_replica` call owns its threads; concurrent calls from
different caller threads are independent.
"""

import threading

from kdist.distribute import context
from kdist.distribute.devices import device_scope
from kdist.distribute.values import regroup, select_replica
from kdist.errors import ReplicaSyncError

# How often a waiting caller checks that the replica thread it waits on is still
# alive. Waiting itself uses an event; this bounds how long a dead thread can
# go unnoticed.
LIVENESS_CHECK_SECONDS = 1.0


class _Aborted(BaseException):
    """Unwinds a replica thread whose siblings failed (not an `Exception`, so user code cannot swallow it)."""


class _ReplicaThread(threading.Thread):
    def __init__(self, strategy, replica_id, fn, args, kwargs):
        super().__init__(name=f"kdist-replica-{replica_id}", daemon=True)
        self.strategy = strategy
        self.replica_id = replica_id
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.should_run = threading.Event()
        self.has_paused = threading.Event()
        self.aborted = False
        self.done = False
        self.result = None
        self.error = None
        self.merge_request = None
        self.merge_result = None

    def run(self):
        try:
            self._wait_for_turn()
            replica_context = context.ReplicaContext(
                self.strategy, self.replica_id, merge_handler=self._merge
            )
            context.push(self.strategy, replica_context)
            try:
                with self.strategy.extended.replica_device_scope(self.replica_id):
                    self.result = self.fn(*self.args, **self.kwargs)
            finally:
                context.pop(self.strategy)
        except _Aborted:
            pass
        except BaseException as error:  # handed to the caller's thread
            self.error = error
        finally:
            self.done = True
            self.has_paused.set()

    def _wait_for_turn(self):
        self.should_run.wait()
        self.should_run.clear()
        if self.aborted:
            raise _Aborted()

    def _merge(self, merge_fn, args, kwargs):
        self.merge_request = (merge_fn, args, kwargs)
        self.has_paused.set()
        self._wait_for_turn()
        return self.merge_result

    def resume(self):
        """Lets this replica run until it pauses again; returns when it has."""
        self.has_paused.clear()
        self.should_run.set()
        while not self.has_paused.wait(LIVENESS_CHECK_SECONDS):
            if not self.is_alive():
                raise ReplicaSyncError(f"Replica thread {self.name} exited without reporting.")


def run_per_replica(strategy, fn, args=(), kwargs=None):
    """Calls `fn(*args, **kwargs)` once per replica of `strategy`.

    Distributed leaves of `args`/`kwargs` are unwrapped to each replica's
    component. Returns the per-replica results regrouped (see
    `kdist.distribute.values.regroup`).

    Raises:
        The first replica's exception (by replica order) if any replica raised.
        kdist.errors.ReplicaSyncError: replicas disagreed about `merge_call`.
    """
    kwargs = kwargs or {}
    num_replicas = len(strategy.extended.replica_devices)
    calls = [
        (replica_id, select_replica(replica_id, args), select_replica(replica_id, kwargs))
        for replica_id in range(num_replicas)
    ]
    return regroup(run_replicas(strategy, fn, calls))


def run_replicas(strategy, fn, calls, switch=None):
    """Runs `fn(*args, **kwargs)` for each `(replica_id, args, kwargs)` in `calls`.

    The replicas named in `calls` (this process's replica ids, in order) take
    part in each `merge_call`; a merge function sees one component per call.
    `switch`, when given, has `enter(position)` and `leave(position)`, called
    in the caller's thread just before the replica at `position` of `calls`
    resumes and just after it pauses or ends: state that the replicas share
    but must not see each other's changes of (`.grad` of shared tensors) is
    swapped there.

    Returns:
        The list of `fn`'s results, in the order of `calls`.

    Raises:
        As `run_per_replica`.
    """
    threads = [
        _ReplicaThread(strategy, replica_id, fn, args, kwargs) for replica_id, args, kwargs in calls
    ]
    for thread in threads:
        thread.start()
    try:
        while True:
            for position, thread in enumerate(threads):
                if not thread.done:
                    if switch is not None:
                        switch.enter(position)
                    try:
                        thread.resume()
                    finally:
                        if switch is not None:
                            switch.leave(position)
            errors = [thread.error for thread in threads if thread.error is not None]
            if errors:
                raise errors[0]
            finished = [thread.done for thread in threads]
            if all(finished):
                break
            if any(finished):
                raise ReplicaSyncError(
                    "Some replicas called merge_call while others returned: replicas "
                    f"{[t.replica_id for t in threads if t.done]} finished, replicas "
                    f"{[t.replica_id for t in threads if not t.done]} wait in merge_call. "
                    "Every replica must make the same merge_call/all_reduce calls in "
                    "the same order."
                )
            _merge(strategy, threads)
    finally:
        for thread in threads:
            if not thread.done:
                thread.aborted = True
                thread.should_run.set()
        for thread in threads:
            thread.join(timeout=LIVENESS_CHECK_SECONDS * 10)
    return [thread.result for thread in threads]


def _merge(strategy, threads):
    merge_fn = threads[0].merge_request[0]
    for thread in threads[1:]:
        other = thread.merge_request[0]
        if getattr(other, "__code__", other) is not getattr(merge_fn, "__code__", merge_fn):
            raise ReplicaSyncError(
                f"Replicas called merge_call with different functions: replica 0 with "
                f"{merge_fn!r}, replica {thread.replica_id} with {other!r}."
            )
    merged_args = regroup([list(thread.merge_request[1]) for thread in threads])
    merged_kwargs = regroup([thread.merge_request[2] for thread in threads])
    context.push(strategy, None)
    try:
        result = merge_fn(strategy, *merged_args, **merged_kwargs)
    finally:
        context.pop(strategy)
    for position, thread in enumerate(threads):
        thread.merge_request = None
        thread.merge_result = select_replica(position, result)


def run_single_replica(strategy, fn, args=(), kwargs=None):
    """`run_per_replica` for one replica: no threads, merge_call runs at once."""
    kwargs = kwargs or {}
    replica_context = context.ReplicaContext(strategy, 0)
    context.push(strategy, replica_context)
    try:
        with device_scope(strategy.extended.replica_devices[0]):
            return fn(*select_replica(0, args), **select_replica(0, kwargs))
    finally:
        context.pop(strategy)


__all__ = ["run_per_replica", "run_replicas", "run_single_replica"]
