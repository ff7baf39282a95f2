"""The tensor codec: framing, chunking and reassembly, without gRPC."""

import ml_dtypes
import numpy as np
import pytest
import torch

from kdist.errors import InvalidArgumentError
from kdist.ps.wire import codec
from kdist.ps.wire._generated import variable_service_pb2 as pb
from kdist.rpc import dtypes


def _header(arrays):
    return pb.CreateHeader(items=[
        pb.CreateItem(name=f"v{index}", value=codec.tensor_meta(array))
        for index, array in enumerate(arrays)
    ])


def _roundtrip(arrays, chunk_bytes):
    messages = list(codec.encode_stream(
        _header(arrays), [codec.byte_view(array) for array in arrays], chunk_bytes))
    deserialize = codec.frame_deserializer(pb.CreateRequest)
    frames = [deserialize(message) for message in messages]
    header, received = codec.read_stream(
        frames, lambda header: [codec.parse_meta(item.value, item.name) for item in header.items],
        "test")
    return messages, header, received


@pytest.mark.parametrize("chunk_bytes", [1, 7, 1000, 1 << 20])
def test_roundtrip_any_chunk_size(chunk_bytes):
    rng = np.random.default_rng(0)
    arrays = [
        rng.standard_normal((33, 5)).astype("float32"),
        np.zeros((0, 4), "float64"),
        np.arange(17, dtype="int64"),
        np.array(3.5, "float16"),
        rng.standard_normal(9).astype(ml_dtypes.bfloat16),
        np.array([True, False]),
    ]
    messages, header, received = _roundtrip(arrays, chunk_bytes)
    assert [item.name for item in header.items] == [f"v{index}" for index in range(6)]
    for sent, got in zip(arrays, received):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert got.tobytes() == sent.tobytes()
        assert got.flags.writeable and got.flags.c_contiguous and got.flags.aligned
    total = sum(array.nbytes for array in arrays)
    assert len(messages) >= -(-total // chunk_bytes)


def test_messages_are_valid_protobuf():
    # The hand-framed messages must parse with the generated classes.
    array = np.arange(3000, dtype="float32")
    messages = list(codec.encode_stream(_header([array]), [codec.byte_view(array)], 4096))
    assert len(messages) == 3
    parsed = [pb.CreateRequest.FromString(message) for message in messages]
    assert parsed[0].HasField("header") and not parsed[1].HasField("header")
    assert b"".join(message.payload for message in parsed) == array.tobytes()
    for message in messages[1:]:
        assert codec.frame_deserializer(pb.CreateRequest)(message).header is None


def test_payload_only_fast_path_agrees_with_protobuf():
    payload = bytes(range(256)) * 700  # a multi-byte varint length
    message = pb.CreateRequest(payload=payload).SerializeToString()
    frame = codec.frame_deserializer(pb.CreateRequest)(message)
    assert frame.header is None and bytes(frame.payload) == payload
    # A message with an extra field is not taken by the fast path.
    mixed = message + pb.CreateRequest(header=pb.CreateHeader()).SerializeToString()
    frame = codec.frame_deserializer(pb.CreateRequest)(mixed)
    assert frame.header is not None and bytes(frame.payload) == payload


def test_short_stream_is_rejected():
    array = np.arange(100, dtype="float32")
    messages = list(codec.encode_stream(_header([array]), [codec.byte_view(array)], 128))
    deserialize = codec.frame_deserializer(pb.CreateRequest)
    with pytest.raises(InvalidArgumentError, match="ended early"):
        codec.read_stream([deserialize(message) for message in messages[:-1]],
                          lambda header: [(np.dtype("float32"), (100,))], "test")


def test_long_stream_is_rejected():
    array = np.arange(100, dtype="float32")
    messages = list(codec.encode_stream(_header([array]), [codec.byte_view(array)], 128))
    deserialize = codec.frame_deserializer(pb.CreateRequest)
    with pytest.raises(InvalidArgumentError, match="more payload"):
        codec.read_stream([deserialize(message) for message in messages],
                          lambda header: [(np.dtype("float32"), (99,))], "test")


def test_stream_without_header_is_rejected():
    frame = codec.Frame(None, memoryview(b"abc"))
    with pytest.raises(InvalidArgumentError, match="header"):
        codec.read_stream([frame], lambda header: [], "test")


def test_torch_inputs_share_memory_and_bfloat16_converts():
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    array = codec.as_array(tensor, "x")
    assert np.shares_memory(array, tensor.numpy())
    half = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    array = codec.as_array(half, "x")
    assert array.dtype.name == "bfloat16" and array.astype("float32").tolist() == [1.5, -2.0]
    assert torch.equal(dtypes.to_torch(array), half)


def test_unsupported_dtype_and_shape_are_rejected():
    with pytest.raises(InvalidArgumentError, match="complex64"):
        codec.as_array(np.zeros(2, "complex64"), "x")
    with pytest.raises(InvalidArgumentError, match="dtype"):
        codec.parse_meta(pb.TensorMeta(dtype="object", shape=[1]), "x")
    with pytest.raises(InvalidArgumentError, match="shape"):
        codec.parse_meta(pb.TensorMeta(dtype="float32", shape=[-1]), "x")
