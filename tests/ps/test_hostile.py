"""The variable service under hostile load: stalled streams, bad batches, huge errors.

Each test runs a real server on loopback and talks to it with the real client or
with raw gRPC calls made from the generated stubs (requests no kdist client
would send). A refused request must change nothing: values, versions,
optimizer slots, and the bookkeeping that makes retried pushes exactly-once.
"""

import logging
import re
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kdist.errors import ParameterServerError
from kdist.ps import (
    ServiceOptions,
    VariableClient,
    VariableInit,
    create_server,
)
from kdist.ps.server.stream_guard import StreamGuard
from kdist.ps.wire._generated import variable_service_pb2 as pb
from kdist.ps.wire._generated import variable_service_pb2_grpc as pb_grpc
from kdist.ps.wire.status import MAX_DETAIL_BYTES
from kdist.rpc.security import Security
from tests import harness

pytestmark = pytest.mark.timeout(120)

IDLE_SECONDS = 2.0
# Health must answer within this while every stream slot is stalled.
HEALTH_DEADLINE = 3.0
STALL_SECONDS = 60.0  # how long a stalled client would wait: far past the test
NUM_CANCELLED_STREAMS = 5


def wait_until(predicate, timeout, what, state=lambda: None):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, (
            f"timed out after {timeout} s waiting for {what}; state: {state()}")
        time.sleep(0.02)


# -- Stalled streams ---------------------------------------------------------------------


@pytest.fixture
def guarded_server():
    # 8 threads: 4 stream slots (4 threads kept for unary calls), 2 per peer.
    # Without the cluster secret, so that raw gRPC calls reach the service: a
    # buggy or hostile client that holds the secret gets exactly this far.
    options = ServiceOptions(max_workers=8, max_streams_per_peer=2,
                             stream_idle_seconds=IDLE_SECONDS, rpc_timeout_seconds=30,
                             connect_timeout_seconds=10)
    security = Security.insecure()
    server = create_server(options=options, security=security)
    yield server, options, security
    server.stop(0)


def stalled_push(release):
    """A push that sends its header, then nothing until `release` is set."""
    yield pb.PushRequest(header=pb.PushHeader(update_id="stalled"))
    release.wait(STALL_SECONDS)


def stalled_lookup(release):
    yield pb.LookupRequest(header=pb.LookupHeader())
    release.wait(STALL_SECONDS)


def open_stalled_streams(address, release, num_channels, per_channel):
    """Opens `num_channels * per_channel` stalled streams (pushes and lookups)."""
    channels, calls = [], []
    for _ in range(num_channels):
        # A local subchannel pool: each channel its own connection, so its own peer.
        channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        stub = pb_grpc.VariableServiceStub(channel)
        channels.append(channel)
        for index in range(per_channel):
            if index % 2:
                calls.append(stub.Push.future(stalled_push(release), timeout=STALL_SECONDS))
            else:
                lookup = stub.Lookup(stalled_lookup(release), timeout=STALL_SECONDS)
                calls.append(lookup)
    return channels, calls


def call_code(call, timeout):
    """Waits for `call` (a push future or a lookup stream) to end; returns its status code."""
    call.exception(timeout=timeout)
    return call.code()


def health_seconds(address):
    started = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        response = pb_grpc.VariableServiceStub(channel).Health(pb.HealthRequest(),
                                                                timeout=HEALTH_DEADLINE)
    assert response.status == "SERVING"
    return time.monotonic() - started


def test_stalled_streams_cannot_starve_the_server(guarded_server):
    server, options, security = guarded_server
    guard = server._servicer.guard
    assert (guard.stream_limit, guard.peer_limit) == (4, 2) and options.max_workers == 8
    release = threading.Event()
    # 12 stalled streams from 4 channels, more than the server's 8 threads.
    channels, calls = open_stalled_streams(server.address, release, 4, 3)
    try:
        wait_until(lambda: (guard.num_streams == 4 and guard.num_refused == 8
                            and sum(call.done() for call in calls) == 8), 10,
                   "4 streams admitted and 8 refused",
                   lambda: (guard.num_streams, guard.num_refused))
        refused = [call for call in calls if call.done()]
        assert len(refused) == 8
        details = []
        for call in refused:
            assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details.append(call.details())
        assert any("max_streams_per_peer=2" in detail for detail in details), details
        assert all("max_streams_per_peer=2" in detail or "max_concurrent_streams=4" in detail
                   for detail in details), details
        # Health and Stats are answered at once; a real client's streaming call waits its turn.
        assert health_seconds(server.address) < HEALTH_DEADLINE
        with VariableClient(server.address, options=options, security=security) as client:
            assert client.stats().requests["push"] >= 1
            # A real client's streaming call waits for a slot (it is retried within
            # its deadline) and is served once the stalled streams are cancelled.
            waited = time.monotonic()
            with pytest.raises(ParameterServerError) as caught:
                client.pull(["anything"])
            assert caught.value.code_name == "NOT_FOUND"  # served: no such variable
            assert guard.num_refused > 8 and time.monotonic() - waited < IDLE_SECONDS + 5
            # The stalled streams are cancelled after the idle timeout...
            started = time.monotonic()
            codes = [call_code(call, IDLE_SECONDS + 10) for call in calls if call not in refused]
            assert codes == [grpc.StatusCode.CANCELLED] * 4
            assert time.monotonic() - started < IDLE_SECONDS + 5
            wait_until(lambda: guard.num_streams == 0, 10, "every slot released")
            assert guard.num_idle_cancelled == 4
            # ...and the server serves streams again; the stalled pushes applied nothing.
            client.create([VariableInit("w", np.zeros(3, "float32"))])
            [state] = client.pull(["w"])
            assert state.version == 0 and client.stats().deduplicated_updates == 0
    finally:
        release.set()
        for channel in channels:
            channel.close()


