"""`ClusterCoordinator`: the chief schedules functions onto the workers of a cluster.

TensorFlow 2's coordinator-based parameter-server training. The chief runs
the training program; workers run only a worker service (`kdist server --job
worker`) and parameter servers only the variable service. The chief:

- creates variables in `strategy.scope()` — they live on the parameter servers;
- `schedule`s functions: each is queued and returns a `RemoteValue` at once;
  one dispatcher thread per worker takes the next closure when its worker is
  free, makes sure the worker has the resources the closure uses (the model,
  optimizer and metrics rebuilt from their Keras configs, per-worker datasets
  and iterators), and runs it there. The worker reads variables from the
  parameter servers, runs, pushes its updates, and returns the result;
- `join`s: waits until every scheduled closure ran.

Failures (each classified by gRPC status code or exception type, never by
message text):

- a worker that dies or stops answering: its closure goes back to the front of
  the queue and runs on another worker. Its pushes carry idempotency keys
  derived from the closure, so updates it made before dying are not applied a
  second time, and metric updates count only from the run whose result
  arrives. The dispatcher keeps calling the worker; when it answers again (a
  restarted process has a new instance id) its resources are rebuilt and it
  gets work again;
- a parameter server that is unreachable: `join()`/`schedule()` raise
  `ParameterServerUnavailableError` — reported by a worker that failed to reach
  it, or by the coordinator's own health checks after
  `ps_unavailable_seconds`. The job is then restarted from its last
  checkpoint (for `fit`: `keras.callbacks.BackupAndRestore`);
- a scheduled function that raises: `join()` (or the next `schedule()`)
  raises the same exception, chained to the worker's traceback; closures
  still queued are cancelled.
"""

import collections
import threading
import time
import uuid

from kdist.coordinator.closure_queue import Closure, ClosureQueue
from kdist.coordinator.dispatcher import DispatchContext, Dispatcher
from kdist.coordinator.remote_value import RemoteValue, to_numpy
from kdist.coordinator.resources import Registry
from kdist.errors import (
    InvalidArgumentError,
    ParameterServerError,
    ParameterServerUnavailableError,
    PeerAuthenticationError,
)
from kdist.validation import require_positive_integer, require_seconds

# The coordinator asks every parameter server for its health this often, each
# answer within the timeout (the bound on noticing a dead one adds both).
PS_HEALTH_CHECK_SECONDS = 1.0
PS_HEALTH_TIMEOUT_SECONDS = 2.0
# `ps_unavailable_seconds` when the clients do not wait for a server to come
# back (`ServiceOptions.recovery_timeout_seconds=0`).
DEFAULT_PS_UNAVAILABLE_SECONDS = 15.0


class PerWorkerDataset:
    """A dataset built on every worker by its own call of `dataset_fn`.

    `iter()` of it gives a `PerWorkerIterator`: pass that to scheduled
    functions; on the worker that runs one, it is that worker's iterator of
    its own dataset. Each `iter()` starts new iterators (on each worker, at
    its first use).
    """

    def __init__(self, coordinator, dataset_fn):
        self._coordinator = coordinator
        self._resource = coordinator._registry.add(self, "dataset", dataset_fn)

    def __iter__(self):
        return PerWorkerIterator(self._coordinator, self)

    def __repr__(self):
        return f"<PerWorkerDataset resource={self._resource.id}>"


class PerWorkerIterator:
    """One iterator per worker over its `PerWorkerDataset`; `next()` works only on workers."""

    def __init__(self, coordinator, dataset):
        self._resource = coordinator._registry.add(self, "iterator", dataset)

    def __next__(self):
        raise InvalidArgumentError(
            "A PerWorkerIterator yields data only on workers: pass it to a function given to "
            "coordinator.schedule(fn, args=(iterator,)) and call next() there."
        )

    def __repr__(self):
        return f"<PerWorkerIterator resource={self._resource.id}>"


