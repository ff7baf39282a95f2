"""A worker's step calls its servers one call after another: no call may cost a thread start.

grpcio reads a future or a response stream on a channel thread that it starts
when the channel has no call in flight and ends with the last one: with
sequential calls, a thread start per call. `VariableClient` reads every
single-message call in the calling thread instead (`SingleThreadedUnaryStream`;
unary methods answered as a stream of one message).
"""

import gc
import threading

import numpy as np
import pytest

from kdist.errors import ParameterServerError
from kdist.ps import DenseGradient, RowGradient, ServiceOptions, VariableClient, VariableInit, create_server
from kdist.ps.client import retry as client_retry
from kdist.ps.client import variable_client as client_module
from tests.ps.conftest import sgd_config

pytestmark = pytest.mark.timeout(120)

# Name prefix of the in-process server's threads (`kdist.ps.server.variable_server`, `kdist.ps.server.stream_guard`).
_SERVER_THREADS = "kdist-ps"


class _ThreadStarts:
    """Records the `threading.Thread.start` calls made from this (the test's) thread while active.

    The client's calls run in the calling thread, and grpcio starts its channel
    thread from there too (the negative control). Threads other code starts
    from its own threads are not the client's and are not counted: the
    in-process server's handler pool (threads named `kdist-ps_N`, grown on
    demand on a loaded machine), its stream guard, and whatever an earlier test
    in this process left running.
    """

    def __init__(self, monkeypatch):
        self.started = []
        caller = threading.current_thread()
        original = threading.Thread.start

        def start(thread):
            if threading.current_thread() is caller and not thread.name.startswith(_SERVER_THREADS):
                self.started.append(thread.name)
            return original(thread)

        monkeypatch.setattr(threading.Thread, "start", start)

    @property
    def count(self):
        return len(self.started)


@pytest.fixture
def server():
    server = create_server(options=_OPTIONS)
    yield server
    server.stop(0)


# Default chunks: every request here is one message.
_OPTIONS = ServiceOptions(rpc_timeout_seconds=30, connect_timeout_seconds=10)


def _client(server):
    client = VariableClient(server.address, options=_OPTIONS)
    client.create([VariableInit("w", np.zeros((8, 4), "float32")),
                   VariableInit("table", np.zeros((100, 4), "float32"))])
    client.configure_optimizer(sgd_config(0.1), ["w", "table"])
    return client


def _step(client, ids):
    client.pull(["w"])
    [(rows, _)] = client.lookup([("table", ids)])
    client.push([DenseGradient("w", np.ones((8, 4), "float32")),
                 RowGradient("table", ids, np.ones_like(rows))])


def _thread_starts_of_ten_steps(client, monkeypatch):
    ids = np.array([3, 7, 7, 42])
    for _ in range(3):  # warm: the server's pool and guard threads exist
        _step(client, ids)
    # Objects an earlier test left are collected now, not by a collection that
    # would run their finalizers in this thread during the counted steps.
    gc.collect()
    starts = _ThreadStarts(monkeypatch)
    gc.disable()
    try:
        for _ in range(10):
            _step(client, ids)
    finally:
        gc.enable()
    return starts


def test_a_step_of_pull_lookup_and_push_starts_no_thread(server, monkeypatch):
    with _client(server) as client:
        starts = _thread_starts_of_ten_steps(client, monkeypatch)
        assert starts.count == 0, f"threads started by ten steps: {starts.started}"
        [state] = client.pull(["w"])
    np.testing.assert_allclose(state.value, np.full((8, 4), -0.1 * 13, "float32"), rtol=1e-6)


def test_negative_control_grpcio_threads_are_counted_without_the_channel_option(server, monkeypatch):
    # The same client on a channel without SingleThreadedUnaryStream: grpcio's
    # channel thread starts for its calls, and the counter sees it.
    monkeypatch.setattr(client_module, "CALLING_THREAD_OPTIONS", ())
    with _client(server) as client:
        assert _thread_starts_of_ten_steps(client, monkeypatch).count >= 10


@pytest.mark.parametrize("messages", [[], ["a", "b"]])
def test_a_unary_answer_of_other_than_one_message_is_a_typed_error(messages):
    class Client:
        address = "127.0.0.1:1"

    read = client_retry._only_message(Client(), "Push", None)
    with pytest.raises(ParameterServerError, match="answered Push with .* message") as caught:
        read(iter(messages))
    assert caught.value.code_name == "INTERNAL" and caught.value.address == "127.0.0.1:1"
    assert client_retry._only_message(Client(), "Push", lambda response: response * 2)(["a"]) == "aa"
