"""Workers that run code only for coordinators that prove the cluster secret.

A worker executes whatever a coordinator sends it, so a call without a valid
proof must be refused before anything in it is unpickled or run; and a
coordinator must not trust (send closures to, or unpickle replies from) a peer
at a worker's address that cannot prove the secret.
"""

import os

import grpc
import pytest

import kdist
import kdist.coordinator
from kdist.coordinator import payload
from kdist.coordinator._generated import worker_service_pb2 as pb
from kdist.coordinator._generated import worker_service_pb2_grpc as pb_grpc
from kdist.errors import PeerAuthenticationError, WorkerError
from kdist.ps import Security
from kdist.rpc import auth, auth_client
from tests.coordinator import _cluster, _functions

TOKEN = "s3cret"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with _cluster.start(num_workers=1, num_ps=1, tmp_path=tmp_path_factory.mktemp("cluster"), token=TOKEN) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def trusted(cluster):
    """A coordinator with the cluster's token, and a model on the parameter servers."""
    strategy = kdist.ParameterServerStrategy(cluster.resolver(), security=Security(token=TOKEN))
    coordinator = kdist.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = _functions.build_model()
    yield coordinator, model
    coordinator.shutdown()


def _predict_and_mark(coordinator, model, marker):
    """Runs the model and writes `marker` on a worker; returns the predictions' shape."""
    x, _ = _functions.make_digits(8, seed=3)

    def predict(x):
        return model(x).shape

    shape = coordinator.schedule(predict, args=(x,))
    written = coordinator.schedule(_functions.write_marker, args=(str(marker),))
    coordinator.join()
    return tuple(shape.fetch()), written.fetch()


def test_coordinator_with_the_token_runs_work(trusted, tmp_path):
    coordinator, model = trusted
    marker = tmp_path / "trusted"
    assert _predict_and_mark(coordinator, model, marker) == ((8, 10), str(marker))
    assert marker.read_text() == "ran"


@pytest.mark.parametrize("client", ["insecure", "other-secret"])
def test_coordinator_without_the_secret_is_refused_by_the_worker(cluster, trusted, tmp_path, client):
    # The strategy only names the cluster: nothing in this test asks the
    # parameter servers, so the refusal comes from the worker.
    security = Security.insecure() if client == "insecure" else Security(token="wrong-secret")
    strategy = kdist.ParameterServerStrategy(cluster.resolver(), security=security)
    coordinator = kdist.coordinator.ClusterCoordinator(strategy)
    marker = tmp_path / "untrusted"
    try:
        # The refusal is recorded as soon as a dispatcher first calls its
        # worker, so schedule() may raise it already.
        with pytest.raises((WorkerError, PeerAuthenticationError)) as raised:
            coordinator.schedule(_functions.write_marker, args=(str(marker),))
            coordinator.join()
    finally:
        coordinator.shutdown()
    if client == "insecure":  # the worker refuses the call
        assert isinstance(raised.value, WorkerError) and raised.value.code_name == "UNAUTHENTICATED"
    else:  # the coordinator refuses the worker, whose proof of the secret does not match
        assert isinstance(raised.value, PeerAuthenticationError)
    assert raised.value.address == cluster.spec["worker"][0]
    assert not marker.exists()
    # The worker still serves the coordinator that has the secret.
    trusted_coordinator, model = trusted
    assert _predict_and_mark(trusted_coordinator, model, tmp_path / "after")[0] == (8, 10)


