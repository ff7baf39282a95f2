"""`Security`: TLS and a shared token for the variable service.

Two independent protections, each optional:

- **TLS** encrypts the connection and proves the server's identity. A server
  serves TLS when it has `certificate_file` and `private_key_file`; with a
  `ca_file` as well it also requires every client to present a certificate
  that chains to that CA (mutual TLS). A client speaks TLS when it has a
  `ca_file` (the roots the server's certificate must chain to); its own
  `certificate_file`/`private_key_file`, when set, are its client certificate.
- **A shared token**: the client sends it as `kdist-token` call metadata on
  every call; the server refuses a call whose token is missing or wrong with
  `UNAUTHENTICATED` before any handler runs, so such a call changes nothing.
  Without TLS the token travels in clear text: use both on untrusted networks.

One `Security` value can describe both ends of a cluster (every task gets the
same certificate, key, CA and token), or each end gets its own.
"""

import dataclasses
import hashlib
import hmac
import os

import grpc

from kdist.errors import InvalidArgumentError

TOKEN_METADATA_KEY = "kdist-token"
# A token is sent as an ASCII gRPC metadata value: printable characters only.
_TOKEN_CHARACTERS = frozenset(chr(code) for code in range(0x21, 0x7F))
# Larger files are not certificates or keys; refusing them early avoids reading
# a wrongly-named multi-gigabyte file into memory.
_MAX_PEM_BYTES = 1 << 20
_PEM_MARKERS = {
    "certificate_file": (b"-----BEGIN CERTIFICATE-----",),
    "ca_file": (b"-----BEGIN CERTIFICATE-----",),
    "private_key_file": (b"-----BEGIN PRIVATE KEY-----", b"-----BEGIN RSA PRIVATE KEY-----",
                         b"-----BEGIN EC PRIVATE KEY-----"),
}
_UNAUTHENTICATED_DETAIL = (
    f"the call's {TOKEN_METADATA_KEY!r} metadata is missing or wrong; give the client the "
    "server's token (Security(token=...), or kdist server --token-file)"
)


