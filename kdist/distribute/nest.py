"""Maps functions over nested Python structures (lists, tuples, namedtuples, dicts).

Anything else, including `DistributedValues`, tensors and arrays, is a leaf.
Kept here rather than borrowed from Keras so that `kdist.distribute` does not
depend on Keras' private tree module.
"""

from kdist.errors import InvalidArgumentError


def _is_namedtuple(value):
    return isinstance(value, tuple) and hasattr(value, "_fields")


def is_nested(value):
    return isinstance(value, (list, tuple, dict))


def flatten(structure):
    """Returns the leaves of `structure` in a deterministic order (dict keys sorted)."""
    if isinstance(structure, dict):
        return [leaf for key in sorted(structure) for leaf in flatten(structure[key])]
    if isinstance(structure, (list, tuple)):
        return [leaf for item in structure for leaf in flatten(item)]
    return [structure]


def map_structure(fn, *structures):
    """Applies `fn` to the corresponding leaves of structures of the same shape.

    Raises:
        kdist.errors.InvalidArgumentError: the structures differ in shape.
    """
    first = structures[0]
    for other in structures[1:]:
        _check_same_shape(first, other)
    if isinstance(first, dict):
        return type(first)(
            (key, map_structure(fn, *(s[key] for s in structures))) for key in first
        )
    if _is_namedtuple(first):
        return type(first)(*(map_structure(fn, *items) for items in zip(*structures)))
    if isinstance(first, (list, tuple)):
        return type(first)(map_structure(fn, *items) for items in zip(*structures))
    return fn(*structures)


def _check_same_shape(first, other):
    if isinstance(first, dict):
        if not isinstance(other, dict) or set(first) != set(other):
            raise InvalidArgumentError(
                "Structures differ: a dict is matched with "
                f"{type(other).__name__}. Received keys {sorted(first)} and "
                f"{sorted(other) if isinstance(other, dict) else other!r}."
            )
    elif isinstance(first, (list, tuple)):
        if not isinstance(other, (list, tuple)) or len(first) != len(other):
            raise InvalidArgumentError(
                "Structures differ: a sequence of length "
                f"{len(first)} is matched with {other!r}."
            )
    elif is_nested(other):
        raise InvalidArgumentError(
            f"Structures differ: a leaf {first!r} is matched with {other!r}."
        )
