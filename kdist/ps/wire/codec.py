"""The tensor codec: arrays <-> (dtype name, shape, raw bytes) in chunked streams.

A streamed message is a protobuf message with `header` (field 1) and `payload`
(field 2) — see `protos/variable_service.proto`. Payload-only messages, all
but the first of a stream, are framed and parsed here by hand: they are the
bulk of the bytes, and protobuf-python builds a message with a multi-MiB
bytes field at ~1 GB/s while a hand-written frame is one memcpy. The bytes on
the wire are exactly what the generated stubs would write and read, so any
protobuf client interoperates.

Receiving copies each chunk once, into the final (preallocated, aligned)
NumPy array; sending copies each chunk once, from a view of the source array
into the message.
"""

import math
import threading

import numpy as np
import torch

from kdist.errors import InvalidArgumentError
from kdist.ps.options import FRAMING_BYTES
from kdist.ps.wire._generated import variable_service_pb2 as pb
from kdist.ps.wire.status import ResourceExhaustedError
from kdist.rpc import dtypes

_HEADER_TAG = 0x0A  # field 1, length-delimited
_PAYLOAD_TAG = 0x12  # field 2, length-delimited
_MAX_DIMENSIONS = 32

# The dtypes that travel, by canonical name (`kdist.rpc.dtypes`); bfloat16 when
# ml_dtypes is installed (it is a Keras dependency). For each of them the NumPy
# dtype's `.name` is the canonical name, so headers carry `array.dtype.name`.
SUPPORTED_DTYPES = {
    name: dtypes.numpy_dtype(name)
    for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32",
                 "float64")
}
if dtypes.ml_dtypes is not None:
    SUPPORTED_DTYPES["bfloat16"] = dtypes.numpy_dtype("bfloat16")


def numpy_dtype(name, what="dtype"):
    """Returns the NumPy dtype called `name`, or raises InvalidArgumentError."""
    dtype = SUPPORTED_DTYPES.get(name)
    if dtype is None:
        raise InvalidArgumentError(
            f"Unsupported {what}. Received: {what}={name!r}. Expected one of "
            f"{sorted(SUPPORTED_DTYPES)}."
        )
    return dtype


def as_array(value, what):
    """Returns `value` (NumPy array, torch CPU tensor, scalar) as a C-contiguous array.

    No copy when `value` is already a C-contiguous array of a supported dtype
    (torch CPU tensors share memory).

    Raises:
        kdist.errors.InvalidArgumentError: a tensor on another device, or an
            unsupported dtype.
    """
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise InvalidArgumentError(
                f"{what} must be on the CPU. Received: a tensor on {value.device}. "
                "Move it with `.cpu()` first."
            )
        array = dtypes.to_numpy(value.detach().contiguous())
    else:
        array = np.asarray(value)
    if array.dtype.name not in SUPPORTED_DTYPES or array.dtype != SUPPORTED_DTYPES[array.dtype.name]:
        raise InvalidArgumentError(
            f"Unsupported dtype for {what}. Received: dtype={array.dtype}. Expected one of "
            f"{sorted(SUPPORTED_DTYPES)}."
        )
    return _c_contiguous(array)



def tensor_meta(array):
    """Returns the `TensorMeta` message describing `array`."""
    return pb.TensorMeta(dtype=array.dtype.name, shape=array.shape)


def parse_meta(meta, what):
    """Returns `(dtype, shape)` from a `TensorMeta`, validated.

    Raises:
        kdist.errors.InvalidArgumentError: unsupported dtype, negative
            dimension or too many dimensions.
    """
    dtype = numpy_dtype(meta.dtype, f"dtype of {what}")
    shape = tuple(int(dimension) for dimension in meta.shape)
    if len(shape) > _MAX_DIMENSIONS or any(dimension < 0 for dimension in shape):
        raise InvalidArgumentError(
            f"Invalid shape for {what}. Received: shape={shape}. Expected at most "
            f"{_MAX_DIMENSIONS} non-negative dimensions."
        )
    return dtype, shape


def byte_view(array):
    """Returns a flat uint8 view (no copy) of the C-contiguous `array`."""
    return array.reshape(-1).view(np.uint8)


def _varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def payload_prefix(num_bytes):
    """Returns the protobuf tag and length that precede `num_bytes` of payload."""
    return bytes((_PAYLOAD_TAG,)) + _varint(num_bytes)


