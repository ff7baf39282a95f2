"""Tables initialised where they live: a shard's first value computed on its parameter server.

A worker or chief that creates an embedding table of 10^7 rows must not hold
it, not even while it is being initialised. It sends the table's Keras
initializer instead of its value (`ServerInitializer` in the proto: the
initializer's config with its seed resolved, the whole table's shape and the
shard's first row); each server computes the whole value with that
initializer, exactly as `initializer(shape, dtype)` would on the creating
process's CPU, and keeps its own rows. A seeded Keras initializer is a pure
function of its config and the shape, so every shard agrees with one device.

Only Keras' own initializers are accepted (module `keras.initializers`, no
registered custom class): the server deserialises a config, never code.
Initializers that do not depend on the shape (`Zeros`, `Ones`, `Constant`)
compute the shard alone; the others compute the whole value once and keep a
copy of the shard, so a server briefly holds the whole table.
"""

import json

import keras
import numpy as np

from kdist.errors import InvalidArgumentError
from kdist.rpc import dtypes

# Initializers whose value at a position does not depend on the whole shape.
_SHAPE_FREE = frozenset({"Zeros", "Ones", "Constant"})


def initial_shard(config_json, full_shape, row_start, shard_shape, dtype):
    """The value of rows `[row_start, row_start + shard_shape[0])` of a table initialised by `config_json`.

    Raises:
        kdist.errors.InvalidArgumentError: the config is not a built-in Keras
            initializer, or the shard does not lie inside `full_shape`.
    """
    full_shape, shard_shape = tuple(int(n) for n in full_shape), tuple(int(n) for n in shard_shape)
    if (len(full_shape) != len(shard_shape) or full_shape[1:] != shard_shape[1:] or row_start < 0
            or not full_shape or row_start + shard_shape[0] > full_shape[0]):
        raise InvalidArgumentError(
            f"A server-initialised shard must lie inside its table. Received: rows {row_start} to "
            f"{row_start + (shard_shape[0] if shard_shape else 0)} of shape {shard_shape}, table shape {full_shape}."
        )
    try:
        config = json.loads(config_json)
        valid = (isinstance(config, dict) and config.get("module") == "keras.initializers"
                 and not config.get("registered_name"))
    except ValueError:
        valid = False
    if not valid:
        raise InvalidArgumentError(
            "A server computes initial values with Keras' own initializers only. Received: "
            f"{config_json[:200]!r}. Create the variable with its value instead."
        )
    initializer = keras.initializers.deserialize(config)
    shape_free = config.get("class_name") in _SHAPE_FREE
    with keras.device("cpu"):
        value = initializer(shard_shape if shape_free else full_shape, dtype=dtype.name)
    array = dtypes.to_numpy(keras.ops.convert_to_tensor(value).detach().cpu())
    if shape_free:
        return np.ascontiguousarray(array)
    # A copy: the whole value is freed when this returns.
    return array[row_start:row_start + shard_shape[0]].copy()
