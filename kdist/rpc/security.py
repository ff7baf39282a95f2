"""`Security`: who may call a kdist service, and TLS.

Two protections:

- **The cluster secret (on by default).** Servers and clients prove to each
  other that they hold the same secret before either trusts the other, with an
  HMAC challenge-response over fresh nonces in both directions
  (`kdist.rpc.auth`); the secret never crosses the wire. A server refuses every
  call without a valid proof with `UNAUTHENTICATED`, before anything in the
  request is read; a client refuses a server that cannot prove the secret,
  before it sends it anything or reads its replies. The secret comes from, in
  order: `Security(token=...)`, the variable `KDIST_SECRET` (the secret),
  the variable `KDIST_SECRET_FILE` (a file holding it; `kdist launch` writes
  a fresh one per job, mode 0600), or else a secret drawn for this process and
  kept in memory: a cluster inside one process works with no configuration,
  and no other process can call it. `Security.insecure()` turns all of this
  off, for a trusted network only.
- **TLS** encrypts the connection and proves the server's certificate. A
  server serves TLS when it has `certificate_file` and `private_key_file`;
  with a `ca_file` as well it requires client certificates (mutual TLS). A
  client speaks TLS when it has a `ca_file`. Without TLS, an observer on the
  network can read the traffic (but not learn the secret or pose as a server):
  use TLS across networks you do not trust.

Every kdist channel and every bound server port is made here (`channel`,
`bind`), so the credentials, the secret's interceptors and the options all
kdist channels share are set in one place. gRPC is imported only when one is
made: a `Security` can be built and checked without loading it.
"""

import dataclasses
import logging
import os

from kdist.cluster.address import is_loopback
from kdist.errors import InvalidArgumentError
from kdist.rpc.secret import (  # noqa: F401  (load_token: public here too)
    MAX_FILE_BYTES,
    SECRET_ENV,
    SECRET_FILE_ENV,
    _check_token,
    cluster_secret,
    load_token,
    read_capped,
)

_LOG = logging.getLogger("kdist.security")
_PEM_MARKERS = {
    "certificate_file": (b"-----BEGIN CERTIFICATE-----",),
    "ca_file": (b"-----BEGIN CERTIFICATE-----",),
    "private_key_file": (b"-----BEGIN PRIVATE KEY-----", b"-----BEGIN RSA PRIVATE KEY-----",
                         b"-----BEGIN EC PRIVATE KEY-----"),
}
_UNAUTHENTICATED_DETAIL = (
    "the call did not prove the cluster secret. Every task of a cluster needs the same "
    f"secret: run them under `kdist launch`, or set {SECRET_FILE_ENV} (a file holding the "
    f"secret) or {SECRET_ENV} on every task, or pass Security(token=...) to both ends "
    "(docs/parameter_server.md, Security)"
)
# Options of every channel kdist opens: loopback and cluster addresses must not
# go through an HTTP proxy that happens to be set in the environment, and gRPC's
# own retries are off (kdist's callers retry themselves, under their deadlines).
_CHANNEL_DEFAULTS = (("grpc.enable_http_proxy", 0), ("grpc.enable_retries", 0))
_warned = set()