class ClusterCoordinator:
    """Schedules functions onto the workers of a `ParameterServerStrategy` cluster.

    One coordinator per strategy: constructing a second one for the same
    strategy returns the first.

    Args:
        strategy: the chief's `kdist.ParameterServerStrategy`. Its cluster
            lists the `worker` tasks (each running `kdist server --job
            worker`); its `security` is presented to them.
        worker_retry_seconds: how often a lost worker is called again.
        ps_unavailable_seconds: how long a parameter server may fail the
            coordinator's health checks before `join()`/`schedule()` raise
            `ParameterServerUnavailableError`. None (the default): the
            variable clients' `ServiceOptions.recovery_timeout_seconds`, the
            time a restarted server has to come back (`kdist launch --ps`
            restarts one), or 15 s where that is 0. Workers that fail to
            reach a parameter server report it once their own wait ends.
        closures_in_flight_per_worker: closures sent to a worker before the
            previous one returned. The worker runs them one at a time; the
            second hides the round trip, but two closures sent together may
            run in either order, and a closure already sent still runs when
            an earlier one fails. 1 is TensorFlow's behaviour.

    Raises:
        kdist.errors.InvalidArgumentError: `strategy` is not a
            parameter-server strategy, or its cluster has no `worker` task.

    Example:

    ```python
    coordinator = kdist.coordinator.ClusterCoordinator(strategy)
    per_worker_dataset = coordinator.create_per_worker_dataset(dataset_fn)
    iterator = iter(per_worker_dataset)
    for _ in range(steps):
        coordinator.schedule(worker_fn, args=(iterator,))
    coordinator.join()
    ```
    """

    def __new__(cls, strategy, **kwargs):
        existing = getattr(getattr(strategy, "extended", None), "cluster_coordinator", None)
        if existing is not None:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy, *, worker_retry_seconds=1.0, ps_unavailable_seconds=None,
                 closures_in_flight_per_worker=2):
        if getattr(self, "_initialized", False):
            return
        extended = getattr(strategy, "extended", None)
        if not hasattr(extended, "variable_router"):
            raise InvalidArgumentError(
                "ClusterCoordinator needs a kdist.ParameterServerStrategy. Received: "
                f"strategy={strategy!r}."
            )
        worker_retry_seconds = require_seconds("worker_retry_seconds", worker_retry_seconds)
        if ps_unavailable_seconds is None:
            windows = [client.options.recovery_timeout_seconds for client in extended.variable_router.clients]
            ps_unavailable_seconds = max(windows, default=0) or DEFAULT_PS_UNAVAILABLE_SECONDS
        # Infinite: never give up on a parameter server (workers still report theirs).
        ps_unavailable_seconds = require_seconds("ps_unavailable_seconds", ps_unavailable_seconds,
                                                 allow_infinite=True)
        closures_in_flight_per_worker = require_positive_integer(
            "closures_in_flight_per_worker", closures_in_flight_per_worker)
        spec = extended.cluster_resolver.cluster_spec()
        workers = spec.job_tasks("worker") if "worker" in spec.jobs else []
        if not workers or any(address is None for address in workers):
            raise InvalidArgumentError(
                "ClusterCoordinator needs the cluster's 'worker' tasks, each with an address. "
                f"Received: cluster_spec={spec.as_dict()}."
            )
        self._strategy = strategy
        self._security = extended.security
        self._worker_retry_seconds = worker_retry_seconds
        self._ps_unavailable_seconds = ps_unavailable_seconds
        self._closures_in_flight_per_worker = closures_in_flight_per_worker
        self._session_id = uuid.uuid4().hex
        self._registry = Registry(self)
        self._queue = ClosureQueue()
        self._metric_lock = threading.Lock()
        self._stats = collections.Counter()
        self._stats_lock = threading.Lock()
        self._stopped = threading.Event()
        context = DispatchContext(
            session_id=self._session_id, security=self._security, registry=self._registry,
            queue=self._queue, stopped=self._stopped, metric_lock=self._metric_lock, count=self._count,
            worker_retry_seconds=self._worker_retry_seconds,
            closures_in_flight_per_worker=self._closures_in_flight_per_worker)
        self._dispatchers = [Dispatcher(context, index, address) for index, address in enumerate(workers)]
        for dispatcher in self._dispatchers:
            for thread in dispatcher.threads:
                thread.start()
        self._watchdog = threading.Thread(target=self._watch_parameter_servers, name="kdist-ps-watchdog", daemon=True)
        self._watchdog.start()
        extended.attach_coordinator(self)
        self._initialized = True

    # ----- public API ---------------------------------------------------------------
    @property
    def strategy(self):
        """The `ParameterServerStrategy` this coordinator schedules for."""
        return self._strategy

    @property
    def num_workers(self):
        """Number of worker tasks."""
        return len(self._dispatchers)

    def schedule(self, fn, args=None, kwargs=None):
        """Queues `fn(*args, **kwargs)` to run on some worker; returns its `RemoteValue` at once.

        `args`/`kwargs` may hold `PerWorkerIterator`s (each worker uses its
        own), `RemoteValue`s of earlier closures (their values are sent), the
        model, optimizer, metrics and variables created in `strategy.scope()`
        (each worker uses its copy), tensors and any picklable value.

        Raises:
            The error of an earlier closure that failed (once; the queue was
            cancelled), or `ParameterServerUnavailableError`.
        """
        if not callable(fn):
            raise InvalidArgumentError(f"fn must be callable. Received: {fn!r}.")
        if args is not None and not isinstance(args, (list, tuple)):
            raise InvalidArgumentError(f"args must be a tuple or list. Received: {type(args).__name__}.")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise InvalidArgumentError(f"kwargs must be a dict. Received: {type(kwargs).__name__}.")
        self._queue.raise_error()
        closure = Closure(fn, tuple(args or ()), dict(kwargs or {}))
        self._count("closures_scheduled")
        self._queue.put(closure)
        return closure.remote_value

    def join(self):
        """Blocks until every scheduled closure ran; raises the first error of any of them.

        Then the chief's local copies of the variables are refreshed from the
        parameter servers (what changed, one request per server), so the
        model on the chief computes with the trained values.
        """
        self._queue.wait_idle()
        self._queue.raise_error()
        store = self._strategy.extended.variable_router
        store.pull(store.all_routes())

    def done(self):
        """True when nothing is queued or running (raises a recorded error, like `join`)."""
        self._queue.raise_error()
        return self._queue.idle()

    def fetch(self, val):
        """`val` with every `RemoteValue` in it (nested lists/tuples/dicts) fetched as numpy."""
        if isinstance(val, RemoteValue):
            return val.fetch()
        if isinstance(val, dict):
            return type(val)((key, self.fetch(item)) for key, item in val.items())
        if isinstance(val, (list, tuple)):
            items = [self.fetch(item) for item in val]
            return type(val)(*items) if hasattr(val, "_fields") else type(val)(items)
        return to_numpy(val)

    def share_with_workers(self, obj):
        """Sends `obj` to every worker once; closures that refer to `obj` then travel by its id.

        For chief-side objects that many closures use (a `keras.utils.PyDataset`
        the workers index), so each closure does not carry its own copy.
        """
        return self._registry.add(obj, "object", obj)

    def create_per_worker_dataset(self, dataset_fn):
        """Has every worker build its own dataset with `dataset_fn` (see `PerWorkerDataset`).

        `dataset_fn()` (or `dataset_fn(input_context)` when it takes an
        argument: a `kdist.InputContext` naming the worker as input pipeline)
        runs on each worker and returns anything `iter()` accepts: a
        generator, a `torch.utils.data.DataLoader`, a `keras.utils.PyDataset`
        or a `tf.data.Dataset`. Make it endless (repeat it) and shuffle it.
        """
        if not callable(dataset_fn) and not isinstance(dataset_fn, PerWorkerDataset):
            raise InvalidArgumentError(
                f"dataset_fn must be a callable returning a dataset. Received: {dataset_fn!r}.")
        if isinstance(dataset_fn, PerWorkerDataset):
            return dataset_fn
        return PerWorkerDataset(self, dataset_fn)

    @property
    def stats(self):
        """Counters: closures scheduled/done/retried, worker failures, workers available now."""
        with self._stats_lock:
            stats = dict(self._stats)
        for key in ("closures_scheduled", "closures_done", "closures_retried", "worker_failures"):
            stats.setdefault(key, 0)
        stats["workers_available"] = sum(dispatcher.available for dispatcher in self._dispatchers)
        return stats

    def open_worker_sessions(self):
        """Opens this coordinator's session on every worker that answers; returns how many answered.

        A worker runs its work in arrival order and skips a closure whose
        caller is gone, so when this returns, closures that an earlier
        coordinator (a chief that died and was restarted) left queued or
        running on these workers have ended and push nothing more. Call it
        before restoring a checkpoint onto the parameter servers; a
        coordinator `model.fit` does, before `BackupAndRestore` restores.
        """
        return sum(dispatcher.open_session() for dispatcher in self._dispatchers)

    def shutdown(self):
        """Stops the dispatchers (closures still queued are not run)."""
        self._stopped.set()
        self._queue.stop()
        for dispatcher in self._dispatchers:
            dispatcher.close()
        self._strategy.extended.detach_coordinator(self)

    # ----- internals ----------------------------------------------------------------
    def _count(self, key, amount=1):
        with self._stats_lock:
            self._stats[key] += amount

    def _watch_parameter_servers(self):
        try:
            self._watch_parameter_servers_until_stopped()
        except Exception as error:
            # Not a transport failure but a bug: join()/schedule() raise it (with
            # its traceback) instead of the watch ending unseen in its thread.
            self._queue.fail(error)

    def _watch_parameter_servers_until_stopped(self):
        clients = self._strategy.extended.variable_router.clients
        failing_since = {}
        while not self._stopped.is_set():
            for client in clients:
                try:
                    client.health(timeout=PS_HEALTH_TIMEOUT_SECONDS)
                    failing_since.pop(client.address, None)
                except ParameterServerUnavailableError as error:
                    started = failing_since.setdefault(client.address, time.monotonic())
                    if time.monotonic() - started >= self._ps_unavailable_seconds:
                        # Calls still waiting for it (the chief's own) fail now too.
                        client.give_up()
                        self._queue.fail(ParameterServerUnavailableError(
                            client.address, self._ps_unavailable_seconds, error.detail,
                            elapsed_seconds=time.monotonic() - started))
                except (ParameterServerError, PeerAuthenticationError):
                    # A refusal (e.g. a token mismatch) is not an outage.
                    failing_since.pop(client.address, None)
                except ValueError:
                    if client.closed:  # the strategy closed its clients: the chief is exiting
                        return
                    raise
            self._stopped.wait(PS_HEALTH_CHECK_SECONDS)
