"""Python objects on the wire between a coordinator and its workers.

A `Payload` message is a cloudpickle of the object plus a list of raw tensors.
While pickling, every numpy array and torch tensor is taken out of the pickle
and sent as raw bytes with its dtype and shape (a persistent id stands in its
place), and a caller's `resolve` hook may replace other objects — a model, an
optimizer, a per-worker iterator — by a reference the receiving side resolves
to its own object.

Why cloudpickle: scheduled functions and `dataset_fn`s are usually closures or
lambdas defined in the chief's `__main__`, which a worker cannot import.
cloudpickle (used by Ray, Dask and PySpark for the same job) sends them by
value, and everything importable by reference. Keras objects never travel as
pickles: they are rebuilt on the worker from their Keras configs
(`kdist.keras.parameter_server.worker_runtime`).

Only unpickle payloads from a peer you trust: unpickling runs code. Workers
accept them only from callers that passed the cluster's token or TLS check.
"""

import io
import pickle

import cloudpickle
import numpy as np
import torch

from kdist.coordinator._generated import worker_service_pb2 as pb
from kdist.errors import InvalidArgumentError
from kdist.rpc import dtypes

_TENSOR = "kdist.tensor"


class _Pickler(cloudpickle.CloudPickler):
    def __init__(self, file, resolve, tensors):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._resolve = resolve
        self._tensors = tensors

    def persistent_id(self, obj):
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            self._tensors.append(tensor_message(obj))
            return (_TENSOR, len(self._tensors) - 1, "numpy")
        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            self._tensors.append(tensor_message(obj))
            return (_TENSOR, len(self._tensors) - 1, "torch")
        if self._resolve is not None:
            return self._resolve(obj)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors, resolve):
        super().__init__(file)
        self._tensors = tensors
        self._resolve = resolve

    def persistent_load(self, pid):
        if pid[0] == _TENSOR:
            _, index, kind = pid
            array = tensor_value(self._tensors[index])
            return _torch_tensor(array) if kind == "torch" else array
        if self._resolve is None:
            raise pickle.UnpicklingError(f"The payload references {pid!r}, which nothing here resolves.")
        return self._resolve(pid)


def dumps(obj, resolve=None):
    """`obj` as a `Payload` message.

    Args:
        obj: any object cloudpickle can pickle.
        resolve: `obj -> tuple | None`; a tuple replaces the object by that
            reference (its first item must not be "kdist.tensor").
    """
    tensors = []
    buffer = io.BytesIO()
    _Pickler(buffer, resolve, tensors).dump(obj)
    return pb.Payload(pickle=buffer.getvalue(), tensors=tensors)


def loads(payload, resolve=None):
    """The object of a `Payload`; `resolve(reference) -> object` answers the references `dumps` made."""
    return _Unpickler(io.BytesIO(payload.pickle), payload.tensors, resolve).load()


def tensor_message(value):
    """A numpy array or torch tensor as a `Tensor` message (raw bytes, dtype, shape).

    The dtype travels as NumPy's `dtype.str` ("<f4"), or, for the types NumPy
    lacks (bfloat16, float8: `ml_dtypes`), as the canonical name
    (`kdist.rpc.dtypes`); the bytes are the values' own, so they round-trip exactly.
    """
    if isinstance(value, torch.Tensor):
        value = dtypes.to_numpy(value.detach().cpu().contiguous())
    array = np.asarray(value)
    if array.dtype == object:
        raise InvalidArgumentError(f"Cannot send an array of Python objects. Received: dtype={array.dtype}.")
    # ml_dtypes types have kind "V" and a dtype.str ("<V2") that names no type.
    wire_dtype = dtypes.canonical_dtype_name(array.dtype) if array.dtype.kind == "V" else array.dtype.str
    return pb.Tensor(dtype=wire_dtype, shape=list(array.shape), data=np.ascontiguousarray(array).tobytes())


def tensor_value(message):
    """The numpy array of a `Tensor` message, of the dtype it was sent with (bfloat16 included)."""
    dtype = dtypes.numpy_dtype(message.dtype)
    return np.frombuffer(message.data, dtype=dtype).reshape(tuple(message.shape)).copy()


def _torch_tensor(array):
    # bfloat16 included: a torch tensor arrives with the dtype it was sent with.
    return dtypes.to_torch(array)
