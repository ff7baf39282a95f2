"""Load held: the job's own concurrency is never refused (issue 24, point 7).

A server refuses a streaming call for which it has no slot before reading any
of it (`kdist.ps.server.stream_guard`), and kdist's client sends it again after a
jittered backoff within the call's deadline (`kdist.ps.client.retry`). The
per-client bound counts authenticated sessions, not connections. Every test
runs real servers and clients on loopback; the 32 workers are real processes.
"""

import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kdist.errors import ParameterServerError
from kdist.ps import DenseGradient, Security, ServiceOptions, VariableClient, VariableInit, create_server
from kdist.ps.client import retry as client_retry
from kdist.ps.client.payload import encode_gradient
from kdist.ps.server import stream_guard
from kdist.ps.wire._generated import variable_service_pb2 as pb
from kdist.ps.wire._generated import variable_service_pb2_grpc as pb_grpc
from tests import harness
from tests.ps.conftest import sgd_config

pytestmark = pytest.mark.timeout(180)

TOKEN = "load-held-test-secret"
NUM_THREADS = 16
PUSHES = 5
SIZE = 3000  # 12 KB: a request stream of 13 messages of 1000 bytes
PUSH_LOAD_MAIN = Path(__file__).with_name("push_load_main.py")


def held_options(**kwargs):
    """The default stream bounds (16 threads: 12 slots, 8 per client) unless overridden."""
    return ServiceOptions(**{"chunk_bytes": 1000, "rpc_timeout_seconds": 45,
                             "connect_timeout_seconds": 20, **kwargs})


@pytest.fixture
def load_server():
    options = held_options()
    server = create_server(options=options, security=Security(token=TOKEN))
    with VariableClient(server.address, options=options, security=Security(token=TOKEN)) as setup:
        setup.create([VariableInit("w", np.zeros(SIZE, "float32"))])
        setup.configure_optimizer(sgd_config(1.0), ["w"])
    yield server, options
    server.stop(0)


def check_applied_exactly_once(server, num_pushes, gradient_sum):
    """Every push applied once, every repeat deduplicated, and the value says so (SGD(1.0))."""
    stats = server.stats()
    assert stats.applied_pushes == num_pushes, stats
    assert stats.variables["w"].applied_updates == num_pushes
    assert stats.variables["w"].version == num_pushes
    assert stats.deduplicated_updates == num_pushes  # each push was sent twice
    with VariableClient(server.address, options=held_options(),
                        security=Security(token=TOKEN)) as client:
        [state] = client.pull(["w"])
    # Sums of small integers are exact in float32: a lost or doubled push shows.
    np.testing.assert_array_equal(state.value, np.full(SIZE, -gradient_sum, "float32"))


