"""Tests for `kdist.rpc.security`: validation, the secret's check and TLS.

The interceptor and TLS are first tested against a tiny generic gRPC service
(one method of each kind, counting the calls that reach a handler), then
against the variable service through `VariableClient`.
"""

import grpc
import numpy as np
import pytest

from kdist.errors import (
    InvalidArgumentError,
    PeerAuthenticationError,
    ParameterServerUnavailableError,
    UnauthenticatedError,
)
from kdist.ps import Assignment, ServiceOptions, VariableClient, VariableInit, create_server
from kdist.rpc.security import Security, load_token
from tests.rpc.certs_fixture import certificates  # noqa: F401 (a fixture)
from tests.rpc.echo_fixture import (  # noqa: F401 (serve is a fixture)
    CALL_TIMEOUT,
    METHODS,
    SERVICE,
    call,
    open_channel,
    serve,
    status_of,
)

TOKEN = "correct-horse-battery-staple"


# -- Validation ---------------------------------------------------------------------


def test_default_is_plain_text_with_the_cluster_secret(monkeypatch):
    security = Security()
    assert security.server_credentials() is None
    assert security.channel_credentials() is None
    assert security.channel_options() == []
    monkeypatch.setenv("KDIST_SECRET", TOKEN)
    assert security.secret() == TOKEN.encode()


@pytest.mark.parametrize("token", ["", 42, b"bytes"])
def test_token_must_be_a_non_empty_string(token):
    with pytest.raises(InvalidArgumentError, match=r"Received: token=") as caught:
        Security(token=token)
    assert "non-empty string" in str(caught.value)


@pytest.mark.parametrize("token", ["has space", "naïve", "line\nbreak"])
def test_token_must_be_printable_ascii_and_is_not_echoed(token):
    with pytest.raises(InvalidArgumentError, match="printable ASCII") as caught:
        Security(token=token)
    assert token not in str(caught.value)


def test_repr_hides_the_token():
    text = repr(Security(token=TOKEN))
    assert TOKEN not in text
    assert "token='<hidden>'" in text


def test_security_is_frozen():
    security = Security(token=TOKEN)
    with pytest.raises(AttributeError):
        security.token = "other"


def test_files_must_exist(tmp_path):
    missing = tmp_path / "missing.pem"
    with pytest.raises(InvalidArgumentError, match=r"Cannot read ca_file.*Received: ca_file="):
        Security(ca_file=str(missing))


def test_a_directory_is_not_a_readable_file(tmp_path):
    with pytest.raises(InvalidArgumentError, match="Cannot read certificate_file"):
        Security(certificate_file=str(tmp_path), private_key_file=str(tmp_path))


def test_files_must_be_pem_of_the_right_kind(tmp_path, certificates):
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(InvalidArgumentError, match="ca_file is not a PEM certificate"):
        Security(ca_file=str(not_pem))
    with pytest.raises(InvalidArgumentError, match="private_key_file is not a PEM"):
        Security(certificate_file=certificates.server_cert, private_key_file=certificates.ca_cert)


def test_path_like_files_become_strings(certificates):
    from pathlib import Path

    security = Security(ca_file=Path(certificates.ca_cert))
    assert security.ca_file == certificates.ca_cert


def test_certificate_needs_its_key(certificates):
    with pytest.raises(InvalidArgumentError, match="set both or neither"):
        Security(certificate_file=certificates.server_cert)
    with pytest.raises(InvalidArgumentError, match="set both or neither"):
        Security(private_key_file=certificates.server_key)


def test_server_name_needs_tls(certificates):
    with pytest.raises(InvalidArgumentError, match="set ca_file too"):
        Security(server_name="ps.kdist.test")
    with pytest.raises(InvalidArgumentError, match="non-empty host name"):
        Security(ca_file=certificates.ca_cert, server_name=" ")
    security = Security(ca_file=certificates.ca_cert, server_name="ps.kdist.test")
    assert security.channel_options() == [("grpc.ssl_target_name_override", "ps.kdist.test")]


