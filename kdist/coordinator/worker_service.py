"""The worker side of coordinator training: a gRPC service that runs closures.

A `worker` task starts this service (`kdist server --job worker`, or
`kdist.distribute.Server(spec, "worker", i)`) and waits. A coordinator opens a
session on it, defines resources (Define) and runs closures (Run). All work of
a worker runs on one thread, in arrival order, so Keras and torch state is
never touched by two threads at once. A Run whose caller is gone by its
turn (the chief died) is skipped, and a Define that opens a new session runs
after everything that arrived before it: when a restarted chief's Define
returns (`ClusterCoordinator.open_worker_sessions`), the dead chief's
closures on this worker have ended.

What a resource *is* — a Keras model rebuilt from its config, an optimizer
whose `apply` pushes to the parameter servers, a per-worker dataset — is the
business of a `WorkerRuntime`; `kdist.keras` installs the Keras one when
`kdist` is imported. The service only routes, and classifies failures:

- the function raised → `FUNCTION_ERROR`, with the exception (pickled when
  it pickles), its type, message and traceback;
- a parameter server was unreachable → `PS_UNAVAILABLE`, so the coordinator
  raises `ParameterServerUnavailableError` instead of retrying elsewhere;
- a request for another worker instance or an unknown session/resource
  (this worker restarted and lost them) → `FAILED_PRECONDITION`: the
  coordinator defines the resources again and retries.

Security: a worker executes code the coordinator sends. Start it with the
cluster's token (`--token-file`) and, beyond one machine, TLS: without them
anyone who can reach the port can run code as the worker's user.
"""

import concurrent.futures
import threading
import traceback
import uuid

import cloudpickle
import grpc

from kdist.cluster.address import bind_endpoint, format_address
from kdist.coordinator import payload
from kdist.coordinator._generated import worker_service_pb2 as pb
from kdist.coordinator._generated import worker_service_pb2_grpc as pb_grpc
from kdist.coordinator.resources import RESOURCE_REFERENCE
from kdist.errors import (
    InvalidArgumentError,
    OutOfRangeError,
    ParameterServerUnavailableError,
)
from kdist.rpc.security import Security

# Closures carry their batches (fit and evaluate on arrays), so messages are
# larger than the variable service's chunks; nothing here is streamed.
MAX_MESSAGE_BYTES = 256 << 20
# A worker whose host vanished (no FIN, no RST) is noticed by keepalive pings.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


def grpc_options():
    """Channel/server options shared by the worker service and its clients."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ]


class WorkerRuntime:
    """Builds resources and runs closures for one coordinator session.

    The default runtime builds nothing but plain objects; `kdist.keras`
    installs one that knows models, optimizers, metrics and datasets.

    Args:
        cluster_spec: the worker's `kdist.cluster.ClusterSpec`.
        task_index: the worker's index in the `worker` job.
        security: the worker's `kdist.ps.Security` (also used towards the
            parameter servers).
    """

    def __init__(self, cluster_spec, task_index, security):
        self.cluster_spec = cluster_spec
        self.task_index = task_index
        self.security = security

    def build(self, kind, spec):
        """The worker's object for a resource of `kind` described by `spec`."""
        if kind == "object":
            return spec
        if kind == "iterator":
            return iter(spec)
        raise InvalidArgumentError(f"This worker cannot build resources of kind {kind!r}.")

    def run(self, function, args, kwargs, closure_id, metrics, resources):
        """Runs one closure.

        Args:
            metrics: the metric resources whose state the closure reports.
            resources: every resource object the closure's payload referenced.
        """
        return function(*args, **kwargs)

    def metric_state(self, metric):
        """The values of a metric resource's state variables (numpy arrays)."""
        raise InvalidArgumentError(f"This worker has no metrics. Received: {metric!r}.")

    def close(self):
        """Releases what the session held (called when a new session replaces it)."""


_runtime_factory = WorkerRuntime


def set_runtime_factory(factory):
    """Installs the `WorkerRuntime` class (or factory) new sessions use."""
    global _runtime_factory
    _runtime_factory = factory


class _UnknownResource(Exception):
    pass