@dataclasses.dataclass(frozen=True, repr=False)
class Security:
    """TLS files and a shared token for a variable-service server or client.

    Every field is optional; `Security()` means plain text and no token (fine
    on loopback, the default bind address).

    Args:
        token: a shared secret, printable ASCII without spaces. A server
            refuses calls that do not carry it; a client sends it on every call.
        certificate_file: PEM certificate (chain). Server: its TLS certificate.
            Client: its client certificate for mutual TLS.
        private_key_file: the PEM private key of `certificate_file`; set both or
            neither.
        ca_file: PEM CA certificate(s). Client: turns TLS on; the server's
            certificate must chain to these. Server: turns mutual TLS on;
            client certificates must chain to these.
        server_name: client only: the name to check the server's certificate
            against instead of the host in the address (e.g. when connecting
            to an IP address with a certificate issued for a host name).
            Requires `ca_file`.

    Raises:
        kdist.errors.InvalidArgumentError: a token that is not a non-empty
            printable-ASCII string, a file that does not exist, is not
            readable or is not PEM of the expected kind, only one of
            `certificate_file`/`private_key_file`, or `server_name` without
            `ca_file`.

    Example:

    >>> server_side = Security(token="s3cret", certificate_file="server.pem",
    ...                        private_key_file="server.key")  # doctest: +SKIP
    >>> client_side = Security(token="s3cret", ca_file="ca.pem")  # doctest: +SKIP
    >>> server = kdist.ps.create_server(security=server_side)  # doctest: +SKIP
    """

    token: str | None = None
    certificate_file: str | None = None
    private_key_file: str | None = None
    ca_file: str | None = None
    server_name: str | None = None

    def __post_init__(self):
        if self.token is not None:
            _check_token(self.token, "token")
        for name in ("certificate_file", "private_key_file", "ca_file"):
            path = getattr(self, name)
            if path is not None:
                object.__setattr__(self, name, _check_pem_file(name, path))
        if (self.certificate_file is None) != (self.private_key_file is None):
            raise InvalidArgumentError(
                "A certificate needs its private key: set both or neither. Received: "
                f"certificate_file={self.certificate_file!r}, "
                f"private_key_file={self.private_key_file!r}."
            )
        if self.server_name is not None:
            if not isinstance(self.server_name, str) or not self.server_name.strip():
                raise InvalidArgumentError(
                    f"server_name must be a non-empty host name. "
                    f"Received: server_name={self.server_name!r}."
                )
            if self.ca_file is None:
                raise InvalidArgumentError(
                    "server_name overrides the name checked against the server's TLS "
                    "certificate, so it needs TLS: set ca_file too. "
                    f"Received: server_name={self.server_name!r}, ca_file=None."
                )

    def __repr__(self):
        # The token is a secret: say whether there is one, never what it is.
        token = "None" if self.token is None else "'<hidden>'"
        files = ", ".join(
            f"{field.name}={getattr(self, field.name)!r}"
            for field in dataclasses.fields(self)
            if field.name != "token"
        )
        return f"Security(token={token}, {files})"

    @property
    def server_tls(self):
        """True when a server with this configuration serves TLS."""
        return self.certificate_file is not None

    @property
    def client_tls(self):
        """True when a client with this configuration speaks TLS."""
        return self.ca_file is not None

    def server_credentials(self):
        """Returns the credentials for `server.add_secure_port`, or None for plain text.

        Returns:
            `grpc.ServerCredentials` when `certificate_file`/`private_key_file`
            are set (requiring client certificates when `ca_file` is set too);
            None otherwise.

        Raises:
            kdist.errors.InvalidArgumentError: `ca_file` is set without a
                server certificate: mutual TLS needs the server's own
                certificate, and serving plain text instead would be a surprise.
        """
        if not self.server_tls:
            if self.ca_file is not None:
                raise InvalidArgumentError(
                    "A server with ca_file requires client certificates (mutual TLS), which "
                    "needs the server's own certificate: set certificate_file and "
                    f"private_key_file. Received: ca_file={self.ca_file!r}, "
                    "certificate_file=None."
                )
            return None
        key_pair = (_read(self.private_key_file), _read(self.certificate_file))
        roots = None if self.ca_file is None else _read(self.ca_file)
        return grpc.ssl_server_credentials(
            [key_pair], root_certificates=roots, require_client_auth=roots is not None
        )

    def channel_credentials(self):
        """Returns the credentials for `grpc.secure_channel`, or None for plain text.

        Returns:
            `grpc.ChannelCredentials` trusting `ca_file` (and presenting the
            client certificate when `certificate_file` is set) when `ca_file`
            is set; None otherwise.
        """
        if not self.client_tls:
            return None
        if self.certificate_file is None:
            return grpc.ssl_channel_credentials(root_certificates=_read(self.ca_file))
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.private_key_file),
            certificate_chain=_read(self.certificate_file),
        )

    def channel_options(self):
        """Returns extra `grpc` channel options: the TLS target-name override, if any."""
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]

    def server_interceptors(self):
        """Returns the interceptors a server installs: the token check when a token is set."""
        return [] if self.token is None else [TokenInterceptor(self.token)]

    def call_metadata(self):
        """Returns the metadata a client sends with every call: `(("kdist-token", token),)`."""
        return () if self.token is None else ((TOKEN_METADATA_KEY, self.token),)


