"""Mutual proof of the cluster secret, with or without TLS: kdist's gRPC authentication.

Every kdist service (a parameter server, a coordinator's worker) and every
client proves to the other that it holds the cluster secret before either
trusts anything the other sends. The secret itself never crosses the wire.

The protocol (HMAC-SHA256 throughout, `K` the secret):

1. **Hello.** The client sends 32 fresh random bytes `c` to the method
   `/kdist.auth.v1.Auth/Hello`, the only method a server answers without proof.
   The server answers a session nonce `s` (its instance id, 16 random bytes
   drawn when it started, then 16 fresh random bytes) and
   `HMAC(K, "kdist-hello" | c | s)`. The client checks that proof: a peer without
   the secret (a process that took a dead server's port, say) fails here, and
   the client sends it nothing else.
2. **Calls.** Each call carries `s`, a fresh call nonce `n` and
   `HMAC(K, "kdist-call" | s | n | method)` as metadata. The server checks the
   proof and that `s` carries its own instance id (a proof made for another
   server or for an earlier run of this one is refused, so a proof an impostor
   captures is worth nothing anywhere), before any request is read.
3. **Replies.** The server's first metadata carries
   `HMAC(K, "kdist-reply" | s | n | method)`. The client checks it before it
   reads the response: nothing an impostor answers is ever deserialized by
   kdist (its replies may hold pickles).

The client side is `kdist.rpc.auth_client`. A server that restarted has a new instance id; its clients' next call is
refused as stale, and they say hello again (unary calls transparently; a
streaming request fails as `UNAVAILABLE` once, which kdist's callers retry).

Without TLS an observer on the network can read the traffic and replay a
call to the same running server; it cannot learn the secret or pose as a
server. Across untrusted networks use TLS as well (`kdist.ps.Security`).
"""

import hashlib
import hmac
import os

import grpc

HELLO_METHOD = "/kdist.auth.v1.Auth/Hello"
SESSION_KEY = "kdist-session"
NONCE_KEY = "kdist-nonce"
PROOF_KEY = "kdist-proof"
REPLY_KEY = "kdist-reply"
# The detail of a refusal for a proof made for another run of the server.
STALE_SESSION = "kdist: stale session"
_NONCE_BYTES = 16
_CLIENT_NONCE_BYTES = 32
_DIGEST_BYTES = hashlib.sha256().digest_size


def _mac(secret, label, *parts):
    return hmac.new(secret, label + b"\0" + b"".join(parts), hashlib.sha256).digest()


def _metadata_value(metadata, key):
    values = [value for name, value in (metadata or ()) if name == key]
    return values[0] if len(values) == 1 else None


def _from_hex(text, size):
    if not isinstance(text, str) or len(text) != 2 * size:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


# -- Server -------------------------------------------------------------------------------


class ServerAuthenticator(grpc.ServerInterceptor):
    """Answers hellos and refuses every call without a valid proof (`UNAUTHENTICATED`).

    The check runs when a call arrives, before its handler and before a
    streaming request is read. Thread-safe: it holds only immutable state.

    Args:
        secret: the cluster secret (bytes).
        refusal: the detail sent with a refusal (it says how to give the
            client the secret; it never contains it).
    """

    def __init__(self, secret, refusal):
        self._secret = bytes(secret)
        self._instance = os.urandom(_NONCE_BYTES)
        self._refusal = refusal
        self._hello_handler = grpc.unary_unary_rpc_method_handler(self._hello)

    def _hello(self, request, context):
        if not isinstance(request, bytes) or len(request) != _CLIENT_NONCE_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a hello carries {_CLIENT_NONCE_BYTES} random bytes; received "
                          f"{len(request) if isinstance(request, bytes) else 'no'} bytes")
        session = self._instance + os.urandom(_NONCE_BYTES)
        return session + _mac(self._secret, b"kdist-hello", request, session)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method == HELLO_METHOD:
            return self._hello_handler
        metadata = handler_call_details.invocation_metadata
        session = _from_hex(_metadata_value(metadata, SESSION_KEY), 2 * _NONCE_BYTES)
        nonce = _from_hex(_metadata_value(metadata, NONCE_KEY), _NONCE_BYTES)
        proof = _from_hex(_metadata_value(metadata, PROOF_KEY), _DIGEST_BYTES)
        handler = continuation(handler_call_details)
        if session is None or nonce is None or proof is None:
            return _refusal(handler, self._refusal)
        method_bytes = method.encode("utf-8", "replace")
        expected = _mac(self._secret, b"kdist-call", session, nonce, method_bytes)
        if not hmac.compare_digest(proof, expected):
            return _refusal(handler, self._refusal)
        if not hmac.compare_digest(session[:_NONCE_BYTES], self._instance):
            return _refusal(handler, STALE_SESSION)
        if handler is None:
            return None
        reply = ((REPLY_KEY, _mac(self._secret, b"kdist-reply", session, nonce, method_bytes).hex()),)
        return _replying(handler, reply)


def _replying(handler, reply):
    """The handler, sending the reply proof as its first metadata before it runs."""
    if handler.response_streaming:
        behavior = handler.unary_stream or handler.stream_stream

        def streaming(request, context):
            context.send_initial_metadata(reply)
            yield from behavior(request, context)

        field = "unary_stream" if handler.unary_stream else "stream_stream"
        return handler._replace(**{field: streaming})
    behavior = handler.unary_unary or handler.stream_unary

    def unary(request, context):
        context.send_initial_metadata(reply)
        return behavior(request, context)

    field = "unary_unary" if handler.unary_unary else "stream_unary"
    return handler._replace(**{field: unary})


def _refusal(handler, detail):
    # Requests stay undeserialized: nothing from an unauthenticated caller is parsed.
    def refuse(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, detail)

    def refuse_streaming(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, detail)
        yield  # unreachable: makes this a generator, as streaming responses are

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.unary_stream_rpc_method_handler(refuse_streaming)
