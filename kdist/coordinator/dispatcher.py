"""One worker as the coordinator sees it: its channel, its session, and the threads that feed it closures.

Failures are classified by gRPC status code (see `ClusterCoordinator`): a lost
worker's closure goes back to the queue, a worker that lost its session gets
its resources defined again, anything else fails the closure.
"""

import dataclasses
import threading
from collections.abc import Callable

import cloudpickle
import grpc

from kdist.coordinator import payload
from kdist.coordinator._generated import worker_service_pb2 as pb
from kdist.coordinator._generated import worker_service_pb2_grpc as pb_grpc
from kdist.coordinator.closure_queue import ClosureQueue
from kdist.coordinator.remote_value import RemoteValue, RemoteValueStatus
from kdist.coordinator.resources import Registry
from kdist.coordinator.worker_service import grpc_options
from kdist.errors import (
    ParameterServerUnavailableError,
    PeerAuthenticationError,
    RemoteFunctionError,
    RemoteTraceback,
    WorkerError,
    WorkerUnavailableError,
)
from kdist.rpc.security import Security
from kdist.rpc.watchdog import CallCancelled, watched_call

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


class _Redefine(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class DispatchContext:
    """What the dispatchers of one `ClusterCoordinator` share; it builds this once.

    The dispatchers read the coordinator only through this. Every member is
    thread-safe or immutable.

    Attributes:
        session_id: the coordinator's session on every worker.
        security: the `kdist.ps.Security` presented to the workers.
        registry: the `kdist.coordinator.resources.Registry` of resources closures use.
        queue: the `ClosureQueue` closures are taken from.
        stopped: set when the coordinator shuts down.
        metric_lock: held while a closure's metric state is merged into the chief's metrics.
        count: `count(key)` adds one to the coordinator's `stats[key]`.
        worker_retry_seconds: how often a lost worker is called again.
        closures_in_flight_per_worker: closures sent to one worker at a time (one thread each).
    """

    session_id: str
    security: Security
    registry: Registry
    queue: ClosureQueue
    stopped: threading.Event
    metric_lock: threading.Lock
    count: Callable[[str], None]
    worker_retry_seconds: float
    closures_in_flight_per_worker: int


class Dispatcher:
    """One worker: its channel, what it has defined, and the threads feeding it closures.

    `closures_in_flight_per_worker` threads each send one closure at a time;
    the worker runs them one after the other, so while it runs one the next
    is already on its way (the round trip and the chief's pickling are hidden).
    The threads share the worker's instance id and defined resources under a lock.
    """

    def __init__(self, context, index, address):
        self.context = context
        self.index = index
        self.address = address
        # A lost worker is called every `worker_retry_seconds`: its channel must
        # try to reconnect as often, not after gRPC's default backoff of up to
        # 120 s, or a restarted worker waits that long for work.
        reconnect_ms = max(100, int(context.worker_retry_seconds * 1000))
        # `Security.channel` turns channel retries off: with them a call whose server
        # died could block past its deadline (a lost worker's closure is retried
        # elsewhere anyway).
        options = grpc_options() + [
            ("grpc.initial_reconnect_backoff_ms", reconnect_ms),
            ("grpc.max_reconnect_backoff_ms", reconnect_ms),
        ]
        # Proves the cluster secret and checks the worker's proof (kdist.rpc.auth).
        self._channel = context.security.channel(address, options)
        self._stub = pb_grpc.WorkerServiceStub(self._channel)
        self._metadata = ()
        self.instance_id = None
        # Ids of the resources defined in our session there; None until the
        # session is open (a Define opens it, even with no resources).
        self.defined = None
        self.available = False
        self.failures = 0
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._loop, name=f"kdist-dispatch-{index}-{slot}", daemon=True)
            for slot in range(context.closures_in_flight_per_worker)
        ]

    def close(self):
        self._channel.close()

    def open_session(self):
        """Opens the coordinator's session on this worker if it answers; True when the session is open.

        The worker runs this Define after every Run that reached it before
        and skips those whose caller is gone, so when it returns, closures a
        previous coordinator (a chief that died) left there have ended. A
        worker that does not answer runs nothing of anyone's.
        """
        with self._lock:
            if self.instance_id is None and not self._connect():
                return False
            if self.defined is not None:
                return True
            try:
                self._call(self._stub.Define, pb.DefineRequest(
                    session_id=self.context.session_id, instance_id=self.instance_id, resources=[]))
            except (WorkerUnavailableError, _Redefine):
                # Lost, or restarted since the health check (a new process ran nothing
                # old): the dispatcher threads connect again.
                self.instance_id = None
                self.defined = None
                return False
            self.defined = set()
            return True

    def _loop(self):
        context = self.context
        queue = context.queue
        while not context.stopped.is_set():
            with self._lock:
                connected = self.instance_id is not None or self._connect()
            if not connected:
                context.stopped.wait(context.worker_retry_seconds)
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
                        context.count("worker_failures")
                        self.available = False
                        self.instance_id = None
                context.count("closures_retried")
                queue.put_back(closure)
                continue
            except _Redefine:
                # The worker lost our session or a resource (another session
                # replaced ours): open it and define everything again.
                with self._lock:
                    self.instance_id = None
                    self.defined = None
                context.count("closures_retried")
                queue.put_back(closure)
                continue
            except Exception as error:  # a fatal error: fail the closure, cancel the rest
                closure.remote_value._set(RemoteValueStatus.FAILED, error=error)
                queue.fail(error)
            queue.finished()

    def _connect(self):
        """Asks the worker who it is; on a new instance, forgets what was defined there (under the lock)."""
        try:
            # Under the watchdog: a Health that outlives its deadline is cancelled.
            response = watched_call(self._stub.Health, False, pb.HealthRequest(),
                                    timeout=HEALTH_TIMEOUT_SECONDS, metadata=self._metadata)
        except CallCancelled:
            self.available = False
            return False
        except ValueError:
            # `shutdown()` closed the channel while this thread was between checks.
            if self.context.stopped.is_set():
                self.available = False
                return False
            raise
        except grpc.RpcError as error:
            if error.code() not in _WORKER_LOST:
                self.context.queue.fail(WorkerError(self.address, error.code().name, error.details()))
            self.available = False
            return False
        except PeerAuthenticationError as error:
            # Something that cannot prove the cluster secret answers at this worker's
            # address: nothing was sent to it; the job fails with the typed error.
            self.context.queue.fail(error)
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
        context = self.context
        registry = context.registry
        closure.attempts += 1
        function_payload, referenced = registry.dumps(
            (closure.function, _resolve_remote_values(closure.args), _resolve_remote_values(closure.kwargs)))
        needed = registry.closure(referenced)
        with self._lock:
            instance_id = self.instance_id
            if instance_id is None:  # another thread lost the worker meanwhile
                raise _Redefine("the worker was lost")
            defined = set() if self.defined is None else self.defined
            missing = [resource_id for resource_id in needed if resource_id not in defined]
            if missing or self.defined is None:
                resources = []
                for resource_id in missing:
                    resource = registry.get(resource_id)
                    resources.append(pb.Resource(id=resource.id, kind=resource.kind, spec=resource.spec))
                self._call(self._stub.Define, pb.DefineRequest(
                    session_id=context.session_id, instance_id=instance_id, resources=resources))
                self.defined = defined | set(missing)
        metric_ids = [resource_id for resource_id in needed if registry.get(resource_id).merge is not None]
        response = self._call(self._stub.Run, pb.RunRequest(
            session_id=context.session_id, instance_id=instance_id, closure_id=closure.id,
            function=function_payload, metric_ids=metric_ids))
        if response.outcome == pb.RunResponse.PS_UNAVAILABLE:
            raise ParameterServerUnavailableError(
                response.ps_address, None, f"reported by the worker at {self.address}: {response.error_message}")
        if response.outcome == pb.RunResponse.FUNCTION_ERROR:
            raise _rebuild_error(response, self.address)
        result = payload.loads(response.result)
        with context.metric_lock:
            for state in response.metrics:
                resource = registry.get(state.id)
                resource.merge(resource.obj, [payload.tensor_value(tensor) for tensor in state.variables])
        context.count("closures_done")
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
