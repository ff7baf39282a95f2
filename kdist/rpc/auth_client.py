"""The client side of `kdist.rpc.auth`: say hello, check the server's proofs, prove each call."""

import collections
import hmac
import os
import threading
import time

import grpc
import grpc.experimental

from kdist.errors import PeerAuthenticationError
from kdist.rpc.auth import (
    _CLIENT_NONCE_BYTES,
    _DIGEST_BYTES,
    _NONCE_BYTES,
    HELLO_METHOD,
    NONCE_KEY,
    PROOF_KEY,
    REPLY_KEY,
    SESSION_KEY,
    STALE_SESSION,
    _from_hex,
    _mac,
    _metadata_value,
)
from kdist.rpc.guarded_channel import CLOSED_MESSAGE

# A hello waits at most this long when the call it precedes has no deadline.
HELLO_TIMEOUT_SECONDS = 30.0
# The quick look at a server before a hello that waits for it.
PROBE_TIMEOUT_SECONDS = 2.0


class _CallDetails(
    collections.namedtuple("_CallDetails",
                           ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                            "compression")),
    grpc.ClientCallDetails,
):
    pass


class _Failed(grpc.RpcError, grpc.Call, grpc.Future):
    """A finished call with an error status: every way of reading it raises."""

    def __init__(self, code, details):
        super().__init__()
        self._code = code
        self._details = details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def initial_metadata(self):
        return None

    def trailing_metadata(self):
        return None

    def result(self, timeout=None):
        raise self

    def exception(self, timeout=None):
        return self

    def traceback(self, timeout=None):
        return None

    def __iter__(self):
        return self

    def __next__(self):
        raise self

    def cancel(self):
        return False

    def cancelled(self):
        return False

    def running(self):
        return False

    def done(self):
        return True

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def add_callback(self, callback):
        return False

    def add_done_callback(self, fn):
        fn(self)


def _SessionExpired(address):
    """A call refused as stale that cannot be resent: `UNAVAILABLE` once, for the caller to retry."""
    return _Failed(grpc.StatusCode.UNAVAILABLE,
                   f"the server at {address} restarted since this client authenticated; the next "
                   "call authenticates again")


def _Ended(call):
    """`call`, which ended with an error before a response, as an error that yields nothing."""
    return _Failed(call.code(), call.details())


def _final_code(call):
    """The status of `call`, which sent no metadata: over, or waited for (deadline-bound)."""
    try:
        return call.code()
    except grpc.experimental.UsageError:
        # A call read in the calling thread (a single-threaded response stream)
        # has no status until it is read to its end: drain it here, unread.
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass
        return call.code()


