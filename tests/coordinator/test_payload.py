"""Payloads: cloudpickle for objects, raw bytes for every tensor inside them."""

import pickle

import numpy as np
import pytest
import torch

import kdist  # noqa: F401
from kdist.coordinator import payload


def test_tensors_travel_as_raw_bytes_beside_the_pickle():
    array = np.arange(12, dtype="float32").reshape(3, 4)
    tensor = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    message = payload.dumps({"a": array, "t": tensor, "n": 3})
    assert [t.dtype for t in message.tensors] == ["<f4", "<i8"]
    assert message.tensors[0].data == array.tobytes()
    assert array.tobytes() not in message.pickle  # not pickled a second time
    restored = payload.loads(message)
    np.testing.assert_array_equal(restored["a"], array)
    assert isinstance(restored["t"], torch.Tensor) and torch.equal(restored["t"], tensor)
    assert restored["n"] == 3


def test_bfloat16_and_scalars_round_trip():
    tensor = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    scalar = np.float32(2.5)
    zero_d = np.array(7, dtype="int32")
    restored = payload.loads(payload.dumps((tensor, scalar, zero_d)))
    assert restored[0].dtype == torch.bfloat16 and restored[0].tolist() == [1.5, -2.0]
    assert restored[1] == scalar
    assert restored[2].shape == () and int(restored[2]) == 7


def test_closures_travel_by_value_and_references_resolve_on_the_other_side():
    offset = 10

    class Marker:
        pass

    marker = Marker()
    message = payload.dumps((lambda value: value + offset, marker),
                            resolve=lambda obj: ("kdist.resource", 5) if obj is marker else None)
    function, resolved = payload.loads(message, resolve=lambda reference: f"resource {reference[1]}")
    assert function(1) == 11
    assert resolved == "resource 5"


def test_an_unresolved_reference_is_a_clear_error():
    marker = object()
    message = payload.dumps([marker], resolve=lambda obj: ("kdist.resource", 1) if obj is marker else None)
    with pytest.raises(pickle.UnpicklingError, match="nothing here resolves"):
        payload.loads(message)


def test_arrays_of_python_objects_are_refused():
    with pytest.raises(kdist.errors.InvalidArgumentError, match="Python objects"):
        payload.tensor_message(np.array([object()], dtype=object))