def test_a_client_that_stops_reading_a_pull_is_cancelled(guarded_server):
    server, options, security = guarded_server
    guard = server._servicer.guard
    big = np.ones(16 << 20, "float32")  # 64 MiB: far more than gRPC's flow-control windows
    with VariableClient(server.address, options=options, security=security) as client:
        client.create([VariableInit("big", big)])
    with grpc.insecure_channel(server.address) as channel:
        pull = pb_grpc.VariableServiceStub(channel).Pull(pb.PullRequest(names=["big"]),
                                                         timeout=STALL_SECONDS)
        next(pull)  # then stops reading: the server's sends block
        started = time.monotonic()
        wait_until(lambda: guard.num_idle_cancelled == 1, IDLE_SECONDS + 10,
                   "the stalled pull to be cancelled")
        assert time.monotonic() - started < IDLE_SECONDS + 5
        wait_until(lambda: guard.num_streams == 0, 10, "its slot to be released")
        with pytest.raises(grpc.RpcError) as caught:
            list(pull)
        assert caught.value.code() == grpc.StatusCode.CANCELLED
    assert health_seconds(server.address) < HEALTH_DEADLINE


def test_negative_control_unbounded_streams_starve_health(guarded_server):
    server, _, _ = guarded_server
    # The deliberate bug: no slots and no idle timeout. Then 12 stalled
    # streams hold all 8 threads, and Health is not answered.
    server._servicer.guard = StreamGuard(stream_limit=10**6, peer_limit=10**6,
                                         idle_seconds=3600.0)
    release = threading.Event()
    channels, _ = open_stalled_streams(server.address, release, 4, 3)
    try:
        wait_until(lambda: server._servicer.guard.num_streams == 8, 10, "8 stalled streams")
        with pytest.raises(grpc.RpcError) as caught:
            health_seconds(server.address)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        release.set()
        for channel in channels:
            channel.close()


def test_a_cancelled_stream_logs_one_line(guarded_server, caplog):
    server, _, _ = guarded_server
    guard = server._servicer.guard
    release = threading.Event()
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.VariableServiceStub(channel)
        for _ in range(NUM_CANCELLED_STREAMS):
            future = stub.Push.future(stalled_push(release), timeout=STALL_SECONDS)
            wait_until(lambda: guard.num_streams == 1, 10, "the push to start")
            future.cancel()  # the client gives up mid-stream
            wait_until(lambda: guard.num_streams == 0, 10, "the cancelled push to end")
        idle = stub.Push.future(stalled_push(release), timeout=STALL_SECONDS)
        assert call_code(idle, IDLE_SECONDS + 10) == grpc.StatusCode.CANCELLED
        wait_until(lambda: guard.num_streams == 0, 10, "the idle push to end")
    release.set()
    records = [record for record in caplog.records if record.name.startswith("kdist")]
    warnings = [record for record in records if record.levelno == logging.WARNING]
    infos = [record for record in records if record.levelno == logging.INFO]
    assert len(warnings) == 1 and "stream_idle_seconds" in warnings[0].getMessage()
    # One line per cancelled stream at most: gRPC sometimes ends a cancelled
    # request stream like a complete one, and the push then ends without a word.
    assert 1 <= len(infos) <= NUM_CANCELLED_STREAMS and len(records) == len(infos) + 1
    assert all("Push" in record.getMessage() and "cancelled" in record.getMessage()
               for record in infos)
    assert not any(record.exc_info for record in caplog.records), "a traceback was logged"