class PayloadWriter:
    """Packs byte views into framed stream messages of at most `chunk_bytes` payload.

    The first message carries the serialized header. Not thread-safe.

    Example:

    >>> writer = PayloadWriter(b"", chunk_bytes=4)
    >>> [len(message) for message in writer.add(memoryview(bytes(10)))]
    [8, 6]
    >>> [len(message) for message in writer.finish()]
    [4]
    """

    def __init__(self, header_bytes, chunk_bytes):
        self._chunk_bytes = chunk_bytes
        self._pending = []  # views of the message being filled
        self._pending_bytes = 0
        self._header = bytes((_HEADER_TAG,)) + _varint(len(header_bytes)) + header_bytes
        # A header that fits in the framing allowance rides on top of a full
        # chunk (so a 1 MiB tensor is one message, not two); a larger one takes
        # room from the first chunk to keep the message within the limit.
        self._room = chunk_bytes if len(header_bytes) <= FRAMING_BYTES // 2 else max(1, chunk_bytes - len(header_bytes))
        self.num_payload_bytes = 0

    def add(self, view):
        """Appends the uint8 `view`; yields each message as soon as it is complete.

        A generator, so a large tensor's first message goes out before its
        last one is built. The viewed memory must not change until `finish()`:
        a partly filled message keeps a view of it.
        """
        view = memoryview(view)
        offset, size = 0, len(view)
        self.num_payload_bytes += size
        while offset < size:
            take = min(self._room - self._pending_bytes, size - offset)
            self._pending.append(view[offset:offset + take])
            self._pending_bytes += take
            offset += take
            if self._pending_bytes == self._room:
                yield self._flush()

    def finish(self):
        """Returns the last message(s): the remaining payload, or the header alone."""
        if self._pending or self._header is not None:
            return [self._flush()]
        return []

    def _flush(self):
        parts = [self._header] if self._header is not None else []
        if self._pending_bytes:
            parts.append(payload_prefix(self._pending_bytes))
            parts.extend(self._pending)
        message = b"".join(parts)
        self._header = None
        self._room = self._chunk_bytes
        self._pending, self._pending_bytes = [], 0
        return message


def encode_stream(header, views, chunk_bytes):
    """Yields the framed messages of a stream: `header` then the `views`' bytes.

    The views are read lazily, as gRPC asks for messages: they must not change
    until the call returns.
    """
    writer = PayloadWriter(header.SerializeToString(), chunk_bytes)
    for view in views:
        yield from writer.add(view)
    yield from writer.finish()


class Frame:
    """One received stream message: its header (None after the first) and payload view."""

    __slots__ = ("header", "payload")

    def __init__(self, header, payload):
        self.header = header
        self.payload = payload


def frame_deserializer(message_class):
    """Returns a gRPC deserializer producing `Frame`s of `message_class` messages."""

    def deserialize(data):
        fast = _payload_only(data)
        if fast is not None:
            return Frame(None, fast)
        message = message_class.FromString(data)
        header = message.header if message.HasField("header") else None
        return Frame(header, memoryview(message.payload))

    return deserialize


def frame_serializer(message):
    """gRPC serializer for streams: messages are already framed bytes."""
    return message


def _payload_only(data):
    # A message that is exactly one payload field: return a view of the payload.
    if not data or data[0] != _PAYLOAD_TAG:
        return None
    length, shift, position = 0, 0, 1
    while position < len(data) and position <= 10:
        byte = data[position]
        position += 1
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    else:
        return None
    if position + length != len(data):
        return None
    return memoryview(data)[position:]


