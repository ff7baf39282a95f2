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
import itertools
import threading
import time
import uuid

import cloudpickle
import grpc

from kdist.coordinator import payload
from kdist.coordinator._generated import worker_service_pb2 as pb
from kdist.coordinator._generated import worker_service_pb2_grpc as pb_grpc
from kdist.coordinator.remote_value import RemoteValue, RemoteValueStatus, to_numpy
from kdist.coordinator.worker_service import grpc_options
from kdist.errors import (
    CancelledError,
    InvalidArgumentError,
    ParameterServerUnavailableError,
    RemoteFunctionError,
    RemoteTraceback,
    WorkerError,
    WorkerUnavailableError,
)

_RESOURCE = "kdist.resource"
# Codes that mean "this worker is gone or could not answer": retry elsewhere.
_WORKER_LOST = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
})
# The worker restarted or lost its session: define the resources again.
_REDEFINE = frozenset({grpc.StatusCode.FAILED_PRECONDITION})
HEALTH_TIMEOUT_SECONDS = 5.0
# The coordinator asks every parameter server for its health this often, each
# answer within the timeout (the bound on noticing a dead one adds both).
PS_HEALTH_CHECK_SECONDS = 1.0
PS_HEALTH_TIMEOUT_SECONDS = 2.0
# Objects that pickle as themselves: `reference` skips the describers for them.
_PLAIN_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes, tuple, list, dict, range, slice})

# Describers turn chief-side objects into resources: `(predicate, describe)`,
# where `describe(obj, coordinator) -> (kind, spec, merge)`. `spec` is pickled
# (its own references to other resources become dependencies); `merge`, when
# not None, makes it a metric: `merge(obj, arrays)` adds a closure's state.
_describers = []


def register_describer(predicate, describe):
    """Teaches coordinators to send objects for which `predicate(obj)` holds as resources."""
    _describers.append((predicate, describe))


class _Resource:
    def __init__(self, resource_id, obj, kind, spec, dependencies, merge):
        self.id = resource_id
        self.obj = obj
        self.kind = kind
        self.spec = spec
        self.dependencies = dependencies
        self.merge = merge


class _Registry:
    """Chief-side resources by id, in definition order (dependencies first)."""

    def __init__(self, coordinator):
        self._coordinator = coordinator
        self._by_object = {}
        self._resources = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()

    def add(self, obj, kind, spec, merge=None):
        """Registers `obj` explicitly (per-worker datasets and iterators)."""
        with self._lock:
            return self._add(obj, kind, spec, merge)

    def _add(self, obj, kind, spec, merge):
        referenced = []
        spec_payload = payload.dumps(spec, self._resolver(referenced))
        resource = _Resource(next(self._ids), obj, kind, spec_payload, tuple(referenced), merge)
        self._resources[resource.id] = resource
        self._by_object[id(obj)] = resource.id
        return resource

    def get(self, resource_id):
        return self._resources[resource_id]

    def reference(self, obj, referenced):
        """The reference standing in for `obj` in a pickle, or None when `obj` pickles as itself."""
        if type(obj) in _PLAIN_TYPES:  # most of a pickle; never a resource
            return None
        with self._lock:
            resource_id = self._by_object.get(id(obj))
            if resource_id is not None and self._resources[resource_id].obj is obj:
                referenced.append(resource_id)
                return (_RESOURCE, resource_id)
            for predicate, describe in _describers:
                if predicate(obj):
                    kind, spec, merge = describe(obj, self._coordinator)
                    resource = self._add(obj, kind, spec, merge)
                    referenced.append(resource.id)
                    return (_RESOURCE, resource.id)
        return None

    def _resolver(self, referenced):
        return lambda obj: self.reference(obj, referenced)

    def dumps(self, obj):
        """`obj` as a `Payload`, and the ids of the resources it references."""
        referenced = []
        return payload.dumps(obj, self._resolver(referenced)), referenced

    def closure(self, resource_ids):
        """`resource_ids` and everything they depend on, dependencies first."""
        ordered, seen = [], set()

        def visit(resource_id):
            if resource_id in seen:
                return
            seen.add(resource_id)
            for dependency in self._resources[resource_id].dependencies:
                visit(dependency)
            ordered.append(resource_id)

        for resource_id in resource_ids:
            visit(resource_id)
        return ordered


class _Closure:
    def __init__(self, function, args, kwargs):
        self.id = uuid.uuid4().hex
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.remote_value = RemoteValue()
        self.attempts = 0


class _Queue:
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


class _Redefine(Exception):
    pass


