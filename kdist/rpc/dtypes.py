"""Dtype names and the one bfloat16 policy of kdist's parameter-server path.

One canonical spelling: a dtype given as a string (`"float32"`, `"bfloat16"`,
`"string"`), a NumPy dtype or scalar type, a Keras dtype string, or a
`torch.dtype` is named by its NumPy-style name (`"float32"`, `"int64"`,
`"bool"`, `"bfloat16"`), or `"string"` for string and object dtypes
(`canonical_dtype_name`). `numpy_dtype` and `torch_dtype` turn a canonical
name back into a dtype.

bfloat16 is supported end to end and round-trips exactly: a bfloat16 variable
keeps its dtype through the router, the codec, the server's store, its
checkpoints and the coordinator payload. NumPy has no bfloat16; `ml_dtypes`
(a Keras dependency) provides one, and a torch tensor becomes a NumPy array
and back through a same-size integer view of its bits (`to_numpy`,
`to_torch`: no copy, no rounding). A format that cannot hold the type (an
`.npy` file) stores those integer bits (`storable`) and records the
canonical name beside them to read them back (`from_storable`).
"""

from typing import NamedTuple

import numpy as np
import torch

from kdist.errors import InvalidArgumentError

try:
    import ml_dtypes
except ImportError:  # bfloat16 is then unavailable; every other dtype works.
    ml_dtypes = None

STRING = "string"
"""The canonical name of string (and object) dtypes."""

_STRING_NAMES = frozenset({"string", "str", "bytes", "object"})


class _BitView(NamedTuple):
    """A dtype NumPy lacks: its torch dtype and the same-size integer its bits travel as."""

    torch_dtype: torch.dtype
    torch_bits: torch.dtype
    numpy_bits: np.dtype


_BIT_VIEWS = {"bfloat16": _BitView(torch.bfloat16, torch.int16, np.dtype(np.int16))}


def canonical_dtype_name(dtype):
    """Returns the canonical name of a dtype, e.g. `"float32"`.

    Args:
        dtype: a string (`"float32"`, `"bfloat16"`, `"string"`), a NumPy dtype or
            scalar type, or a `torch.dtype`.

    Returns:
        The NumPy-style name of the dtype (`"float32"`, `"int64"`, `"bool"`,
        `"bfloat16"`), or `"string"` for string and object dtypes.

    Raises:
        kdist.errors.InvalidArgumentError: `dtype` is not a dtype.

    Example:

    >>> canonical_dtype_name(torch.float16)
    'float16'
    >>> canonical_dtype_name(np.int64)
    'int64'
    """
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str):
        name = dtype.strip().lower()
        if name in _STRING_NAMES:
            return STRING
        if torch_dtype(name) is not None:
            # Types NumPy lacks (bfloat16, float8_*) are known by their torch name.
            return name
        dtype = name
    try:
        numpy_type = np.dtype(dtype)
    except TypeError:
        raise InvalidArgumentError(
            f"Unknown dtype. Received: dtype={dtype!r}. Expected a dtype name such as "
            "'float32', a NumPy dtype or a torch.dtype."
        ) from None
    if numpy_type.kind in "OSU":
        return STRING
    return numpy_type.name


def torch_dtype(name):
    """The torch dtype whose canonical name is `name`; None for aliases and unknown names.

    Example:

    >>> torch_dtype("bfloat16")
    torch.bfloat16
    """
    candidate = getattr(torch, name, None)
    if isinstance(candidate, torch.dtype) and str(candidate) == f"torch.{name}":
        return candidate
    return None


def numpy_dtype(name):
    """The NumPy dtype of the canonical name `name` (`ml_dtypes` for bfloat16 and float8).

    Raises:
        kdist.errors.InvalidArgumentError: NumPy (with `ml_dtypes`) has no such dtype.

    Example:

    >>> numpy_dtype("bfloat16").name
    'bfloat16'
    """
    if name == STRING:
        return np.dtype(object)
    try:
        return np.dtype(name)
    except TypeError:
        pass
    found = getattr(ml_dtypes, name, None) if isinstance(name, str) else None
    if found is None:
        raise InvalidArgumentError(
            f"NumPy has no dtype of that name. Received: dtype={name!r}. Expected a "
            "canonical dtype name such as 'float32' or 'bfloat16' (needs ml_dtypes)."
        )
    return np.dtype(found)


def is_floating(dtype):
    """Whether the NumPy `dtype` is a floating-point type, bfloat16 and float8 included.

    Example:

    >>> is_floating(numpy_dtype("bfloat16")), is_floating(np.dtype("int64"))
    (True, False)
    """
    # bfloat16 and the float8 types (ml_dtypes) are not np.floating subclasses.
    return np.issubdtype(dtype, np.floating) or "float" in dtype.name


def to_numpy(tensor):
    """A NumPy array sharing memory with the CPU torch `tensor` (bfloat16 included, exactly)."""
    tensor = tensor.detach()
    name = canonical_dtype_name(tensor.dtype)
    view = _BIT_VIEWS.get(name)
    if view is None:
        return tensor.numpy()
    return tensor.view(view.torch_bits).numpy().view(numpy_dtype(name))


def to_torch(array):
    """A torch tensor sharing memory with the C-contiguous NumPy `array` (bfloat16 included)."""
    view = _BIT_VIEWS.get(array.dtype.name)
    if view is None:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(view.numpy_bits)).view(view.torch_dtype)


def storable(array):
    """`array` in a dtype every NumPy format holds: a bfloat16 array as its int16 bits (a view)."""
    view = _BIT_VIEWS.get(array.dtype.name)
    return array if view is None else array.view(view.numpy_bits)


def from_storable(array, name):
    """Reverses `storable`: the bits read back as the canonical dtype `name` (a view)."""
    view = _BIT_VIEWS.get(name)
    if view is None or array.dtype != view.numpy_bits:
        return array
    return array.view(numpy_dtype(name))