# -- Create is all-or-nothing ------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    VariableInit("steps", np.zeros((), "int64"), trainable=True),
    VariableInit("mask", np.ones(4, bool), trainable=True),
])
def test_create_with_a_bad_variable_creates_nothing(client, bad):
    client.create([VariableInit("existing", np.ones(2, "float32"))])
    before = client.stats()
    with pytest.raises(ParameterServerError) as caught:
        client.create([VariableInit("kernel", np.ones((3, 3), "float32")),
                       VariableInit("bias", np.zeros(3, "float32")), bad])
    assert caught.value.code_name == "INVALID_ARGUMENT"
    assert repr(bad.name) in caught.value.detail and "floating-point" in caught.value.detail
    after = client.stats()
    assert sorted(after.variables) == sorted(before.variables) == ["existing"]
    for name in ("kernel", "bias", bad.name):
        with pytest.raises(ParameterServerError) as caught:
            client.pull([name])
        assert caught.value.code_name == "NOT_FOUND"
    # The same variable, not trainable, is fine; the good ones then create.
    client.create([VariableInit("kernel", np.ones((3, 3), "float32")),
                   VariableInit(bad.name, bad.value, trainable=False)])
    assert sorted(client.stats().variables) == sorted(["existing", "kernel", bad.name])


# -- Errors name what failed without echoing the request -----------------------------------


def test_pulling_thousands_of_unknown_names_gets_a_short_not_found(client):
    client.create([VariableInit("w", np.zeros(3, "float32"))])
    names = [f"layer_{index}/kernel_with_a_long_descriptive_name" for index in range(2000)]
    with pytest.raises(ParameterServerError) as caught:
        client.pull(names)
    detail = caught.value.detail
    assert caught.value.code_name == "NOT_FOUND"
    assert len(detail.encode()) <= MAX_DETAIL_BYTES + 100
    assert names[0] in detail and "and 1990 more" in detail and names[-1] not in detail


def test_huge_names_and_duplicates_are_not_echoed(client):
    huge = "w" * 100_000
    names = [huge] + [f"v{index}" for index in range(3000)] * 2
    with pytest.raises(ParameterServerError) as caught:
        client.create([VariableInit(name, np.zeros(1, "float32")) for name in names])
    assert caught.value.code_name == "INVALID_ARGUMENT"
    assert len(caught.value.detail.encode()) <= MAX_DETAIL_BYTES + 100
    assert "and 2990 more" in caught.value.detail
    with pytest.raises(ParameterServerError) as caught:
        client.pull([huge])
    assert caught.value.code_name == "NOT_FOUND"
    assert "(100000 characters)" in caught.value.detail
    assert len(caught.value.detail.encode()) <= MAX_DETAIL_BYTES + 100
    assert len(client.stats().variables) == 0


# -- A full disk ---------------------------------------------------------------------------

DISK_LIMITED_SCRIPT = Path(__file__).with_name("serve_disk_limited_main.py")
MAX_FILE_BYTES = 64 << 10
TEST_SECRET = "hostile-load-test-secret"


@pytest.fixture
def disk_limited_client():
    """A client of a server in another process whose files may not grow past 64 KiB."""
    specs = harness.python_specs([("ps-0", {"KDIST_SECRET": TEST_SECRET})],
                                 DISK_LIMITED_SCRIPT, str(MAX_FILE_BYTES))
    options = ServiceOptions(rpc_timeout_seconds=30, connect_timeout_seconds=10)
    with harness.start(specs) as processes:
        assert processes.wait_for_output("ps-0", "PORT ", timeout=60), processes.output("ps-0")
        port = int(re.search(r"PORT (\d+)", processes.output("ps-0")).group(1))
        with VariableClient(f"127.0.0.1:{port}", options=options,
                            security=Security(token=TEST_SECRET)) as client:
            client.wait_until_ready(30)
            yield client
        assert processes.returncodes["ps-0"] is None, processes.output("ps-0")


def check_full_disk_refusal(client, directory, new_variables):
    small = np.arange(100, dtype="float32")
    client.create([VariableInit("small", small)])
    client.save(str(directory))  # fits
    client.create(new_variables)
    with pytest.raises(ParameterServerError) as caught:
        client.save(str(directory))
    assert caught.value.code_name == "RESOURCE_EXHAUSTED", caught.value
    assert "checkpoint" in caught.value.detail
    # The server carries on, with its state; the earlier checkpoint still restores.
    assert client.health()["status"] == "SERVING"
    for item in new_variables[:3]:
        [state] = client.pull([item.name])
        np.testing.assert_array_equal(state.value, item.value)
    client.restore(str(directory))
    [state] = client.pull(["small"])
    np.testing.assert_array_equal(state.value, small)


def test_a_full_disk_is_resource_exhausted(disk_limited_client, tmp_path):
    # 600 small variables: each array file fits, the manifest (~100 KiB) does not.
    new = [VariableInit(f"layer_{index}/a_long_kernel_name_for_the_manifest",
                        np.full(2, index, "float32")) for index in range(600)]
    check_full_disk_refusal(disk_limited_client, tmp_path / "checkpoint", new)


def test_a_full_disk_while_writing_an_array_is_resource_exhausted(disk_limited_client,
                                                                  tmp_path):
    big = np.ones(MAX_FILE_BYTES, "float32")  # 4x the file-size limit
    check_full_disk_refusal(disk_limited_client, tmp_path / "checkpoint",
                            [VariableInit("big", big)])