class _Dispatcher:
    """One worker: its channel, what it has defined, and the threads feeding it closures.

    `closures_in_flight_per_worker` threads each send one closure at a time;
    the worker runs them one after the other, so while it runs one the next
    is already on its way (the round trip and the chief's pickling are hidden).
    The threads share the worker's instance id and defined resources under a lock.
    """

    def __init__(self, coordinator, index, address):
        self.coordinator = coordinator
        self.index = index
        self.address = address
        security = coordinator._security
        # A lost worker is called every `worker_retry_seconds`: its channel must
        # try to reconnect as often, not after gRPC's default backoff of up to
        # 120 s, or a restarted worker waits that long for work.
        reconnect_ms = max(100, int(coordinator._worker_retry_seconds * 1000))
        options = grpc_options() + [
            ("grpc.enable_http_proxy", 0),
            ("grpc.initial_reconnect_backoff_ms", reconnect_ms),
            ("grpc.max_reconnect_backoff_ms", reconnect_ms),
        ] + list(security.channel_options())
        credentials = security.channel_credentials()
        self._channel = (grpc.insecure_channel(address, options=options) if credentials is None
                         else grpc.secure_channel(address, credentials, options=options))
        self._stub = pb_grpc.WorkerServiceStub(self._channel)
        self._metadata = tuple(security.call_metadata())
        self.instance_id = None
        # Ids of the resources defined in our session there; None until the
        # session is open (a Define opens it, even with no resources).
        self.defined = None
        self.available = False
        self.failures = 0
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._loop, name=f"kdist-dispatch-{index}-{slot}", daemon=True)
            for slot in range(coordinator._closures_in_flight_per_worker)
        ]

    def close(self):
        self._channel.close()

    def _loop(self):
        queue = self.coordinator._queue
        while not self.coordinator._stopped.is_set():
            with self._lock:
                connected = self.instance_id is not None or self._connect()
            if not connected:
                self.coordinator._stopped.wait(self.coordinator._worker_retry_seconds)
                continue
            closure = queue.get()
            if closure is None:
                return
            try:
                self._process(closure)
            except WorkerUnavailableError as error:
                with self._lock:
                    # The other threads' closures on this worker fail too: count the loss once.
                    if self.instance_id == getattr(error, "instance_id", self.instance_id):
                        self.failures += 1
                        self.coordinator._count("worker_failures")
                        self.available = False
                        self.instance_id = None
                self.coordinator._count("closures_retried")
                queue.put_back(closure)
                continue
            except _Redefine:
                # The worker lost our session or a resource (another session
                # replaced ours): open it and define everything again.
                with self._lock:
                    self.instance_id = None
                    self.defined = None
                self.coordinator._count("closures_retried")
                queue.put_back(closure)
                continue
            except Exception as error:  # a fatal error: fail the closure, cancel the rest
                closure.remote_value._set(RemoteValueStatus.FAILED, error=error)
                queue.fail(error)
            queue.finished()

    def _connect(self):
        """Asks the worker who it is; on a new instance, forgets what was defined there (under the lock)."""
        try:
            response = self._stub.Health(pb.HealthRequest(), timeout=HEALTH_TIMEOUT_SECONDS, metadata=self._metadata)
        except grpc.RpcError as error:
            if error.code() not in _WORKER_LOST:
                self.coordinator._queue.fail(WorkerError(self.address, error.code().name, error.details()))
            self.available = False
            return False
        if response.instance_id != self.instance_id:
            self.defined = None
        self.instance_id = response.instance_id
        self.available = True
        return True

    def _call(self, method, request):
        try:
            return method(request, metadata=self._metadata)
        except grpc.RpcError as error:
            code = error.code()
            if code in _WORKER_LOST:
                lost = WorkerUnavailableError(self.address, error.details())
                lost.instance_id = request.instance_id
                raise lost from None
            if code in _REDEFINE:
                raise _Redefine(error.details()) from None
            raise WorkerError(self.address, code.name, error.details()) from None

    def _process(self, closure):
        coordinator = self.coordinator
        closure.attempts += 1
        function_payload, referenced = coordinator._registry.dumps(
            (closure.function, _resolve_remote_values(closure.args), _resolve_remote_values(closure.kwargs)))
        needed = coordinator._registry.closure(referenced)
        with self._lock:
            instance_id = self.instance_id
            if instance_id is None:  # another thread lost the worker meanwhile
                raise _Redefine("the worker was lost")
            defined = set() if self.defined is None else self.defined
            missing = [resource_id for resource_id in needed if resource_id not in defined]
            if missing or self.defined is None:
                resources = []
                for resource_id in missing:
                    resource = coordinator._registry.get(resource_id)
                    resources.append(pb.Resource(id=resource.id, kind=resource.kind, spec=resource.spec))
                self._call(self._stub.Define, pb.DefineRequest(
                    session_id=coordinator._session_id, instance_id=instance_id, resources=resources))
                self.defined = defined | set(missing)
        metric_ids = [resource_id for resource_id in needed if coordinator._registry.get(resource_id).merge is not None]
        response = self._call(self._stub.Run, pb.RunRequest(
            session_id=coordinator._session_id, instance_id=instance_id, closure_id=closure.id,
            function=function_payload, metric_ids=metric_ids))
        if response.outcome == pb.RunResponse.PS_UNAVAILABLE:
            raise ParameterServerUnavailableError(
                response.ps_address, None, f"reported by the worker at {self.address}: {response.error_message}")
        if response.outcome == pb.RunResponse.FUNCTION_ERROR:
            raise _rebuild_error(response, self.address)
        result = payload.loads(response.result)
        with coordinator._metric_lock:
            for state in response.metrics:
                resource = coordinator._registry.get(state.id)
                resource.merge(resource.obj, [payload.tensor_value(tensor) for tensor in state.variables])
        coordinator._count("closures_done")
        closure.remote_value._set(RemoteValueStatus.READY, value=result)