class ClientAuthenticator(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                          grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Says hello to the server, checks its proof, and proves every call; thread-safe.

    Args:
        channel: the `GuardedChannel` to `address`, not intercepted (the hello goes over it).
        secret: the cluster secret (bytes).
        address: the server's address, for messages.
    """

    def __init__(self, channel, secret, address, tls=False):
        self._secret = bytes(secret)
        self._address = address
        self._channel = channel
        self._tls = tls
        self._hello = channel.unary_unary(HELLO_METHOD)
        self._lock = threading.Lock()
        self._session = None

    def _current_session(self, details):
        with self._lock:
            if self._session is None:
                self._session = self._say_hello(details)
            return self._session

    def _say_hello(self, details):
        nonce = os.urandom(_CLIENT_NONCE_BYTES)
        timeout = HELLO_TIMEOUT_SECONDS if details.timeout is None else details.timeout
        try:
            # A TLS mismatch looks like a server still starting to a call that waits
            # for the server: a quick look first tells the two apart.
            answer = self._probe(nonce) if details.wait_for_ready else None
            if answer is None:
                answer = self._hello(nonce, timeout=timeout, wait_for_ready=details.wait_for_ready)
        except grpc.RpcError as error:
            if error.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED):
                raise PeerAuthenticationError(
                    self._address,
                    f"it does not prove the cluster secret ({error.code().name}: it is not a kdist "
                    "service, or it runs with authentication off, e.g. `kdist server --insecure`; "
                    "then start the clients with kdist.ps.Security.insecure() too)",
                ) from None
            raise
        if not isinstance(answer, bytes) or len(answer) != 2 * _NONCE_BYTES + _DIGEST_BYTES:
            raise PeerAuthenticationError(self._address, "its hello answer is malformed")
        session, proof = answer[:2 * _NONCE_BYTES], answer[2 * _NONCE_BYTES:]
        if not hmac.compare_digest(proof, _mac(self._secret, b"kdist-hello", nonce, session)):
            raise PeerAuthenticationError(
                self._address,
                "its proof of the cluster secret is wrong (another secret, or an impostor at the "
                "address); nothing was sent to it",
            )
        return session

    def _probe(self, nonce):
        """One hello that does not wait for the server: its answer, or None when it is not up.

        Raises:
            PeerAuthenticationError: the transport's TLS handshake failed (a
                mismatch between the two ends' TLS settings or certificates).
        """
        for attempt in range(2):
            try:
                return self._hello(nonce, timeout=PROBE_TIMEOUT_SECONDS, wait_for_ready=False)
            except grpc.RpcError as error:
                detail = error.details() or ""
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                if "Tls handshake failed" in detail or "SSL_ERROR" in detail:
                    raise PeerAuthenticationError(
                        self._address,
                        "the TLS handshake failed: the server does not speak TLS, or its "
                        "certificate does not chain to this client's ca_file or match the "
                        f"address/server_name; check Security's TLS files on both ends (gRPC: {detail})",
                    ) from None
                if self._tls or "Socket closed" not in detail:
                    return None  # not up yet (connection refused): wait for it as usual
                if attempt == 0:
                    # A plain-text client that a TLS server hangs up on: once more, to tell it
                    # from a server that died mid-connection.
                    try:
                        grpc.channel_ready_future(self._channel).result(timeout=PROBE_TIMEOUT_SECONDS)
                    except grpc.FutureTimeoutError:
                        pass
        raise PeerAuthenticationError(
            self._address,
            "it closes every plain-text connection during the handshake: it probably serves TLS, "
            "and this client does not (give Security a ca_file)",
        )

    def _forget(self, session):
        with self._lock:
            if self._session == session:
                self._session = None

    def _prepare(self, details):
        """Returns `(details with the proof, session, the reply proof to expect)`.

        A hello said here counts against the call's deadline: the call gets what is left.
        """
        started = time.monotonic()
        session = self._current_session(details)
        timeout = details.timeout
        if timeout is not None:
            timeout = max(0.001, timeout - (time.monotonic() - started))
        nonce = os.urandom(_NONCE_BYTES)
        method = details.method
        method_bytes = (method if isinstance(method, bytes) else method.encode("utf-8", "replace"))
        proof = _mac(self._secret, b"kdist-call", session, nonce, method_bytes)
        metadata = list(details.metadata or ()) + [
            (SESSION_KEY, session.hex()), (NONCE_KEY, nonce.hex()), (PROOF_KEY, proof.hex())]
        reply = _mac(self._secret, b"kdist-reply", session, nonce, method_bytes)
        return (_CallDetails(method, timeout, metadata, details.credentials,
                             details.wait_for_ready, details.compression), session, reply)

    def _first_metadata(self, call, session, reply):
        """Checks a call's first metadata; returns "ok", "stale" or "ended" (an error, no reply).

        Raises:
            PeerAuthenticationError: the peer answered without proving the secret.
        """
        metadata = call.initial_metadata()
        if metadata:
            supplied = _from_hex(_metadata_value(metadata, REPLY_KEY), _DIGEST_BYTES)
            if supplied is not None and hmac.compare_digest(supplied, reply):
                return "ok"
            call.cancel()
            raise PeerAuthenticationError(
                self._address,
                "its reply does not prove the cluster secret (an impostor at the address?); "
                "the reply was not read",
            )
        # A kdist server sends its proof before any response. No metadata: the call
        # ended (a refusal, a lost connection), or a stranger answered without it.
        code = _final_code(call)
        if code == grpc.StatusCode.OK:
            raise PeerAuthenticationError(
                self._address,
                "its reply does not prove the cluster secret (an impostor at the address?); "
                "the reply was not read",
            )
        if code == grpc.StatusCode.UNAUTHENTICATED and call.details() == STALE_SESSION:
            self._forget(session)
            return "stale"
        return "ended"

    def _intercept(self, continuation, client_call_details, request, retry):
        for attempt in range(2 if retry else 1):
            try:
                details, session, reply = self._prepare(client_call_details)
            except grpc.RpcError as error:  # the hello failed: unreachable, deadline, ...
                return _Ended(error)
            call = continuation(details, request)
            checked = self._first_metadata(call, session, reply)
            if checked == "ok":
                return call
            if checked == "ended":
                if self._channel.closed:
                    # Closed meanwhile: grpc's own error for it, as on a channel without the secret.
                    raise ValueError(CLOSED_MESSAGE)
                # Its error, and none of the messages a stranger may have streamed.
                return _Ended(call)
        return _SessionExpired(self._address)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return self._intercept(continuation, client_call_details, request, retry=True)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return self._intercept(continuation, client_call_details, request, retry=True)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        # A request stream cannot be read twice: a stale session fails once as UNAVAILABLE.
        return self._intercept(continuation, client_call_details, request_iterator, retry=False)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return self._intercept(continuation, client_call_details, request_iterator, retry=False)
