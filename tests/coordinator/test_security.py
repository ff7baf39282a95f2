"""Workers that run code only for coordinators presenting the cluster's token.

A worker executes whatever a coordinator sends it, so a call without the
token must be refused before anything in it is unpickled or run.
"""

import grpc
import pytest

import kdist
import kdist.coordinator
from kdist.coordinator import payload
from kdist.coordinator._generated import worker_service_pb2 as pb
from kdist.coordinator._generated import worker_service_pb2_grpc as pb_grpc
from kdist.errors import WorkerError
from kdist.ps import Security
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


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_coordinator_without_the_token_is_refused_by_the_worker(cluster, trusted, tmp_path, token):
    # The strategy only names the cluster: nothing in this test asks the
    # parameter servers, so the refusal comes from the worker.
    strategy = kdist.ParameterServerStrategy(cluster.resolver(), security=Security(token=token))
    coordinator = kdist.coordinator.ClusterCoordinator(strategy)
    marker = tmp_path / "untrusted"
    try:
        # The refusal is recorded as soon as a dispatcher first calls its
        # worker, so schedule() may raise it already.
        with pytest.raises(WorkerError) as raised:
            coordinator.schedule(_functions.write_marker, args=(str(marker),))
            coordinator.join()
    finally:
        coordinator.shutdown()
    assert raised.value.code_name == "UNAUTHENTICATED"
    assert raised.value.address == cluster.spec["worker"][0]
    assert not marker.exists()
    # The worker still serves the coordinator that has the token.
    trusted_coordinator, model = trusted
    assert _predict_and_mark(trusted_coordinator, model, tmp_path / "after")[0] == (8, 10)


def test_raw_calls_without_the_token_run_nothing(cluster, trusted, tmp_path):
    coordinator, model = trusted
    # An open session on the worker, so the same request with the token runs.
    _predict_and_mark(coordinator, model, tmp_path / "warm")
    address = cluster.spec["worker"][0]
    marker = tmp_path / "raw"
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        authorized = ((kdist.ps.security.TOKEN_METADATA_KEY, TOKEN),)
        instance_id = stub.Health(pb.HealthRequest(), timeout=30, metadata=authorized).instance_id
        run = pb.RunRequest(
            session_id=coordinator._session_id, instance_id=instance_id, closure_id="raw-closure",
            function=payload.dumps((_functions.write_marker, (str(marker),), {})))
        define = pb.DefineRequest(session_id="raw-session", instance_id=instance_id)
        for metadata in ((), ((kdist.ps.security.TOKEN_METADATA_KEY, "wrong-token"),)):
            for method, request in ((stub.Health, pb.HealthRequest()), (stub.Define, define), (stub.Run, run)):
                with pytest.raises(grpc.RpcError) as refused:
                    method(request, timeout=30, metadata=metadata)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, refused.value
            assert not marker.exists()
        # The same request with the token runs: the refused ones would have
        # written the file. It runs in the trusted coordinator's session, so
        # the refused Define did not open a session of its own either.
        response = stub.Run(run, timeout=60, metadata=authorized)
    assert response.outcome == pb.RunResponse.OK, response.traceback
    assert payload.loads(response.result) == str(marker)
    assert marker.read_text() == "ran"
    assert _predict_and_mark(coordinator, model, tmp_path / "after")[0] == (8, 10)