def _rebuild_error(response, address):
    error = None
    if response.error:
        try:
            error = cloudpickle.loads(response.error)
        except Exception:
            error = None
    if not isinstance(error, BaseException):
        return RemoteFunctionError(address, response.error_type, response.error_message, response.traceback)
    error.__cause__ = RemoteTraceback(response.traceback)
    return error


def _resolve_remote_values(structure):
    if isinstance(structure, RemoteValue):
        return structure.get()
    if isinstance(structure, dict):
        return type(structure)((key, _resolve_remote_values(value)) for key, value in structure.items())
    if isinstance(structure, (list, tuple)) and not hasattr(structure, "_fields"):
        return type(structure)(_resolve_remote_values(value) for value in structure)
    return structure


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
            `ParameterServerUnavailableError`. Workers that fail to reach a
            parameter server report it sooner (after the variable client's
            retries).
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
        existing = getattr(getattr(strategy, "extended", None), "_cluster_coordinator", None)
        if existing is not None:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy, *, worker_retry_seconds=1.0, ps_unavailable_seconds=15.0,
                 closures_in_flight_per_worker=2):
        if getattr(self, "_initialized", False):
            return
        extended = getattr(strategy, "extended", None)
        if not hasattr(extended, "remote_variables"):
            raise InvalidArgumentError(
                "ClusterCoordinator needs a kdist.ParameterServerStrategy. Received: "
                f"strategy={strategy!r}."
            )
        for name, value in (("worker_retry_seconds", worker_retry_seconds),
                            ("ps_unavailable_seconds", ps_unavailable_seconds)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive number of seconds. Received: {value!r}.")
        if (isinstance(closures_in_flight_per_worker, bool) or not isinstance(closures_in_flight_per_worker, int)
                or closures_in_flight_per_worker < 1):
            raise InvalidArgumentError(
                "closures_in_flight_per_worker must be a positive integer. Received: "
                f"{closures_in_flight_per_worker!r}.")
        spec = extended.cluster_resolver.cluster_spec()
        workers = spec.job_tasks("worker") if "worker" in spec.jobs else []
        if not workers or any(address is None for address in workers):
            raise InvalidArgumentError(
                "ClusterCoordinator needs the cluster's 'worker' tasks, each with an address. "
                f"Received: cluster_spec={spec.as_dict()}."
            )
        self._strategy = strategy
        self._security = extended.security
        self._worker_retry_seconds = float(worker_retry_seconds)
        self._ps_unavailable_seconds = float(ps_unavailable_seconds)
        self._closures_in_flight_per_worker = closures_in_flight_per_worker
        self._session_id = uuid.uuid4().hex
        self._registry = _Registry(self)
        self._queue = _Queue()
        self._metric_lock = threading.Lock()
        self._stats = collections.Counter()
        self._stats_lock = threading.Lock()
        self._stopped = threading.Event()
        self._dispatchers = [_Dispatcher(self, index, address) for index, address in enumerate(workers)]
        for dispatcher in self._dispatchers:
            for thread in dispatcher.threads:
                thread.start()
        self._watchdog = threading.Thread(target=self._watch_parameter_servers, name="kdist-ps-watchdog", daemon=True)
        self._watchdog.start()
        extended._cluster_coordinator = self
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
        closure = _Closure(fn, tuple(args or ()), dict(kwargs or {}))
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
        store = self._strategy.extended.remote_variables
        store.pull(store.all_entries())

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

    def shutdown(self):
        """Stops the dispatchers (closures still queued are not run)."""
        self._stopped.set()
        self._queue.stop()
        for dispatcher in self._dispatchers:
            dispatcher.close()
        if getattr(self._strategy.extended, "_cluster_coordinator", None) is self:
            self._strategy.extended._cluster_coordinator = None

    # ----- internals ----------------------------------------------------------------
    def _count(self, key, amount=1):
        with self._stats_lock:
            self._stats[key] += amount

    def _watch_parameter_servers(self):
        clients = self._strategy.extended.remote_variables.clients
        failing_since = {}
        while not self._stopped.is_set():
            for client in clients:
                try:
                    client.health(timeout=PS_HEALTH_TIMEOUT_SECONDS)
                    failing_since.pop(client.address, None)
                except ParameterServerUnavailableError as error:
                    started = failing_since.setdefault(client.address, time.monotonic())
                    if time.monotonic() - started >= self._ps_unavailable_seconds:
                        self._queue.fail(ParameterServerUnavailableError(
                            client.address, self._ps_unavailable_seconds, error.detail))
                except Exception:  # a refusal (e.g. a token mismatch) is not an outage
                    failing_since.pop(client.address, None)
            self._stopped.wait(PS_HEALTH_CHECK_SECONDS)