class _Session:
    def __init__(self, session_id, runtime):
        self.id = session_id
        self.runtime = runtime
        self.resources = {}

    def resolve(self, reference):
        kind, resource_id = reference[0], reference[1]
        if kind != RESOURCE_REFERENCE:
            raise _UnknownResource(f"unknown reference {reference!r}")
        try:
            return self.resources[resource_id]
        except KeyError:
            raise _UnknownResource(f"resource {resource_id} is not defined on this worker") from None


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    """Serves one worker task. See the module docstring."""

    def __init__(self, cluster_spec, task_index, security):
        self.instance_id = uuid.uuid4().hex
        self._cluster_spec = cluster_spec
        self._task_index = task_index
        self._security = security
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kdist-worker")
        self._session = None
        self._lock = threading.Lock()
        self.closures_run = 0
        self.closures_skipped = 0

    def close(self):
        self._executor.shutdown(wait=False, cancel_futures=True)

    def Health(self, request, context):
        return pb.HealthResponse(instance_id=self.instance_id, task_index=self._task_index)

    def Define(self, request, context):
        self._check_instance(request, context)
        error = self._executor.submit(self._define, request).result()
        if error is not None:
            context.abort(*error)
        return pb.DefineResponse(instance_id=self.instance_id)

    def Run(self, request, context):
        self._check_instance(request, context)
        response = self._executor.submit(self._run, request, context).result()
        if isinstance(response, tuple):
            context.abort(*response)
        return response

    # ----- on the work thread -----------------------------------------------------
    def _check_instance(self, request, context):
        if request.instance_id != self.instance_id:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this is worker instance {self.instance_id}, not {request.instance_id!r} "
                "(the worker restarted): define the session's resources again",
            )

    def _define(self, request):
        session = self._session
        if session is None or session.id != request.session_id:
            if session is not None:
                session.runtime.close()
            session = self._session = _Session(
                request.session_id, _runtime_factory(self._cluster_spec, self._task_index, self._security)
            )
        for resource in request.resources:
            if resource.id in session.resources:
                continue
            try:
                spec = payload.loads(resource.spec, session.resolve)
                session.resources[resource.id] = session.runtime.build(resource.kind, spec)
            except _UnknownResource as error:
                return grpc.StatusCode.FAILED_PRECONDITION, str(error)
            except Exception:
                return (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"could not build the {resource.kind} resource {resource.id}:\n{traceback.format_exc()}",
                )
        return None

    def _run(self, request, context):
        if not context.is_active():
            # Its caller is gone (a chief that died, or a dispatcher that gave up
            # on this worker and queued the closure again): nobody reads the result,
            # and its pushes would land after a new chief restored its backup.
            self.closures_skipped += 1
            return grpc.StatusCode.CANCELLED, "the caller of this Run is gone; the closure was not run"
        session = self._session
        if session is None or session.id != request.session_id:
            return grpc.StatusCode.FAILED_PRECONDITION, f"session {request.session_id!r} is not open on this worker"
        referenced = []

        def resolve(reference):
            resource = session.resolve(reference)
            referenced.append(resource)
            return resource

        try:
            function, args, kwargs = payload.loads(request.function, resolve)
            metrics = [session.resolve((RESOURCE_REFERENCE, metric_id)) for metric_id in request.metric_ids]
        except _UnknownResource as error:
            return grpc.StatusCode.FAILED_PRECONDITION, str(error)
        except Exception as error:
            return _error_response(error)
        self.closures_run += 1
        try:
            result = session.runtime.run(function, args, kwargs, request.closure_id, metrics, referenced)
            response = pb.RunResponse(outcome=pb.RunResponse.OK, result=payload.dumps(result))
            for metric_id, metric in zip(request.metric_ids, metrics):
                state = [payload.tensor_message(value) for value in session.runtime.metric_state(metric)]
                response.metrics.add(id=metric_id, variables=state)
            return response
        except ParameterServerUnavailableError as error:
            return pb.RunResponse(
                outcome=pb.RunResponse.PS_UNAVAILABLE, ps_address=error.address,
                error_type=_type_name(error), error_message=str(error), traceback=traceback.format_exc(),
            )
        except StopIteration:
            error = OutOfRangeError(
                "A per-worker iterator ran out of data in a scheduled function. Make dataset_fn "
                "return an endless stream (repeat it) or schedule fewer steps."
            )
            return _error_response(error, traceback.format_exc())
        except Exception as error:
            return _error_response(error)


def _type_name(error):
    kind = type(error)
    return f"{kind.__module__}.{kind.__qualname__}"


def _error_response(error, text=None):
    try:
        pickled = cloudpickle.dumps(error)
    except Exception:
        pickled = b""
    return pb.RunResponse(
        outcome=pb.RunResponse.FUNCTION_ERROR, error=pickled, error_type=_type_name(error),
        error_message=str(error), traceback=text or traceback.format_exc(),
    )


class WorkerServer:
    """A started worker-service server. `stop()` it, or `wait()` for it to end.

    Attributes:
        port: the bound port.
        address: `"host:port"` as clients reach it.
        servicer: the `WorkerServicer` (its `instance_id`, `closures_run`, `closures_skipped`).
    """

    def __init__(self, server, servicer, host, port):
        self._server = server
        self.servicer = servicer
        self.port = port
        self.address = format_address(host, port)

    def stop(self, grace=None):
        self._server.stop(grace).wait()
        self.servicer.close()

    def wait(self, timeout=None):
        return self._server.wait_for_termination(timeout)

    def __repr__(self):
        return f"WorkerServer(address={self.address!r})"


def create_worker_server(address, cluster_spec, task_index, *, security=None):
    """Creates, binds and starts the worker service of `worker` task `task_index`.

    Args:
        address: `"host:port"` to bind (port 0 picks one).
        cluster_spec: the cluster (`kdist.cluster.ClusterSpec`); the worker
            reaches the parameter servers listed there.
        task_index: this worker's index.
        security: `kdist.ps.Security`: the token a coordinator must present
            and the TLS files; also used towards the parameter servers.

    Raises:
        kdist.errors.InvalidArgumentError: the address cannot be bound.
    """
    security = Security() if security is None else security
    host, _ = bind_endpoint(address)
    servicer = WorkerServicer(cluster_spec, task_index, security)
    server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kdist-worker-rpc"),
        interceptors=security.server_interceptors(),
        options=grpc_options() + [("grpc.so_reuseport", 0)],
    )
    pb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = security.bind(server, address, "worker service")
    server.start()
    security.check_exposure("worker", host, port)
    return WorkerServer(server, servicer, host, port)
