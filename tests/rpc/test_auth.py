"""The mutual proof of the cluster secret (`kdist.rpc.auth`), on a generic gRPC service.

Strangers (no proof, forged proofs, replayed proofs) reach no handler; a
client tells nothing to, and reads nothing from, a peer that cannot prove the
secret (an impostor that took a dead server's port); a restarted server makes
its clients say hello again. The variable service and the workers use the
same code: tests/rpc/test_security.py and tests/coordinator/test_security.py.
"""

import os
import threading
from concurrent import futures

import grpc
import pytest

from kdist.errors import PeerAuthenticationError
from kdist.rpc import auth
from kdist.rpc.security import Security
from tests.rpc.echo_fixture import (  # noqa: F401 (serve is a fixture)
    CALL_TIMEOUT,
    METHODS,
    SERVICE,
    call,
    open_channel,
    serve,
    status_of,
)

SECRET = "the-cluster-secret-for-these-tests"
OTHER = "another-clusters-secret"


class Impostor:
    """A gRPC server that answers every method, records what it receives and sends `payload`.

    Its hello answer is well formed but cannot carry a valid proof.
    """

    def __init__(self, address="127.0.0.1:0", payload=b"pickled-evil"):
        self.received = []  # (method, metadata, request bytes)
        self._lock = threading.Lock()
        self.payload = payload
        impostor = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                method = details.method

                def record(request):
                    with impostor._lock:
                        impostor.received.append((method, tuple(details.invocation_metadata), request))

                def unary(request, context):
                    if not isinstance(request, bytes):
                        request = b"".join(request)
                    record(request)
                    if method == auth.HELLO_METHOD:
                        return os.urandom(64)
                    return impostor.payload

                def streaming(request, context):
                    yield unary(request, context)

                return (grpc.unary_unary_rpc_method_handler(unary) if "Stream" not in method
                        else grpc.stream_stream_rpc_method_handler(streaming))

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                  options=[("grpc.so_reuseport", 0)])
        self.server.add_generic_rpc_handlers((Handler(),))
        self.port = self.server.add_insecure_port(address)
        self.server.start()

    def everything_received(self):
        return b"".join(method.encode() + repr(metadata).encode() + request
                        for method, metadata, request in self.received)

    def stop(self):
        self.server.stop(None).wait(CALL_TIMEOUT)


@pytest.fixture
def impostor():
    started = []

    def start(**kwargs):
        started.append(Impostor(**kwargs))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def _call_with(channel, method, metadata):
    path = f"/{SERVICE}/{method}"
    return channel.unary_unary(path)(b"ping", timeout=CALL_TIMEOUT, metadata=metadata)


def _proof(secret, session, nonce, method):
    return auth._mac(secret.encode(), b"kdist-call", session, nonce, method.encode())


# -- Strangers reach no handler ----------------------------------------------------------


def _hello(channel):
    nonce = os.urandom(32)
    answer = channel.unary_unary(auth.HELLO_METHOD)(nonce, timeout=CALL_TIMEOUT)
    return nonce, answer[:32], answer[32:]


def test_the_hello_proves_the_server_and_a_valid_call_proof_reaches_the_handler(serve):
    server = serve(Security(token=SECRET))
    with open_channel(server.port, Security.insecure()) as channel:
        nonce, session, proof = _hello(channel)
        assert proof == auth._mac(SECRET.encode(), b"kdist-hello", nonce, session)
        call_nonce = os.urandom(16)
        method = f"/{SERVICE}/Unary"
        metadata = ((auth.SESSION_KEY, session.hex()), (auth.NONCE_KEY, call_nonce.hex()),
                    (auth.PROOF_KEY, _proof(SECRET, session, call_nonce, method).hex()))
        response, rpc = channel.unary_unary(method).with_call(b"ping", timeout=CALL_TIMEOUT,
                                                               metadata=metadata)
    assert response == b"ping" and server.service.calls == 1
    reply = dict(rpc.initial_metadata())[auth.REPLY_KEY]
    assert bytes.fromhex(reply) == auth._mac(SECRET.encode(), b"kdist-reply", session, call_nonce,
                                             method.encode())


@pytest.mark.parametrize("forgery", ["other-secret", "other-method", "random-proof", "bad-hex",
                                     "session-of-another-server", "missing-nonce", "twice"])