def test_raw_calls_without_the_secret_run_nothing(cluster, trusted, tmp_path):
    """A stranger's pickle is refused before it is read, on every method, with no proof,
    a forged proof or a proof replayed from another call; the same request from a
    peer that proves the secret runs."""
    coordinator, model = trusted
    # An open session on the worker, so the same request with the secret runs.
    _predict_and_mark(coordinator, model, tmp_path / "warm")
    address = cluster.spec["worker"][0]
    marker = tmp_path / "raw"
    proving = Security(token=TOKEN).channel(address, [("grpc.enable_http_proxy", 0)])
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel, proving:
        stub = pb_grpc.WorkerServiceStub(channel)
        authorized = pb_grpc.WorkerServiceStub(proving)
        instance_id = authorized.Health(pb.HealthRequest(), timeout=30).instance_id
        run = pb.RunRequest(
            session_id=coordinator._session_id, instance_id=instance_id, closure_id="raw-closure",
            function=payload.dumps((_functions.write_marker, (str(marker),), {})))
        define = pb.DefineRequest(session_id="raw-session", instance_id=instance_id)
        session = os.urandom(32).hex()
        forged = ((auth.SESSION_KEY, session), (auth.NONCE_KEY, os.urandom(16).hex()),
                  (auth.PROOF_KEY, os.urandom(32).hex()))
        token_as_metadata = (("kdist-token", TOKEN),)
        for metadata in ((), forged, token_as_metadata):
            for method, request in ((stub.Health, pb.HealthRequest()), (stub.Define, define), (stub.Run, run)):
                with pytest.raises(grpc.RpcError) as refused:
                    method(request, timeout=30, metadata=metadata)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, refused.value
            assert not marker.exists()
        # The same request from the proving channel runs: the refused ones would have
        # written the file. It runs in the trusted coordinator's session, so
        # the refused Define did not open a session of its own either.
        response = authorized.Run(run, timeout=60)
    assert response.outcome == pb.RunResponse.OK, response.traceback
    assert payload.loads(response.result) == str(marker)
    assert marker.read_text() == "ran"
    assert _predict_and_mark(coordinator, model, tmp_path / "after")[0] == (8, 10)


class _Evil:
    """Unpickling this creates `path`: proof that a reply was read."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class _WorkerImpostor:
    """Takes a dead worker's port and answers like a worker, with a pickle that writes a file."""

    def __init__(self, address, marker):
        from concurrent import futures

        self.received = []
        evil = pb.RunResponse(outcome=pb.RunResponse.OK, result=payload.dumps(_Evil(str(marker))))
        answers = {"Health": pb.HealthResponse(instance_id="impostor").SerializeToString(),
                   "Define": pb.DefineResponse().SerializeToString(),
                   "Run": evil.SerializeToString(), "Hello": os.urandom(64)}
        impostor = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                name = details.method.rsplit("/", 1)[-1]

                def answer(request, context):
                    impostor.received.append((details.method, tuple(details.invocation_metadata), request))
                    return answers.get(name, b"")

                return grpc.unary_unary_rpc_method_handler(answer)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
        self.server.add_generic_rpc_handlers((Handler(),))
        assert self.server.add_insecure_port(address)
        self.server.start()


@pytest.mark.parametrize("reply_check", ["on", "off (negative control)"])
def test_an_impostor_on_a_dead_workers_port_runs_nothing_in_the_chief(tmp_path, monkeypatch, reply_check):
    """A worker dies and a stranger takes its port. The coordinator's next calls reach the
    stranger, whose answers (a pickle that would create a file when read) fail the reply
    proof: the job fails with PeerAuthenticationError naming the address, the chief
    unpickled nothing, and the stranger got neither the secret nor a usable proof. With the
    client's reply check switched off, the same run executes the stranger's pickle."""
    if reply_check != "on":
        monkeypatch.setattr(auth_client.ClientAuthenticator, "_first_metadata", lambda *args: "ok")
    with _cluster.start(num_workers=1, num_ps=1, tmp_path=tmp_path, token=TOKEN) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), security=Security(token=TOKEN))
        coordinator = kdist.coordinator.ClusterCoordinator(strategy)
        try:
            with strategy.scope():
                model = _functions.build_model()
            assert _predict_and_mark(coordinator, model, tmp_path / "before")[0] == (8, 10)
            address = cluster.spec["worker"][0]
            cluster.kill("worker", 0)
            impostor = _WorkerImpostor(address, tmp_path / "pwned")
            raised = None
            try:
                coordinator.schedule(_functions.write_marker, args=(str(tmp_path / "after"),))
                coordinator.join()
            except Exception as error:  # noqa: BLE001 (checked below)
                raised = error
            finally:
                impostor.server.stop(None)
        finally:
            coordinator.shutdown()
    if reply_check != "on":
        assert (tmp_path / "pwned").exists()
        return
    assert isinstance(raised, PeerAuthenticationError), raised
    assert raised.address == address
    assert not (tmp_path / "pwned").exists()
    assert impostor.received, "the coordinator never reached the impostor: the test proves nothing"
    seen = b"".join(repr(entry).encode() for entry in impostor.received)
    assert TOKEN.encode() not in seen
