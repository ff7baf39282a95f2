"""Tests for `kdist.distribute.server.Server`: validation, lifecycle, and a real ps task."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from kdist.cluster import ClusterSpec, SimpleClusterResolver
from kdist.distribute.server import Server, resolve_bind_address
from kdist.errors import InvalidArgumentError, UnsupportedError

JOIN_TIMEOUT = 10.0
CLUSTER = {"ps": ["127.0.0.1:0", "localhost:2223"], "worker": ["127.0.0.1:2224"]}


# -- Import cost ----------------------------------------------------------------------


def test_import_kdist_distribute_does_not_load_grpc():
    # A fresh interpreter: in this one, other tests have loaded gRPC already.
    code = "import sys, kdist.distribute; print('grpc' in sys.modules)"
    environment = dict(os.environ, KERAS_BACKEND="torch")
    environment["PYTHONPATH"] = os.pathsep.join([os.getcwd(), environment.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, check=False,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"


# -- Validation (nothing is started) --------------------------------------------------


@pytest.mark.parametrize(
    "cluster_spec",
    [CLUSTER, ClusterSpec(CLUSTER), SimpleClusterResolver(ClusterSpec(CLUSTER))],
    ids=["dict", "ClusterSpec", "resolver"],
)
def test_cluster_spec_forms(cluster_spec):
    server = Server(cluster_spec, "ps", 1, start=False)
    assert server.cluster_spec == ClusterSpec(CLUSTER)
    assert (server.job_name, server.task_index) == ("ps", 1)
    assert server.bind_address == "127.0.0.1:2223"
    assert server.port == 2223
    assert server.target == "127.0.0.1:2223"
    assert not server.started


def test_cluster_spec_must_be_a_cluster():
    with pytest.raises(InvalidArgumentError, match=r"Received: cluster_spec=\['ps'\]"):
        Server(["ps"], "ps", 0, start=False)


def test_unknown_job_names_the_jobs():
    with pytest.raises(InvalidArgumentError, match=r"job_name='chief'.*\['ps', 'worker'\]"):
        Server(CLUSTER, "chief", 0, start=False)


@pytest.mark.parametrize("task_index", [2, -1, "0", True, None])
def test_task_index_must_name_a_task(task_index):
    with pytest.raises(InvalidArgumentError, match="task_index"):
        Server(CLUSTER, "ps", task_index, start=False)


@pytest.mark.parametrize("job_name", ["", 3, None])
def test_job_name_must_be_a_string(job_name):
    with pytest.raises(InvalidArgumentError, match="job_name"):
        Server(CLUSTER, job_name, 0, start=False)


def test_chief_and_evaluator_are_not_served():
    cluster = {**CLUSTER, "chief": ["127.0.0.1:2225"], "evaluator": ["127.0.0.1:2226"]}
    for job in ("chief", "evaluator"):
        with pytest.raises(UnsupportedError, match="'ps' and 'worker'"):
            Server(cluster, job, 0, start=False)


def test_worker_server_serves_the_worker_service():
    with Server({"ps": ["127.0.0.1:2223"], "worker": ["127.0.0.1:0"]}, "worker", 0) as server:
        assert server.started and server.port > 0
        assert server.stats()["closures_run"] == 0


def test_task_address_must_be_host_and_port():
    with pytest.raises(InvalidArgumentError, match=r'cluster_spec\["ps"\]\[0\]'):
        Server({"ps": ["no-port"]}, "ps", 0, start=False)


@pytest.mark.parametrize(
    "bind_address, expected",
    [
        (None, "127.0.0.1:2222"),
        ("0.0.0.0", "0.0.0.0:2222"),
        ("0.0.0.0:3333", "0.0.0.0:3333"),
        ("localhost:0", "localhost:0"),
        ("::", "[::]:2222"),
        ("[::]", "[::]:2222"),
        ("[::1]:3333", "[::1]:3333"),
        ("10.0.0.2", "10.0.0.2:2222"),
    ],
)
def test_resolve_bind_address(bind_address, expected):
    assert resolve_bind_address(bind_address, 2222) == expected


@pytest.mark.parametrize("bind_address", ["", " ", 2222, "host:port", "a b", "0.0.0.0:70000"])
def test_bad_bind_address(bind_address):
    with pytest.raises(InvalidArgumentError, match="bind_address"):
        resolve_bind_address(bind_address, 2222)


def test_target_of_a_wildcard_bind_is_loopback():
    server = Server(CLUSTER, "ps", 1, bind_address="0.0.0.0", start=False)
    assert server.bind_address == "0.0.0.0:2223"
    assert server.target == "127.0.0.1:2223"
    server = Server(CLUSTER, "ps", 1, bind_address="::", start=False)
    assert server.target == "[::1]:2223"


def test_options_and_security_types_are_checked():
    with pytest.raises(InvalidArgumentError, match="options="):
        Server(CLUSTER, "ps", 0, options={"max_staleness": 1}, start=False)
    with pytest.raises(InvalidArgumentError, match="security="):
        Server(CLUSTER, "ps", 0, security="token", start=False)
    with pytest.raises(InvalidArgumentError, match="start="):
        Server(CLUSTER, "ps", 0, start="yes")


def test_join_before_start_is_an_error():
    server = Server(CLUSTER, "ps", 0, start=False)
    with pytest.raises(UnsupportedError, match="never started"):
        server.join(timeout=0)
    server.stop()  # Stopping a server that never started is fine.
    assert "stopped" in repr(server)


# -- A real parameter-server task -----------------------------------------------------


def make_client(server, security=None):
    from kdist.ps import ServiceOptions, VariableClient

    options = ServiceOptions(rpc_timeout_seconds=10, connect_timeout_seconds=5)
    return VariableClient(server.target, options=options, security=security)


def test_ps_task_serves_the_variable_service():
    from kdist.ps import VariableInit

    with Server({"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:2224"]}, "ps", 0) as server:
        assert server.started and server.port > 0
        assert server.target == f"127.0.0.1:{server.port}" == server.bind_address
        with make_client(server) as client:
            client.create([VariableInit("w", np.arange(3, dtype="float32"))])
            [state] = client.pull(["w"])
        np.testing.assert_array_equal(state.value, np.arange(3, dtype="float32"))
        assert server.stats().variables["w"].version == 0
        assert server.join(timeout=0.05) is False  # Still serving.
    assert not server.started
    assert server.join(timeout=JOIN_TIMEOUT) is True


def test_join_returns_when_another_thread_stops_the_server():
    server = Server.create_local_server()
    joined = []
    waiter = threading.Thread(target=lambda: joined.append(server.join(timeout=JOIN_TIMEOUT)))
    waiter.start()
    server.stop(grace=0)
    waiter.join(JOIN_TIMEOUT)
    assert joined == [True]
    server.stop()  # Idempotent.
    with pytest.raises(UnsupportedError, match="cannot be started again"):
        server.start()


def test_start_is_explicit_with_start_false_and_idempotent():
    server = Server.create_local_server(start=False)
    assert not server.started and server.port == 0
    server.start()
    port = server.port
    server.start()
    assert server.port == port > 0
    server.stop(grace=0)


def test_wildcard_bind_is_reachable_through_loopback():
    from kdist.ps import VariableInit

    with Server({"ps": ["ps0.example.com:2222"]}, "ps", 0, bind_address="0.0.0.0:0") as server:
        assert server.bind_address == f"0.0.0.0:{server.port}"
        with make_client(server) as client:
            [state] = client.create([VariableInit("w", np.ones(2, dtype="float32"))])
        assert state.version == 0


def test_a_taken_port_is_a_clear_error():
    with Server.create_local_server() as first:
        with pytest.raises(InvalidArgumentError, match="Cannot bind"):
            Server({"ps": [f"127.0.0.1:{first.port}"]}, "ps", 0)


def test_options_and_security_reach_the_service():
    from kdist.errors import UnauthenticatedError
    from kdist.ps import DenseGradient, Security, ServiceOptions, VariableInit

    security = Security(token="server-test-token")
    options = ServiceOptions(max_staleness=0)
    with Server.create_local_server(options=options, security=security) as server:
        with make_client(server, Security.insecure()) as anonymous:
            with pytest.raises(UnauthenticatedError):
                anonymous.create([VariableInit("w", np.zeros(2, dtype="float32"))])
        with make_client(server, security) as client:
            client.create([VariableInit("w", np.zeros(2, dtype="float32"))])
            client.configure_optimizer(
                {"module": "keras.optimizers", "class_name": "SGD",
                 "config": {"learning_rate": 1.0}, "registered_name": None},
                ["w"],
            )
            gradient = np.ones(2, dtype="float32")
            client.push([DenseGradient("w", gradient, version=0)])
            result = client.push([DenseGradient("w", gradient, version=0)])  # staleness 1 > 0
        assert result.rejected == ("w",)