def test_forged_or_misused_proofs_are_refused_before_the_handler(serve, forgery):
    server = serve(Security(token=SECRET))
    other_server = serve(Security(token=SECRET))
    with open_channel(server.port, Security.insecure()) as channel, \
            open_channel(other_server.port, Security.insecure()) as other_channel:
        _, session, _ = _hello(other_channel if forgery == "session-of-another-server" else channel)
        nonce = os.urandom(16)
        method = f"/{SERVICE}/Unary"
        proof = _proof(SECRET, session, nonce, method).hex()
        metadata = [(auth.SESSION_KEY, session.hex()), (auth.NONCE_KEY, nonce.hex()),
                    (auth.PROOF_KEY, proof)]
        if forgery == "other-secret":
            metadata[2] = (auth.PROOF_KEY, _proof(OTHER, session, nonce, method).hex())
        elif forgery == "other-method":  # a proof made for UnaryStream, replayed for Unary
            metadata[2] = (auth.PROOF_KEY, _proof(SECRET, session, nonce, f"/{SERVICE}/UnaryStream").hex())
        elif forgery == "random-proof":
            metadata[2] = (auth.PROOF_KEY, os.urandom(32).hex())
        elif forgery == "bad-hex":
            metadata[2] = (auth.PROOF_KEY, "zz" * 32)
        elif forgery == "missing-nonce":
            del metadata[1]
        elif forgery == "twice":
            metadata.append((auth.PROOF_KEY, proof))
        with pytest.raises(grpc.RpcError) as refused:
            _call_with(channel, "Unary", tuple(metadata))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    if forgery == "session-of-another-server":
        assert refused.value.details() == auth.STALE_SESSION
    assert server.service.calls == 0 and other_server.service.calls == 0


@pytest.mark.parametrize("request_bytes", [b"", b"x" * 31, b"x" * 33, b"x" * 4096])
def test_a_malformed_hello_is_refused_and_the_server_keeps_serving(serve, request_bytes):
    server = serve(Security(token=SECRET))
    with open_channel(server.port, Security.insecure()) as channel:
        code = status_of(lambda: channel.unary_unary(auth.HELLO_METHOD)(request_bytes, timeout=CALL_TIMEOUT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    with open_channel(server.port, Security(token=SECRET), authenticated=True) as channel:
        assert call(channel, "Unary") == b"ping"


# -- A client trusts only a server that proves the secret -----------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_an_impostor_gets_no_secret_and_its_answers_are_not_read(impostor, method):
    fake = impostor()
    with open_channel(fake.port, Security(token=SECRET), authenticated=True) as channel:
        with pytest.raises(PeerAuthenticationError, match="proof of the cluster secret is wrong") as caught:
            call(channel, method)
    assert caught.value.address == f"127.0.0.1:{fake.port}"
    # The impostor saw one hello (32 random bytes) and nothing else: no call, no proof, no secret.
    assert [entry[0] for entry in fake.received] == [auth.HELLO_METHOD]
    assert SECRET.encode() not in fake.everything_received()
    assert b"pickled-evil" not in repr(caught.value).encode()


def test_a_client_refuses_a_server_with_another_secret(serve):
    server = serve(Security(token=OTHER))
    with open_channel(server.port, Security(token=SECRET), authenticated=True) as channel:
        with pytest.raises(PeerAuthenticationError):
            call(channel, "Unary")
    assert server.service.calls == 0


def test_an_impostor_on_a_dead_servers_port_is_caught_and_its_proofs_are_worthless(serve, impostor):
    """The client authenticated with the real server, which then died; a stranger took its
    port. The client's next call reaches the stranger (a gRPC channel reconnects
    silently) but the answer lacks the reply proof: it is refused unread. The call
    proof the stranger captured is refused by a restarted real server (stale session)."""
    real = serve(Security(token=SECRET))
    port = real.port
    with open_channel(port, Security(token=SECRET), authenticated=True) as channel:
        assert call(channel, "Unary") == b"ping"
        real.stop()
        fake = impostor(address=f"127.0.0.1:{port}")
        with pytest.raises(PeerAuthenticationError, match="reply does not prove"):
            call(channel, "Unary", payload=b"for-the-real-server")
        [(method, metadata, request)] = fake.received
        assert method == f"/{SERVICE}/Unary" and request == b"for-the-real-server"
        assert SECRET.encode() not in fake.everything_received()
        fake.stop()
        restarted = serve(Security(token=SECRET), address=f"127.0.0.1:{port}")
        with open_channel(port, Security.insecure()) as replaying:
            replayed = tuple(item for item in metadata if item[0].startswith("kdist-"))
            with pytest.raises(grpc.RpcError) as refused:
                _call_with(replaying, "Unary", replayed)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert restarted.service.calls == 0
        # The client itself says hello to the restarted server and carries on.
        assert call(channel, "Unary") == b"ping"
        assert call(channel, "UnaryStream") == b"pingping"
    assert restarted.service.calls == 2


def test_a_restarted_server_fails_a_request_stream_once_as_unavailable(serve):
    real = serve(Security(token=SECRET))
    port = real.port
    with open_channel(port, Security(token=SECRET), authenticated=True) as channel:
        assert call(channel, "StreamUnary") == b"pingping"
        real.stop()
        restarted = serve(Security(token=SECRET), address=f"127.0.0.1:{port}")
        # A request stream cannot be sent twice: the stale session surfaces as UNAVAILABLE,
        # which kdist's callers retry; the retry authenticates again.
        assert status_of(lambda: call(channel, "StreamUnary")) == grpc.StatusCode.UNAVAILABLE
        assert call(channel, "StreamUnary") == b"pingping"
        assert call(channel, "StreamStream") == b"pingping"
    assert restarted.service.calls == 2
