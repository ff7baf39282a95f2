"""Failures: unreachable or dying servers, oversize messages, a server in another process."""

import re
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kdist.errors import ParameterServerError, ParameterServerUnavailableError
from kdist.ps import DenseGradient, ServiceOptions, VariableClient, VariableInit, create_server
from kdist.ps.options import FRAMING_BYTES
from kdist.ps.wire.methods import METHODS
from kdist.rpc.security import Security
from tests import harness
from tests.ps.conftest import sgd_config

pytestmark = pytest.mark.timeout(120)

FAST_FAIL = ServiceOptions(rpc_timeout_seconds=20, connect_timeout_seconds=0.5)


def test_unreachable_server_is_unavailable_within_the_deadline():
    options = ServiceOptions(rpc_timeout_seconds=1, connect_timeout_seconds=0.5)
    address = f"127.0.0.1:{harness.free_port('127.0.0.1')}"
    start = time.monotonic()
    with VariableClient(address, options=options) as client:
        with pytest.raises(ParameterServerUnavailableError) as caught:
            client.pull(["w"])
    elapsed = time.monotonic() - start
    assert caught.value.retryable and caught.value.address == address
    assert elapsed < 1.5 + 3.0, f"took {elapsed:.1f} s"


def test_wait_until_ready_times_out():
    address = f"127.0.0.1:{harness.free_port('127.0.0.1')}"
    with VariableClient(address) as client:
        start = time.monotonic()
        with pytest.raises(ParameterServerUnavailableError):
            client.wait_until_ready(0.5)
        assert time.monotonic() - start < 3.0


def test_a_stopped_server_fails_fast_through_the_retry_policy():
    server = create_server()
    with VariableClient(server.address, options=FAST_FAIL) as client:
        client.wait_until_ready(10)
        client.health()
        server.stop(0)
        start = time.monotonic()
        with pytest.raises(ParameterServerUnavailableError):
            client.health()
        # Well inside the 20 s deadline: the retry policy gave up (~1.5 s of backoff).
        assert time.monotonic() - start < 8.0


def test_retries_reach_a_server_restarted_on_the_same_port():
    server = create_server()
    address = server.address
    with VariableClient(address, options=FAST_FAIL) as client:
        client.wait_until_ready(10)
        server.stop(0)
        restarted = []
        timer = threading.Timer(0.2, lambda: restarted.append(create_server(address)))
        timer.start()
        try:
            assert client.health()["status"] == "SERVING"
        finally:
            timer.join(10)
            for other in restarted:
                other.stop(0)


def test_oversize_message_is_resource_exhausted_and_the_server_keeps_serving(rng):
    chunk_bytes = 16 << 10
    limits = ServiceOptions(chunk_bytes=chunk_bytes, max_message_bytes=chunk_bytes + FRAMING_BYTES)
    with create_server(options=limits) as server:
        with VariableClient(server.address, options=limits) as client:
            client.create([VariableInit("w", np.zeros(1 << 20, "float32"))])  # 4 MiB, chunked
            client.configure_optimizer(sgd_config(), ["w"])
        # A client whose chunks are bigger than the server accepts.
        greedy = ServiceOptions(chunk_bytes=1 << 20)
        with VariableClient(server.address, options=greedy) as client:
            with pytest.raises(ParameterServerError) as caught:
                client.push([DenseGradient("w", np.ones(1 << 20, "float32"))])
            assert caught.value.code_name == "RESOURCE_EXHAUSTED"
        # A raw oversize unary message.
        with Security().channel(server.address) as channel:
            health = channel.unary_unary(METHODS["Health"].path)
            with pytest.raises(grpc.RpcError) as raw:
                health(b"\x7a" + bytes([0x80, 0x80, 0x10]) + bytes(1 << 18), timeout=10)
            assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with VariableClient(server.address, options=limits) as client:
            [state] = client.pull(["w"])
            assert state.version == 0 and not state.value.any()
            client.push([DenseGradient("w", np.ones(1 << 20, "float32"))])
            assert client.stats().variables["w"].version == 1


def test_garbage_requests_do_not_kill_the_server(server):
    # A peer that proves the secret, so the garbage reaches the deserializers.
    with Security().channel(server.address) as channel:
        for method in METHODS.values():
            if method.request_streaming:
                call = getattr(channel, "stream_" + ("stream" if method.response_streaming
                                                      else "unary"))(method.path)
                request = iter([b"\xff\xff\xff", b"\x12\x05abc"])
            else:
                call = getattr(channel, "unary_" + ("stream" if method.response_streaming
                                                     else "unary"))(method.path)
                request = b"\xff\xff\xff"
            with pytest.raises(grpc.RpcError) as caught:
                response = call(request, timeout=10)
                if method.response_streaming:
                    list(response)
            assert caught.value.code() in (grpc.StatusCode.INTERNAL,
                                           grpc.StatusCode.INVALID_ARGUMENT)
    with VariableClient(server.address) as client:
        assert client.health()["status"] == "SERVING"


SERVE_SCRIPT = Path(__file__).with_name("serve_main.py")


def test_server_in_another_process(rng):
    specs = harness.python_specs([("ps-0", {})], SERVE_SCRIPT, "1")
    with harness.start(specs) as processes:
        assert processes.wait_for_output("ps-0", "PORT ", timeout=60), processes.output("ps-0")
        port = int(re.search(r"PORT (\d+)", processes.output("ps-0")).group(1))
        address = f"127.0.0.1:{port}"
        with VariableClient(address, options=FAST_FAIL) as client:
            client.wait_until_ready(30)
            value = rng.standard_normal((300, 300)).astype("float32")
            client.create([VariableInit("w", value)])
            client.configure_optimizer(sgd_config(0.5), ["w"])
            client.push([DenseGradient("w", np.ones_like(value), version=0)])
            [state] = client.pull(["w"])
            np.testing.assert_allclose(state.value, value - 0.5, atol=1e-6)
            # max_staleness=1 was passed on the command line.
            client.push([DenseGradient("w", np.ones_like(value), version=1)])
            assert client.push([DenseGradient("w", np.ones_like(value), 0)]).rejected == ("w",)
            processes.send_signal("ps-0", signal.SIGKILL)
            assert processes.wait_for_exit("ps-0", timeout=30) == -signal.SIGKILL
            with pytest.raises(ParameterServerUnavailableError):
                client.pull(["w"])