def push_from_threads(server, options, shared):
    """16 threads push PUSHES times each, every push twice with one update id; returns errors."""
    errors, barrier = [], threading.Barrier(NUM_THREADS)
    security = Security(token=TOKEN)
    shared_client = VariableClient(server.address, options=options, security=security) if shared else None

    def work(index):
        client = shared_client or VariableClient(server.address, options=options, security=security)
        try:
            client.health(timeout=20)
            barrier.wait(timeout=60)
            gradient = [DenseGradient("w", np.full(SIZE, index + 1, "float32"))]
            for step in range(PUSHES):
                client.push(gradient, update_id=f"thread-{index}/{step}")
                client.push(gradient, update_id=f"thread-{index}/{step}")
        except Exception as error:  # noqa: BLE001 — collected, asserted by the caller
            errors.append(error)
        finally:
            if not shared:
                client.close()

    threads = [threading.Thread(target=work, args=(index,)) for index in range(NUM_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a pushing thread hung"
    if shared_client is not None:
        shared_client.close()
    return errors


@pytest.mark.parametrize("shared", [False, True], ids=["a-client-per-thread", "one-shared-client"])
def test_sixteen_threads_of_one_process_apply_every_push_once(load_server, shared):
    server, options = load_server
    errors = push_from_threads(server, options, shared)
    assert not errors, errors[:3]
    check_applied_exactly_once(server, NUM_THREADS * PUSHES,
                               PUSHES * sum(range(1, NUM_THREADS + 1)))
    if shared:
        # 16 threads on one client, 8 slots per client: the load did pass the
        # bound, and the refusals were waited out.
        assert server._servicer.guard.num_refused > 0


def test_negative_control_a_client_that_does_not_retry_is_refused(load_server, monkeypatch):
    # Today's bug, put back: refused slots are not retried. The same load fails.
    monkeypatch.setattr(client_retry, "_slot_refused", lambda error: False)
    server, options = load_server
    errors = push_from_threads(server, options, shared=True)
    assert errors, "no push was refused: this load does not exercise the stream bounds"
    for error in errors:
        assert isinstance(error, ParameterServerError) and error.code_name == "RESOURCE_EXHAUSTED"
        assert "max_streams_per_peer=8" in str(error) or "max_concurrent_streams=12" in str(error)


def test_thirty_two_worker_processes_apply_every_push_once(load_server):
    server, _ = load_server
    num_workers, pushes = 32, 4
    specs = harness.python_specs([("pushers", {})], PUSH_LOAD_MAIN, server.address, TOKEN,
                                 num_workers, pushes, SIZE)
    started = time.monotonic()
    result = harness.run(specs, timeout=90).check()
    assert "ALL OK" in result.output("pushers", "stdout")
    check_applied_exactly_once(server, num_workers * pushes, pushes * sum(range(1, num_workers + 1)))
    print(f"32 processes: {time.monotonic() - started:.1f} s, "
          f"{server._servicer.guard.num_refused} slot refusals waited out")


# -- Slots held by stalled streams ------------------------------------------------------------


def stalled_push(release):
    yield pb.PushRequest(header=pb.PushHeader(update_id="stalled"))
    release.wait(60)


def stall_every_slot(address, release, num_streams):
    """Opens `num_streams` header-only pushes, each on its own connection."""
    channels, calls = [], []
    for _ in range(num_streams):
        channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        channels.append(channel)
        calls.append(pb_grpc.VariableServiceStub(channel).Push.future(stalled_push(release), timeout=60))
    return channels, calls


@pytest.fixture
def stalled_server(request):
    """An insecure server with 4 slots, every one taken by a stalled stream; idle timeout as parametrized."""
    options = held_options(max_workers=8, max_streams_per_peer=2, stream_idle_seconds=request.param)
    server = create_server(options=options, security=Security.insecure())
    with VariableClient(server.address, options=options, security=Security.insecure()) as setup:
        setup.create([VariableInit("w", np.zeros(SIZE, "float32"))])
        setup.configure_optimizer(sgd_config(1.0), ["w"])
    release = threading.Event()
    channels, _ = stall_every_slot(server.address, release, 4)
    guard = server._servicer.guard
    deadline = time.monotonic() + 20
    while guard.num_streams < 4:
        assert time.monotonic() < deadline, "the stalled streams were not admitted"
        time.sleep(0.02)
    yield server, options
    release.set()
    for channel in channels:
        channel.close()
    server.stop(0)


@pytest.mark.parametrize("stalled_server", [2.0], indirect=True)
def test_a_push_waits_for_a_slot_and_is_applied_once(stalled_server):
    server, options = stalled_server
    guard = server._servicer.guard
    done, outcome = threading.Event(), []
    with VariableClient(server.address, options=options, security=Security.insecure()) as client:
        client.health()  # connected: the push's deadline is rpc_timeout_seconds alone

        def push():
            try:  # no update id: safe to resend only because a refused call was never read
                outcome.append(client.push([DenseGradient("w", np.ones(SIZE, "float32"))]))
            except Exception as error:  # noqa: BLE001 — asserted below
                outcome.append(error)
            done.set()

        started = time.monotonic()
        threading.Thread(target=push, daemon=True).start()
        assert not done.wait(0.5), f"the push ended while every slot was held: {outcome}"
        assert guard.num_refused >= 1 and client.health(timeout=5)["status"] == "SERVING"
        # The guard cancels the stalled streams after 2 s; the push then gets a slot.
        assert done.wait(20), "the push did not get a slot once the stalled streams were cancelled"
        assert time.monotonic() - started < 15
    assert not isinstance(outcome[0], Exception), outcome
    stats = server.stats()
    assert stats.applied_pushes == 1 and stats.variables["w"].version == 1
    assert guard.num_idle_cancelled == 4


@pytest.mark.parametrize("stalled_server", [60.0], indirect=True)
def test_no_slot_within_the_deadline_is_a_typed_error(stalled_server):
    server, options = stalled_server
    short = held_options(rpc_timeout_seconds=1.5, connect_timeout_seconds=0)
    with VariableClient(server.address, options=short, security=Security.insecure()) as client:
        started = time.monotonic()
        with pytest.raises(ParameterServerError) as caught:
            client.push([DenseGradient("w", np.ones(SIZE, "float32"))], update_id="late")
        elapsed = time.monotonic() - started
    assert caught.value.code_name == "RESOURCE_EXHAUSTED"
    assert "max_concurrent_streams=4" in caught.value.detail
    assert "deadline (1.5 s)" in caught.value.detail and "refused" in caught.value.detail
    assert 1.0 < elapsed < 1.5 + 2.0, elapsed
    assert server.stats().applied_pushes == 0


def test_a_message_over_the_size_limit_is_not_retried():
    # RESOURCE_EXHAUSTED that is not a refused slot (here gRPC's size limit; a
    # full memory or disk alike) is the caller's to fix: it fails at once.
    server_options = held_options(max_message_bytes=(64 << 10) + 1000)
    server = create_server(options=server_options, security=Security(token=TOKEN))
    try:
        client_options = ServiceOptions(chunk_bytes=1 << 20, rpc_timeout_seconds=30,
                                        connect_timeout_seconds=20)
        with VariableClient(server.address, options=client_options, security=Security(token=TOKEN)) as client:
            client.create([VariableInit("big", np.zeros(100, "float32"))])
            client.health()
            started = time.monotonic()
            with pytest.raises(ParameterServerError) as caught:
                client.create([VariableInit("huge", np.zeros(64 << 10, "float32"))])  # one 256 KiB message
            assert caught.value.code_name == "RESOURCE_EXHAUSTED"
            assert time.monotonic() - started < 5.0
        assert server._servicer.guard.num_refused == 0
    finally:
        server.stop(0)


# -- What the per-client bound counts -------------------------------------------------------------


def hold_a_stream(client, release, errors):
    """Sends the first 2 messages of a real push, then nothing until `release` (the server waits)."""
    meta, payload = encode_gradient(DenseGradient("w", np.ones(SIZE, "float32")))
    header = pb.PushHeader(gradients=[meta], update_id=f"held-{id(client)}")

    def stream():  # a fresh stream per attempt
        messages = client._stream(header, payload)
        yield next(messages)
        yield next(messages)
        release.wait(60)  # then ends short: refused as truncated, nothing applied

    try:
        client._call("Push", stream, retry=False)
    except ParameterServerError as error:
        errors.append(error)


@pytest.mark.parametrize("count_connections", [False, True], ids=["sessions", "negative-control-connections"])
def test_clients_of_one_process_are_counted_apart(count_connections, monkeypatch):
    if count_connections:  # the old count: every channel of a process is one peer
        monkeypatch.setattr(stream_guard, "client_key", lambda context: context.peer())
    options = held_options(max_streams_per_peer=1)
    server = create_server(options=options, security=Security(token=TOKEN))
    guard, release, errors, threads = server._servicer.guard, threading.Event(), [], []
    clients = [VariableClient(server.address, options=options, security=Security(token=TOKEN))
               for _ in range(2)]
    try:
        clients[0].create([VariableInit("w", np.zeros(SIZE, "float32"))])
        clients[0].configure_optimizer(sgd_config(1.0), ["w"])
        for client in clients:
            client.health()
            threads.append(threading.Thread(target=hold_a_stream, args=(client, release, errors)))
            threads[-1].start()
        deadline = time.monotonic() + 10
        while guard.num_streams < 2 and guard.num_refused == 0:
            assert time.monotonic() < deadline, "the held streams were not admitted"
            time.sleep(0.02)
        time.sleep(0.3)
        with guard._condition:
            peers = {call.peer for call in guard._calls}
        assert len(peers) == 1, f"the two clients do not share one connection: {peers}"
        if count_connections:
            assert guard.num_refused >= 1 and guard.num_streams == 1
        else:
            assert guard.num_refused == 0 and guard.num_streams == 2
        release.set()
        for thread in threads:
            thread.join(timeout=60)
        assert [error.code_name for error in errors] == ["INVALID_ARGUMENT"] * 2, errors
        assert server.stats().applied_pushes == 0
    finally:
        release.set()
        for client in clients:
            client.close()
        server.stop(0)
