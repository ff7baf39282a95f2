"""Fuzzing the variable service: 1,000 malformed requests, then a correct pull.

Three kinds of garbage reach one real server on loopback:

1. random bytes sent as raw gRPC messages to every method of the service
   (paths and streaming kinds from the generated descriptor; identity
   serializers), some of them shaped like the framing the codec parses by hand;
2. well-formed protobuf messages of the real request types whose contents are
   wrong: unsupported dtypes, shapes that disagree with the payload, negative
   and huge dimensions, unknown names, out-of-range row ids, hostile optimizer
   configs, damaged checkpoints, NaN and infinite gradients, creates that mix
   valid variables with one that may not be created. Every such request has at
   least one defect, so none may change or create a variable (a request that
   mixes a valid update with a bad one must change nothing either);
3. garbage bytes on the raw TCP port, some after a valid HTTP/2 preface, some
   connections left open until the end.

Afterwards the server still answers, every variable has its old value and
version, and no call got a status that means the server lost track
(`UNKNOWN`, `DEADLINE_EXCEEDED`) or, for well-formed messages, an unexpected
exception (`INTERNAL`). The seed is fixed; a failure message names the request.
"""

import random
import socket

import grpc
import numpy as np
import pytest

from kdist.ps import ServiceOptions, VariableClient, VariableInit, create_server
from kdist.ps.options import FRAMING_BYTES
from kdist.rpc.security import Security
from tests.ps.fuzz_requests import (
    CHUNK_BYTES,
    SERVICE,
    SGD,
    VARIABLES,
    damaged_checkpoints,
    proto_calls,
    random_raw_calls,
)

SEED = 4_2024
NUM_RAW_MESSAGE_CALLS = 440
NUM_PROTO_CALLS = 440
# Calls without the proof of the secret: every one refused (UNAUTHENTICATED).
NUM_STRANGER_CALLS = 200
NUM_TCP_CONNECTIONS = 120
NUM_IDLE_CONNECTIONS = 8
CALL_TIMEOUT = 5.0
SOCKET_TIMEOUT = 2.0
MAX_MESSAGE_BYTES = CHUNK_BYTES + FRAMING_BYTES
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Statuses a well-formed but wrong request may get; anything else is a server bug.
EXPECTED_REFUSALS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
# Raw bytes may also fail to parse: gRPC answers INTERNAL ("Exception
# deserializing request") before any servicer code runs.
EXPECTED_FOR_RAW_BYTES = EXPECTED_REFUSALS | {grpc.StatusCode.INTERNAL}


# -- Calls --------------------------------------------------------------------------


def call_raw(channel, method, messages):
    """Sends `messages` (bytes) to `method`; returns the status code."""
    path = f"/{SERVICE.full_name}/{method.name}"
    streaming_in, streaming_out = method.client_streaming, method.server_streaming
    try:
        if streaming_in and streaming_out:
            list(channel.stream_stream(path)(iter(messages), timeout=CALL_TIMEOUT))
        elif streaming_in:
            channel.stream_unary(path)(iter(messages), timeout=CALL_TIMEOUT)
        elif streaming_out:
            list(channel.unary_stream(path)(messages[0], timeout=CALL_TIMEOUT))
        else:
            channel.unary_unary(path)(messages[0], timeout=CALL_TIMEOUT)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


# -- Raw TCP ------------------------------------------------------------------------


def tcp_garbage(port, rng, count, idle):
    """Sends garbage on `count` connections; returns `idle` still-open sockets."""
    kept = []
    for index in range(count + idle):
        connection = socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT)
        style = index % 4
        data = bytes(rng.getrandbits(8) for _ in range(rng.choice([1, 9, 100, 4000])))
        if style == 1:
            data = HTTP2_PREFACE + data
        elif style == 2:  # a valid preface, then a frame header claiming 16 MiB
            data = HTTP2_PREFACE + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01" + data
        elif style == 3:
            data = HTTP2_PREFACE[: rng.randrange(1, len(HTTP2_PREFACE))]
        try:
            connection.sendall(data)
        except OSError:
            pass  # The server may close first: that is a fine answer to garbage.
        if index < count:
            connection.close()
        else:
            kept.append(connection)
    return kept