@dataclasses.dataclass(frozen=True, repr=False)
class Security:
    """Who may call a kdist service (the cluster secret) and TLS, for a server or a client.

    `Security()` is the safe default: the cluster secret from the environment
    (`KDIST_SECRET`, `KDIST_SECRET_FILE`) or this process's own, and plain
    text (fine on loopback, the default bind address).

    Args:
        token: the cluster secret, printable ASCII without spaces (None: from
            the environment, else this process's own). Both ends prove they
            hold it; it is never sent.
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
        authenticate: False turns the secret off (use `Security.insecure()`):
            a server then serves anyone who can reach it.

    Raises:
        kdist.errors.InvalidArgumentError: a token that is not a non-empty
            printable-ASCII string, a file that does not exist, is not
            readable or is not PEM of the expected kind, only one of
            `certificate_file`/`private_key_file`, `server_name` without
            `ca_file`, or a token with `authenticate=False`.

    Example:

    >>> server_side = Security(certificate_file="server.pem",
    ...                        private_key_file="server.key")  # doctest: +SKIP
    >>> client_side = Security(ca_file="ca.pem")  # doctest: +SKIP
    >>> server = kdist.ps.create_server(security=server_side)  # doctest: +SKIP
    """

    token: str | None = None
    certificate_file: str | None = None
    private_key_file: str | None = None
    ca_file: str | None = None
    server_name: str | None = None
    authenticate: bool = True

    @classmethod
    def insecure(cls, **tls_files):
        """A `Security` without the cluster secret: a server serves anyone who reaches it.

        On a worker that means anyone can run code in it; on a parameter server,
        anyone can read and overwrite the variables. Use it only where every
        process that can reach the address is trusted. TLS files may still be given.
        """
        return cls(authenticate=False, **tls_files)

    def __post_init__(self):
        if not isinstance(self.authenticate, bool):
            raise InvalidArgumentError(
                f"authenticate must be True or False. Received: authenticate={self.authenticate!r}."
            )
        if self.token is not None:
            _check_token(self.token, "token")
            if not self.authenticate:
                raise InvalidArgumentError(
                    "A token is the cluster secret, which Security.insecure() turns off: give one "
                    "or the other. Received: a token and authenticate=False."
                )
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
        import grpc

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
        import grpc

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

    def secret(self):
        """Returns the cluster secret as bytes, or None when authentication is off.

        Raises:
            kdist.errors.InvalidArgumentError: `KDIST_SECRET` or the file named
                by `KDIST_SECRET_FILE` holds no valid secret.
        """
        if not self.authenticate:
            return None
        if self.token is not None:
            return self.token.encode("ascii")
        return cluster_secret()

    def server_interceptors(self):
        """Returns the interceptors a server installs: the secret's check unless insecure."""
        from kdist.rpc.auth import ServerAuthenticator

        secret = self.secret()
        return [] if secret is None else [ServerAuthenticator(secret, _UNAUTHENTICATED_DETAIL)]

    def channel(self, address, options=()):
        """Returns a channel to `address` that proves the secret and checks the server's proof.

        The one place kdist opens a channel: TLS when `ca_file` is set, the
        secret's handshake unless insecure, no HTTP proxy and no gRPC retries.

        Args:
            address: the server's `"host:port"`.
            options: further `grpc` channel options (message limits, keepalive,
                reconnect backoff).

        Returns:
            A `grpc.Channel`; close it when done.
        """
        import grpc

        options = [*_CHANNEL_DEFAULTS, *options, *self.channel_options()]
        credentials = self.channel_credentials()
        from kdist.rpc.guarded_channel import GuardedChannel

        # Guarded: closing it while another thread starts a call must not crash grpc.
        channel = GuardedChannel(grpc.insecure_channel(address, options=options) if credentials is None
                                 else grpc.secure_channel(address, credentials, options=options))
        secret = self.secret()
        if secret is None:
            return channel
        from kdist.rpc.auth_client import ClientAuthenticator

        authenticator = ClientAuthenticator(channel, secret, address, tls=credentials is not None)
        return grpc.intercept_channel(channel, authenticator)

    def bind(self, server, address, service):
        """Binds `server` to `address`, TLS when this has a server certificate; returns the port.

        The secret's check is not installed here but when the server is built
        (`server_interceptors`).

        Args:
            server: a `grpc.Server`, not started yet.
            address: `"host:port"` to bind; port 0 picks a free port.
            service: what is served, for people: "parameter server", "worker service".

        Returns:
            The bound port (the real one when `address` has port 0).

        Raises:
            kdist.errors.InvalidArgumentError: the address cannot be bound (in
                use, not an address of this machine), or `server_credentials`
                refuses this configuration.
        """
        credentials = self.server_credentials()
        try:
            if credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, credentials)
        except RuntimeError as error:
            raise InvalidArgumentError(
                f"Cannot bind the {service} to {address!r}: {error}. Use a free port "
                "(0 picks one) on an address of this machine."
            ) from None
        if not port:
            raise InvalidArgumentError(
                f"Cannot bind the {service} to {address!r}. Use a free port (0 picks one) "
                "on an address of this machine."
            )
        return port

    def check_exposure(self, service, host, port):
        """Logs, once per process and kind, what a server bound at `host` exposes.

        Args:
            service: what is served, for people: "parameter server", "worker".
            host: the bound host.
            port: the bound port.
        """
        if not self.authenticate:
            risk = ("anyone who can reach it can run code in this process" if service == "worker"
                    else "anyone who can reach it can read and overwrite its variables")
            _warn_once(("insecure", service),
                       f"kdist: the {service} at {host}:{port} runs without the cluster secret "
                       f"(Security.insecure() / --insecure): {risk}.")
        if not self.server_tls and not is_loopback(host):
            _warn_once(("plain", service),
                       f"kdist: the {service} at {host}:{port} listens beyond this machine without "
                       "TLS: its traffic (weights, closures) can be read on the network. The "
                       "cluster secret still keeps strangers out; give Security TLS files to "
                       "encrypt (docs/parameter_server.md, Security).")


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        _LOG.warning(message)


def _check_pem_file(name, path):
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise InvalidArgumentError(
            f"{name} must be the path of a PEM file. Received: {name}={path!r}."
        )
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    head = read_capped(path, name, f"{name}={path!r}", "an existing, readable PEM file")
    markers = _PEM_MARKERS[name]
    if len(head) > MAX_FILE_BYTES or not any(marker in head for marker in markers):
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