class PayloadReader:
    """Copies a stream's payload, chunk by chunk, into arrays of known dtypes and shapes.

    Each array is allocated (aligned, writable) when its first byte arrives,
    so a header that announces more than the stream carries costs nothing.
    """

    def __init__(self, layout, what, allocate=None):
        self._layout = list(layout)  # [(dtype, shape)]
        self._what = what
        self._allocate = allocate
        self.arrays = []
        self._current = None
        self._position = 0
        self.num_bytes = 0
        self.expected_bytes = sum(
            math.prod(shape) * dtype.itemsize for dtype, shape in self._layout
        )
        self._advance()

    def _advance(self):
        # Skips to the next array that has bytes, allocating empty ones on the way.
        while len(self.arrays) < len(self._layout):
            dtype, shape = self._layout[len(self.arrays)]
            try:
                array = None if self._allocate is None else self._allocate(len(self.arrays), dtype, shape)
                if array is None:
                    array = np.empty(shape, dtype)
            except (MemoryError, ValueError) as error:
                raise ResourceExhaustedError(
                    f"Cannot allocate a {self._what} tensor of shape {shape} and dtype "
                    f"{dtype.name}: {error}."
                ) from None
            self.arrays.append(array)
            if array.nbytes:
                self._current = byte_view(array)
                self._position = 0
                return
        self._current = None

    def write(self, payload):
        offset, size = 0, len(payload)
        if size > self.expected_bytes - self.num_bytes:
            raise InvalidArgumentError(
                f"The {self._what} stream carries more payload than its header describes "
                f"({self.expected_bytes} bytes). Received: at least {self.num_bytes + size} bytes."
            )
        source = np.frombuffer(payload, np.uint8)
        while offset < size:
            take = min(len(self._current) - self._position, size - offset)
            self._current[self._position:self._position + take] = source[offset:offset + take]
            self._position += take
            offset += take
            if self._position == len(self._current):
                self._advance()
        self.num_bytes += size

    def finish(self):
        """Returns the arrays; raises InvalidArgumentError when bytes are missing."""
        if self.num_bytes != self.expected_bytes:
            raise InvalidArgumentError(
                f"The {self._what} stream ended early. Received: {self.num_bytes} payload "
                f"bytes. Expected: {self.expected_bytes} bytes, as its header describes."
            )
        return self.arrays


def read_stream(frames, layout_of_header, what, allocate=None):
    """Reads a request stream: returns `(header, arrays)`.

    `layout_of_header(header)` validates the header and returns the
    `[(dtype, shape)]` of the payload; it runs before any payload is stored.
    `allocate(index, dtype, shape)`, when given, may return a writable
    C-contiguous array of that dtype and shape to receive payload array
    `index` into (None: a new one).

    Raises:
        kdist.errors.InvalidArgumentError: no header, or a payload that does not
            match the header.
    """
    frames = iter(frames)
    first = next(frames, None)
    if first is None or first.header is None:
        raise InvalidArgumentError(
            f"The first message of a {what} stream must carry its header. Received: "
            f"{'no message' if first is None else 'a payload-only message'}."
        )
    reader = PayloadReader(layout_of_header(first.header), what, allocate)
    if len(first.payload):
        reader.write(first.payload)
    for frame in frames:
        if frame.header is not None:
            raise InvalidArgumentError(
                f"Only the first message of a {what} stream may carry a header. Received: "
                "a second header."
            )
        reader.write(frame.payload)
    return first.header, reader.finish()


def _c_contiguous(array):
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    return array if array.flags.c_contiguous else array.copy(order="C")


# Arrays below this size come cheaply from malloc's free lists; larger ones are
# fresh mappings whose first write page-faults (about as slow as the copy itself).
MIN_POOLED_BYTES = 1 << 20
# Idle receive buffers a process keeps for reuse, at most.
DEFAULT_POOL_BYTES = 256 << 20


class BufferPool:
    """Receive buffers kept for reuse, by dtype and shape. Thread-safe.

    A server receives each gradient of a large variable into a buffer of the
    same shape, push after push; reusing it avoids a fresh allocation whose
    every page faults on first write.
    """

    def __init__(self, max_bytes=DEFAULT_POOL_BYTES):
        self._max_bytes = max_bytes
        self._free = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, dtype, shape):
        """A pooled array of `dtype` and `shape`, or None when there is none."""
        with self._lock:
            arrays = self._free.get((dtype.str, tuple(shape)))
            if not arrays:
                return None
            array = arrays.pop()
            self._bytes -= array.nbytes
            return array

    def give(self, array):
        """Returns `array` for reuse; the caller must not use it afterwards."""
        if array.nbytes < MIN_POOLED_BYTES or not array.flags.c_contiguous or not array.flags.writeable:
            return
        with self._lock:
            if self._bytes + array.nbytes > self._max_bytes:
                return
            self._free.setdefault((array.dtype.str, array.shape), []).append(array)
            self._bytes += array.nbytes
