"""One dtype canonicaliser, and bfloat16 kept exactly on every path that holds a value."""

import io

import ml_dtypes
import numpy as np
import pytest
import torch

import kdist  # noqa: F401
from kdist.coordinator import payload
from kdist.errors import InvalidArgumentError
from kdist.ps.wire import codec
from kdist.rpc import dtypes

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("spelling, name", [
    (torch.float32, "float32"), (np.float16, "float16"), ("int64", "int64"), (np.dtype("bool"), "bool"),
    (torch.bfloat16, "bfloat16"), ("bfloat16", "bfloat16"), (BFLOAT16, "bfloat16"), (str, "string"),
    ("object", "string"),
])
def test_every_spelling_has_one_canonical_name(spelling, name):
    assert dtypes.canonical_dtype_name(spelling) == name


def test_canonical_names_turn_back_into_dtypes():
    assert dtypes.numpy_dtype("bfloat16") == BFLOAT16
    assert dtypes.numpy_dtype("float32") == np.dtype("float32")
    assert dtypes.torch_dtype("bfloat16") is torch.bfloat16
    assert dtypes.torch_dtype("float") is None  # an alias, not a canonical name
    with pytest.raises(InvalidArgumentError, match="dtype"):
        dtypes.numpy_dtype("float31")
    with pytest.raises(InvalidArgumentError, match="dtype"):
        dtypes.canonical_dtype_name("not a dtype")


def test_the_codec_and_partitioners_use_the_same_names():
    from kdist.distribute.parameter_server import partitioners

    assert partitioners.canonical_dtype_name is dtypes.canonical_dtype_name
    assert codec.SUPPORTED_DTYPES["bfloat16"] == dtypes.numpy_dtype("bfloat16")


def _bfloat16_tensor():
    # Values bfloat16 holds exactly, plus one whose float32 neighbours it is not.
    return torch.tensor([1.5, -2.0, 3.140625, 1e-3, 65280.0], dtype=torch.bfloat16)


def test_torch_and_numpy_bfloat16_share_memory_and_bits():
    tensor = _bfloat16_tensor()
    array = dtypes.to_numpy(tensor)
    assert array.dtype == BFLOAT16 and np.shares_memory(array, tensor.view(torch.int16).numpy())
    back = dtypes.to_torch(array)
    assert back.dtype == torch.bfloat16 and torch.equal(back, tensor)


def test_bfloat16_round_trips_through_codec_storage_and_payload():
    array = dtypes.to_numpy(_bfloat16_tensor())
    assert codec.as_array(_bfloat16_tensor(), "x").tobytes() == array.tobytes()
    # .npy: stored as bits, read back by name (what a checkpoint does).
    buffer = io.BytesIO()
    np.save(buffer, dtypes.storable(array), allow_pickle=False)
    buffer.seek(0)
    restored = dtypes.from_storable(np.load(buffer), "bfloat16")
    assert restored.dtype == BFLOAT16 and restored.tobytes() == array.tobytes()
    # The coordinator payload: a NumPy bfloat16 array arrives as one, exactly.
    message = payload.tensor_message(array)
    assert message.dtype == "bfloat16"
    received = payload.loads(payload.dumps({"a": array}))["a"]
    assert received.dtype == BFLOAT16 and received.tobytes() == array.tobytes()