def load_token(path):
    """Reads a token from a file; surrounding whitespace (a trailing newline) is dropped.

    Args:
        path: the file holding the token.

    Returns:
        The token, a non-empty printable-ASCII string.

    Raises:
        kdist.errors.InvalidArgumentError: the file cannot be read, or holds no
            valid token.

    Example:

    >>> Security(token=load_token("/etc/kdist/token"))  # doctest: +SKIP
    """
    try:
        with open(path, "rb") as file:
            data = file.read(_MAX_PEM_BYTES + 1)
    except OSError as error:
        raise InvalidArgumentError(
            f"Cannot read the token file: {error.strerror or error}. Received: path={path!r}. "
            "Expected a readable file holding the token."
        ) from None
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise InvalidArgumentError(
            f"The token file is not ASCII text. Received: path={path!r}. Expected one line of "
            "printable ASCII characters."
        ) from None
    _check_token(token, f"the token in {path!r}", show=False)
    return token


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the right `kdist-token` metadata with `UNAUTHENTICATED`.

    The check runs when the call arrives, before the method's handler (and before
    a streaming request is read), for every kind of method. The comparison takes
    the same time wherever the tokens differ (`hmac.compare_digest` of SHA-256
    digests, so not even the token's length leaks).
    Thread-safe: it holds only the immutable expected token.

    Args:
        token: the expected token.
    """

    def __init__(self, token):
        _check_token(token, "token")
        self._expected = _digest(token.encode("ascii"))

    def intercept_service(self, continuation, handler_call_details):
        supplied = [
            value
            for key, value in (handler_call_details.invocation_metadata or ())
            if key == TOKEN_METADATA_KEY
        ]
        if len(supplied) == 1 and _token_matches(supplied[0], self._expected):
            return continuation(handler_call_details)
        # Looking the handler up runs none of its code; it only tells which
        # kind of handler (unary or streaming) the refusal must be.
        return _refusal(continuation(handler_call_details))


def _digest(token_bytes):
    # Comparing fixed-size digests hides the token's length as well as its content.
    return hashlib.sha256(token_bytes).digest()


def _token_matches(supplied, expected_digest):
    if isinstance(supplied, str):
        supplied = supplied.encode("utf-8", "replace")
    if not isinstance(supplied, bytes):
        return False
    return hmac.compare_digest(_digest(supplied), expected_digest)


def _refuse(request_or_iterator, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED_DETAIL)


def _refuse_streaming(request_or_iterator, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED_DETAIL)
    yield  # Unreachable: makes this a generator, as streaming responses are.


def _refusal(handler):
    # Requests are left undeserialized: nothing from an unauthenticated caller
    # is parsed.
    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(_refuse)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse_streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    return grpc.unary_stream_rpc_method_handler(_refuse_streaming)


def _check_token(token, name, show=True):
    received = f"{name}={token!r}" if show or not isinstance(token, str) else name
    if not isinstance(token, str) or not token:
        raise InvalidArgumentError(
            f"A token must be a non-empty string. Received: {received}. Expected a shared "
            "secret such as the output of `python -c 'import secrets; "
            "print(secrets.token_urlsafe())'`."
        )
    bad = sorted({character for character in token if character not in _TOKEN_CHARACTERS})
    if bad:
        # Tokens travel as gRPC metadata, which allows printable ASCII only.
        # The message names the offending characters, never the secret itself.
        raise InvalidArgumentError(
            f"A token may contain printable ASCII characters only, no spaces. Received: a token "
            f"in {name} with {len(token)} characters including {''.join(bad)!r}. Expected e.g. "
            "the output of `python -c 'import secrets; print(secrets.token_urlsafe())'`."
        )


def _check_pem_file(name, path):
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise InvalidArgumentError(
            f"{name} must be the path of a PEM file. Received: {name}={path!r}."
        )
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    try:
        with open(path, "rb") as file:
            head = file.read(_MAX_PEM_BYTES + 1)
    except OSError as error:
        raise InvalidArgumentError(
            f"Cannot read {name}: {error.strerror or error}. Received: {name}={path!r}. "
            "Expected an existing, readable PEM file."
        ) from None
    markers = _PEM_MARKERS[name]
    if len(head) > _MAX_PEM_BYTES or not any(marker in head for marker in markers):
        kind = "certificate" if name != "private_key_file" else "unencrypted private key"
        raise InvalidArgumentError(
            f"{name} is not a PEM {kind}. Received: {name}={path!r}. Expected a file "
            f"containing {markers[0].decode()!r}."
        )
    return path


def _read(path):
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        # Checked at construction; the file went away or changed permissions since.
        raise InvalidArgumentError(
            f"Cannot read a TLS file: {error.strerror or error}. Received: {path!r}. "
            "Expected the file to stay readable while the Security is in use."
        ) from None
