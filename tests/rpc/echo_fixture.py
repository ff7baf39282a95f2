"""A tiny generic gRPC service for testing interceptors and TLS without the variable service.

One method of each kind (unary/streaming requests and responses), counting the
calls whose handler ran:

```python
from tests.rpc.echo_fixture import serve  # noqa: F401 (a fixture)

def test_something(serve):
    server = serve(Security(token="t"))
    with open_channel(server.port, Security()) as channel:
        call(channel, "Unary", metadata)
```
"""

import threading
from concurrent import futures

import grpc
import pytest

CALL_TIMEOUT = 10.0
SERVICE = "kdist.test.Echo"
METHODS = ("Unary", "UnaryStream", "StreamUnary", "StreamStream")


class EchoService:
    """One method of each kind; counts the calls whose handler ran."""

    def __init__(self):
        self.calls = 0
        self._lock = threading.Lock()

    def _count(self):
        with self._lock:
            self.calls += 1

    def unary(self, request, context):
        self._count()
        return request

    def unary_stream(self, request, context):
        self._count()
        yield request
        yield request

    def stream_unary(self, requests, context):
        self._count()
        return b"".join(requests)

    def stream_stream(self, requests, context):
        self._count()
        yield from requests

    def handler(self):
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
                "UnaryStream": grpc.unary_stream_rpc_method_handler(self.unary_stream),
                "StreamUnary": grpc.stream_unary_rpc_method_handler(self.stream_unary),
                "StreamStream": grpc.stream_stream_rpc_method_handler(self.stream_stream),
            },
        )


class EchoServer:
    def __init__(self, security, address="127.0.0.1:0"):
        self.service = EchoService()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4),
            options=[("grpc.so_reuseport", 0)],
            interceptors=security.server_interceptors(),
        )
        self.server.add_generic_rpc_handlers((self.service.handler(),))
        credentials = security.server_credentials()
        if credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, credentials)
        self.server.start()

    def stop(self):
        self.server.stop(grace=None).wait(CALL_TIMEOUT)


@pytest.fixture
def serve():
    servers = []

    def start(security, address="127.0.0.1:0"):
        server = EchoServer(security, address)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def open_channel(port, security, host="127.0.0.1", authenticated=False):
    """A channel to the echo server: raw (a stranger's), or `security`'s own when `authenticated`."""
    target = f"{host}:{port}"
    if authenticated:
        return security.channel(target)
    credentials = security.channel_credentials()
    options = security.channel_options()
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def call(channel, method, metadata=(), payload=b"ping"):
    """Calls `method` of the echo service; returns the response bytes."""
    path = f"/{SERVICE}/{method}"
    kwargs = {"timeout": CALL_TIMEOUT, "metadata": metadata}
    if method == "Unary":
        return channel.unary_unary(path)(payload, **kwargs)
    if method == "UnaryStream":
        return b"".join(channel.unary_stream(path)(payload, **kwargs))
    if method == "StreamUnary":
        return channel.stream_unary(path)(iter([payload, payload]), **kwargs)
    return b"".join(channel.stream_stream(path)(iter([payload, payload]), **kwargs))


def status_of(function):
    with pytest.raises(grpc.RpcError) as caught:
        function()
    return caught.value.code()