def test_server_with_ca_but_no_certificate_is_refused(certificates):
    with pytest.raises(InvalidArgumentError, match="mutual TLS"):
        Security(ca_file=certificates.ca_cert).server_credentials()


def test_the_secret_is_checked_unless_insecure():
    assert len(Security(token=TOKEN).server_interceptors()) == 1
    assert len(Security().server_interceptors()) == 1
    assert Security.insecure().server_interceptors() == []
    assert Security.insecure().secret() is None
    with pytest.raises(InvalidArgumentError, match="Received: a token and authenticate=False"):
        Security(token=TOKEN, authenticate=False)
    with pytest.raises(InvalidArgumentError, match="Received: authenticate='no'"):
        Security(authenticate="no")


def test_load_token_strips_the_newline(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert load_token(str(path)) == TOKEN


def test_load_token_errors_do_not_echo_the_secret(tmp_path):
    with pytest.raises(InvalidArgumentError, match="Cannot read the token file"):
        load_token(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(InvalidArgumentError, match="non-empty string"):
        load_token(str(empty))
    spaced = tmp_path / "spaced"
    spaced.write_text("two words\n")
    with pytest.raises(InvalidArgumentError, match="printable ASCII") as caught:
        load_token(str(spaced))
    assert "two words" not in str(caught.value)


# -- The secret's check on a generic service (the protocol itself: tests/rpc/test_auth.py) --


@pytest.mark.parametrize("method", METHODS)
def test_a_client_with_the_secret_reaches_the_handler(serve, method):
    server = serve(Security(token=TOKEN))
    with open_channel(server.port, Security(token=TOKEN), authenticated=True) as channel:
        response = call(channel, method)
    assert response in (b"ping", b"pingping")
    assert server.service.calls == 1


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("client", ["raw", "insecure"])
def test_a_call_without_a_proof_is_refused_before_the_handler(serve, method, client):
    server = serve(Security(token=TOKEN))
    security = Security.insecure()
    with open_channel(server.port, security, authenticated=client == "insecure") as channel:
        code = status_of(lambda: call(channel, method, (("kdist-token", TOKEN),)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert server.service.calls == 0


def test_the_refusal_explains_itself_without_the_secret(serve):
    server = serve(Security(token=TOKEN))
    with open_channel(server.port, Security.insecure()) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            call(channel, "Unary")
    assert "KDIST_SECRET_FILE" in caught.value.details()
    assert TOKEN not in caught.value.details()


@pytest.mark.parametrize("method", ["Unary", "StreamStream"])
def test_unknown_methods_are_refused_too(serve, method):
    server = serve(Security(token=TOKEN))
    with open_channel(server.port, Security.insecure()) as channel:
        path = f"/{SERVICE}/Missing"
        if method == "Unary":
            code = status_of(lambda: channel.unary_unary(path)(b"x", timeout=CALL_TIMEOUT))
        else:
            code = status_of(
                lambda: list(channel.stream_stream(path)(iter([b"x"] * 3), timeout=CALL_TIMEOUT))
            )
    assert code == grpc.StatusCode.UNAUTHENTICATED


# -- TLS on a generic service ---------------------------------------------------------


def server_security(certificates, mutual=False, token=None):
    """TLS, with the secret `token`; TLS alone (Security.insecure) without one."""
    make = Security.insecure if token is None else (lambda **files: Security(token=token, **files))
    return make(
        certificate_file=certificates.server_cert,
        private_key_file=certificates.server_key,
        ca_file=certificates.ca_cert if mutual else None,
    )


def test_tls_client_with_the_ca_connects(serve, certificates):
    server = serve(server_security(certificates, token=TOKEN))
    client = Security(token=TOKEN, ca_file=certificates.ca_cert)
    with open_channel(server.port, client, host="localhost", authenticated=True) as channel:
        assert call(channel, "Unary") == b"ping"
    # 127.0.0.1 is in the certificate.
    with open_channel(server.port, client, authenticated=True) as channel:
        assert call(channel, "StreamStream") == b"pingping"
    assert server.service.calls == 2


def test_tls_needs_the_secret_too(serve, certificates):
    server = serve(server_security(certificates, token=TOKEN))
    client = Security.insecure(ca_file=certificates.ca_cert)
    with open_channel(server.port, client, authenticated=True) as channel:
        assert status_of(lambda: call(channel, "Unary")) == grpc.StatusCode.UNAUTHENTICATED
    assert server.service.calls == 0


def test_plain_text_client_is_refused_by_a_tls_server(serve, certificates):
    server = serve(server_security(certificates))
    with open_channel(server.port, Security()) as channel:
        code = status_of(lambda: call(channel, "Unary"))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert server.service.calls == 0


def test_client_that_trusts_another_ca_is_refused(serve, certificates):
    server = serve(server_security(certificates))
    with open_channel(server.port, Security(ca_file=certificates.rogue_ca_cert)) as channel:
        code = status_of(lambda: call(channel, "Unary"))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert server.service.calls == 0


def test_server_name_override(serve, certificates):
    server = serve(server_security(certificates))
    good = Security(ca_file=certificates.ca_cert, server_name="ps.kdist.test")
    with open_channel(server.port, good) as channel:
        assert call(channel, "Unary") == b"ping"
    bad = Security(ca_file=certificates.ca_cert, server_name="elsewhere.example")
    with open_channel(server.port, bad) as channel:
        assert status_of(lambda: call(channel, "Unary")) == grpc.StatusCode.UNAVAILABLE
    assert server.service.calls == 1


def test_mutual_tls(serve, certificates):
    server = serve(server_security(certificates, mutual=True))
    with_client_certificate = Security(
        ca_file=certificates.ca_cert,
        certificate_file=certificates.client_cert,
        private_key_file=certificates.client_key,
    )
    with open_channel(server.port, with_client_certificate) as channel:
        assert call(channel, "Unary") == b"ping"
    without = Security(ca_file=certificates.ca_cert)
    with open_channel(server.port, without) as channel:
        assert status_of(lambda: call(channel, "Unary")) == grpc.StatusCode.UNAVAILABLE
    rogue = Security(
        ca_file=certificates.ca_cert,
        certificate_file=certificates.rogue_client_cert,
        private_key_file=certificates.rogue_client_key,
    )
    with open_channel(server.port, rogue) as channel:
        assert status_of(lambda: call(channel, "Unary")) == grpc.StatusCode.UNAVAILABLE
    assert server.service.calls == 1


# -- The variable service -------------------------------------------------------------

FAST_FAIL = ServiceOptions(rpc_timeout_seconds=10, connect_timeout_seconds=1)
# A client whose handshake fails waits for the server until its deadline
# (wait_for_ready) and then reports it unavailable: keep that deadline short.
REFUSED = ServiceOptions(rpc_timeout_seconds=1, connect_timeout_seconds=0.5)
VALUE = np.arange(6, dtype="float32").reshape(2, 3)


@pytest.fixture
def variable_server():
    servers = []

    def start(security):
        server = create_server(options=FAST_FAIL, security=security)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(0)


def client_of(server, security, host="127.0.0.1", options=FAST_FAIL):
    return VariableClient(f"{host}:{server.port}", options=options, security=security)


def assert_unchanged(client):
    [state] = client.pull(["w"])
    np.testing.assert_array_equal(state.value, VALUE)
    assert state.version == 0


def test_variable_service_refuses_a_client_without_the_secret(variable_server):
    server = variable_server(Security(token=TOKEN))
    with client_of(server, Security(token=TOKEN)) as good, client_of(
        server, Security.insecure()
    ) as bad:
        good.create([VariableInit("w", VALUE)])
        attempts = [
            lambda: bad.assign([Assignment("w", np.zeros_like(VALUE))]),
            lambda: bad.create([VariableInit("w2", VALUE)]),
            lambda: bad.pull(["w"]),
            lambda: bad.restore("/nonexistent"),
        ]
        for attempt in attempts:
            with pytest.raises(UnauthenticatedError) as caught:
                attempt()
            assert caught.value.code_name == "UNAUTHENTICATED"
        assert_unchanged(good)
        [state] = good.create([VariableInit("w2", VALUE + 1)])
        np.testing.assert_array_equal(state.value, VALUE + 1)  # "w2" was not created by `bad`.
    requests = server.stats().requests
    assert requests.get("assign", 0) == 0 and requests.get("restore", 0) == 0


def test_variable_service_over_tls_with_the_ca(variable_server, certificates):
    server = variable_server(server_security(certificates, token=TOKEN))
    client_security = Security(token=TOKEN, ca_file=certificates.ca_cert)
    with client_of(server, client_security, host="localhost") as client:
        client.create([VariableInit("w", VALUE)])
        assert_unchanged(client)


def test_plain_text_client_cannot_reach_a_tls_variable_server(variable_server, certificates):
    server = variable_server(server_security(certificates, token=TOKEN))
    with client_of(server, Security(token=TOKEN, ca_file=certificates.ca_cert)) as good:
        good.create([VariableInit("w", VALUE)])
        with client_of(server, Security(token=TOKEN), options=REFUSED) as plain:
            with pytest.raises(PeerAuthenticationError, match="TLS"):
                plain.assign([Assignment("w", np.zeros_like(VALUE))])
        rogue_security = Security(token=TOKEN, ca_file=certificates.rogue_ca_cert)
        with client_of(server, rogue_security, options=REFUSED) as rogue:
            with pytest.raises(PeerAuthenticationError, match="TLS"):
                rogue.assign([Assignment("w", np.zeros_like(VALUE))])
        assert_unchanged(good)
    assert server.stats().requests.get("assign", 0) == 0


def test_variable_service_with_mutual_tls(variable_server, certificates):
    server = variable_server(server_security(certificates, mutual=True, token=TOKEN))
    with client_of(
        server,
        Security(
            token=TOKEN,
            ca_file=certificates.ca_cert,
            certificate_file=certificates.client_cert,
            private_key_file=certificates.client_key,
        ),
    ) as client:
        client.create([VariableInit("w", VALUE)])
        anonymous_security = Security(token=TOKEN, ca_file=certificates.ca_cert)
        with client_of(server, anonymous_security, options=REFUSED) as anonymous:
            with pytest.raises(ParameterServerUnavailableError):
                anonymous.assign([Assignment("w", np.zeros_like(VALUE))])
        assert_unchanged(client)


@pytest.mark.parametrize("mismatch", ["plain-client-tls-server", "tls-client-plain-server", "other-ca"])
def test_a_tls_mismatch_fails_fast_and_says_tls(variable_server, certificates, mismatch):
    """Without the quick look, these wait for the whole first-call deadline (here 61 s)."""
    import time

    tls_server = mismatch != "tls-client-plain-server"
    server = variable_server(server_security(certificates, token=TOKEN) if tls_server
                             else Security(token=TOKEN))
    client_security = {
        "plain-client-tls-server": Security(token=TOKEN),
        "tls-client-plain-server": Security(token=TOKEN, ca_file=certificates.ca_cert),
        "other-ca": Security(token=TOKEN, ca_file=certificates.rogue_ca_cert),
    }[mismatch]
    slow = ServiceOptions(rpc_timeout_seconds=60, connect_timeout_seconds=1)
    started = time.monotonic()
    with client_of(server, client_security, options=slow) as client:
        with pytest.raises(PeerAuthenticationError, match="TLS") as caught:
            client.pull(["w"])
    assert time.monotonic() - started < 10
    assert caught.value.address.endswith(f":{server.port}")
    assert server.stats().requests.get("pull", 0) == 0
