"""A `grpc.Channel` that may be closed while other threads still start calls on it.

grpcio (1.85 and earlier) crashes the process with a segmentation fault when a
method is first registered on a channel that is already closed: the stubs kdist
uses register each method on its first call, so a dispatcher or health thread
that makes its first `Define` just as `shutdown()` closes the channel kills the
interpreter. Registering a method and closing the channel are therefore done
under one lock here, and a closed channel answers every new call with the
`ValueError` grpc itself raises for a call on a closed channel (which callers
already treat as "shut down meanwhile"). A call whose method was registered
before the close fails the same way inside grpc, without touching freed memory.
"""

import threading

import grpc

CLOSED_MESSAGE = "Cannot invoke RPC on closed channel!"


class GuardedChannel(grpc.Channel):
    """Wraps a raw `grpc.Channel`; safe to close from any thread at any time.

    Args:
        channel: the raw channel (`grpc.insecure_channel` or `grpc.secure_channel`).
    """

    def __init__(self, channel):
        self._channel = channel
        self._lock = threading.Lock()
        self._closed = False

    @property
    def closed(self):
        return self._closed

    def _open(self, make, method, request_serializer, response_deserializer, _registered_method):
        with self._lock:
            if self._closed:
                raise ValueError(CLOSED_MESSAGE)
            return make(method, request_serializer=request_serializer,
                        response_deserializer=response_deserializer, _registered_method=_registered_method)

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return self._open(self._channel.unary_unary, method, request_serializer, response_deserializer,
                          _registered_method)

    def unary_stream(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return self._open(self._channel.unary_stream, method, request_serializer, response_deserializer,
                          _registered_method)

    def stream_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return self._open(self._channel.stream_unary, method, request_serializer, response_deserializer,
                          _registered_method)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return self._open(self._channel.stream_stream, method, request_serializer, response_deserializer,
                          _registered_method)

    def subscribe(self, callback, try_to_connect=False):
        self._channel.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback):
        self._channel.unsubscribe(callback)

    def close(self):
        """Closes the channel: calls in flight end CANCELLED, new ones raise `ValueError`. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self.close()
        return False
