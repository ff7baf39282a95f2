"""The RPC method table, read from the generated descriptor, shared by server and client.

Server and client register methods from this table instead of the generated
`add_VariableServiceServicer_to_server` / `VariableServiceStub`, for one
reason: messages with a tensor payload (fields `header` and `payload`) are
framed by `kdist.ps.wire.codec` (one memcpy per chunk) rather than built as
protobuf objects (~1 GB/s). The method names, paths and wire format are the
generated ones; `tests/ps/test_methods.py` checks the table against the
generated stub.
"""

import dataclasses
import re

import grpc

from kdist.ps.wire import codec
from kdist.ps.wire._generated import variable_service_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["VariableService"]
SERVICE_NAME = _SERVICE.full_name


def is_framed(message_class):
    """True for messages that carry a tensor payload (framed by the codec)."""
    fields = message_class.DESCRIPTOR.fields_by_name
    return "header" in fields and "payload" in fields


def _snake_case(name):
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclasses.dataclass(frozen=True)
class Method:
    """One RPC: its names, streaming kinds and message classes."""

    name: str  # "ConfigureOptimizer"
    key: str  # "configure_optimizer": the name in ServerStats.requests
    path: str  # "/kdist.ps.v1.VariableService/ConfigureOptimizer"
    request_streaming: bool
    response_streaming: bool
    request_class: type
    response_class: type

    def request_coders(self):
        """`(serializer, deserializer)` of the request."""
        return _coders(self.request_class)

    def response_coders(self):
        """`(serializer, deserializer)` of the response."""
        return _coders(self.response_class)

    def handler(self, behavior):
        """Returns the `grpc.RpcMethodHandler` running `behavior(request, context)`."""
        _, request_deserializer = self.request_coders()
        response_serializer, _ = self.response_coders()
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(self.request_streaming, self.response_streaming)]
        return factory(behavior, request_deserializer=request_deserializer,
                       response_serializer=response_serializer)

    def callable(self, channel):
        """Returns the client-side multi-callable of this method on `channel`."""
        request_serializer, _ = self.request_coders()
        _, response_deserializer = self.response_coders()
        factory = {
            (False, False): channel.unary_unary,
            (False, True): channel.unary_stream,
            (True, False): channel.stream_unary,
            (True, True): channel.stream_stream,
        }[(self.request_streaming, self.response_streaming)]
        return factory(self.path, request_serializer=request_serializer,
                       response_deserializer=response_deserializer)

    def single_request_callable(self, channel):
        """The multi-callable of this method for a request of one message: a unary request, a response stream.

        The wire format is the one of the method's own kinds (a request stream
        of one message, a unary answer as a stream of one message). On a
        channel with `grpc.experimental.ChannelOptions.SingleThreadedUnaryStream`
        such a call runs in the calling thread: grpcio starts no thread to send
        the request (it does for every streamed one), and none to read the
        answer (it does for a unary future on a channel without a call in flight).
        """
        request_serializer, _ = self.request_coders()
        _, response_deserializer = self.response_coders()
        return channel.unary_stream(self.path, request_serializer=request_serializer,
                                    response_deserializer=response_deserializer)


def _coders(message_class):
    if is_framed(message_class):
        return codec.frame_serializer, codec.frame_deserializer(message_class)
    return message_class.SerializeToString, message_class.FromString


METHODS = {
    method.name: Method(
        name=method.name,
        key=_snake_case(method.name),
        path=f"/{SERVICE_NAME}/{method.name}",
        request_streaming=method.client_streaming,
        response_streaming=method.server_streaming,
        request_class=getattr(pb, method.input_type.name),
        response_class=getattr(pb, method.output_type.name),
    )
    for method in _SERVICE.methods
}