# -- The test -----------------------------------------------------------------------


@pytest.fixture
def fuzz_server(tmp_path, monkeypatch):
    # Relative checkpoint paths land here, never in the repository.
    monkeypatch.chdir(tmp_path)
    options = ServiceOptions(chunk_bytes=CHUNK_BYTES, max_message_bytes=MAX_MESSAGE_BYTES,
                             rpc_timeout_seconds=CALL_TIMEOUT, connect_timeout_seconds=10,
                             max_workers=4)
    server = create_server(options=options)
    client = VariableClient(server.address, options=options)
    yield server, client
    client.close()
    server.stop(0)


def snapshot(client):
    return {state.name: (state.value, state.version) for state in client.pull(list(VARIABLES))}


@pytest.mark.timeout(120)
def test_server_survives_malformed_requests(fuzz_server, tmp_path):
    server, client = fuzz_server
    rng = random.Random(SEED)
    client.create([VariableInit(name, value, trainable) for name, (value, trainable)
                   in VARIABLES.items()])
    client.configure_optimizer(SGD, ["weights", "embedding"])
    before = snapshot(client)
    restore_directories = damaged_checkpoints(client, tmp_path / "checkpoints")
    save_directories = ["\0bad", str(tmp_path / "file"), "/proc/kdist-fuzz/checkpoint",
                        str(tmp_path / "checkpoints" / "file" / "below"), str(tmp_path / "saved")]

    unexpected = []
    # A stranger (no proof of the cluster secret) is refused before any request is read;
    # a peer holding the secret reaches the deserializers and handlers with garbage.
    stranger = grpc.insecure_channel(server.address, options=[("grpc.enable_http_proxy", 0)])
    channel = Security().channel(server.address, [("grpc.enable_http_proxy", 0)])
    with stranger, channel:
        for index, (method, messages) in enumerate(random_raw_calls(rng, NUM_STRANGER_CALLS)):
            code = call_raw(stranger, method, messages)
            if code != grpc.StatusCode.UNAUTHENTICATED:
                unexpected.append(f"stranger call {index} to {method.name} got {code.name}")
        for kind, calls, expected in [
            ("raw", random_raw_calls(rng, NUM_RAW_MESSAGE_CALLS), EXPECTED_FOR_RAW_BYTES),
            ("proto", proto_calls(rng, NUM_PROTO_CALLS, save_directories, restore_directories),
             EXPECTED_REFUSALS),
        ]:
            for index, (method, messages) in enumerate(calls):
                code = call_raw(channel, method, messages)
                if code not in expected:
                    unexpected.append(
                        f"{kind} call {index} to {method.name} got {code.name}; messages "
                        f"(first 200 bytes each): {[message[:200] for message in messages]}"
                    )
        idle = tcp_garbage(server.port, rng, NUM_TCP_CONNECTIONS, NUM_IDLE_CONNECTIONS)
        try:
            after = snapshot(client)  # Served while garbage connections hang open.
        finally:
            for connection in idle:
                connection.close()

    assert not unexpected, f"seed {SEED}: {len(unexpected)} unexpected statuses:\n" + "\n".join(
        unexpected[:20])
    assert after.keys() == before.keys()
    for name, (value, version) in before.items():
        np.testing.assert_array_equal(after[name][0], value, err_msg=name)
        assert after[name][1] == version == 0, name
    stats = server.stats()
    assert all(item.applied_updates == 0 for item in stats.variables.values())
    assert sorted(stats.variables) == sorted(VARIABLES), "a refused create created something"
    for name in ("weights", "embedding"):  # optimizer slots untouched (SGD: iterations)
        assert client.optimizer_state([name])[name].iterations == 0
    assert not (tmp_path / "PWNED").exists()
    assert client.health()["status"] == "SERVING"
    [state] = client.create([VariableInit("after_fuzz", np.full(3, 2.5, "float32"))])
    [state] = client.pull(["after_fuzz"])
    np.testing.assert_array_equal(state.value, np.full(3, 2.5, "float32"))
