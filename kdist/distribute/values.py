"""Values that hold one component per replica.

`PerReplica` components may differ (each replica's loss, each replica's shard of
a batch). `Mirrored` components are equal by construction (an all-reduced
gradient copied to every replica's device). Both are leaves for
`kdist.distribute.nest`, so a structure of them (a `(x, y)` batch) is handled
leaf by leaf.
"""

from kdist.distribute import nest
from kdist.errors import InvalidArgumentError


class DistributedValues:
    """Base class of values with one component per replica.

    Args:
        values: a sequence with one component per replica, in replica order.

    Example:

    ```python
    per_replica = strategy.run(lambda: kdist.get_replica_context().replica_id_in_sync_group)
    strategy.experimental_local_results(per_replica)   # (0, 1)
    ```
    """

    def __init__(self, values):
        values = tuple(values)
        if not values:
            raise InvalidArgumentError(
                f"{type(self).__name__} needs at least one component. Received: values=()."
            )
        self._values = values

    @property
    def values(self):
        """The components, one per replica, as a tuple."""
        return self._values

    def __len__(self):
        return len(self._values)

    def __repr__(self):
        body = ",\n".join(f"  {i}: {value!r}" for i, value in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"


class PerReplica(DistributedValues):
    """Components that may differ from replica to replica."""


class Mirrored(DistributedValues):
    """Components that hold the same value on every replica's device."""


def local_results(value):
    """Returns the components of `value` as a tuple; `(value,)` for a plain value."""
    if isinstance(value, DistributedValues):
        return value.values
    return (value,)


def check_num_components(structure, num_replicas, argument_name):
    """Raises unless every distributed leaf of `structure` has `num_replicas` components.

    Raises:
        kdist.errors.InvalidArgumentError: a leaf was made for another number of
            replicas (e.g. by another strategy); its extra components would be
            dropped silently.
    """
    for leaf in nest.flatten(structure):
        if isinstance(leaf, DistributedValues) and len(leaf) != num_replicas:
            raise InvalidArgumentError(
                f"A distributed value in {argument_name} has {len(leaf)} components, "
                f"but the strategy runs {num_replicas} replicas. Received: "
                f"{type(leaf).__name__} with {len(leaf)} components. Build it with "
                "this strategy (its distributed dataset or "
                "experimental_distribute_values_from_function)."
            )


def select_replica(replica_id, structure):
    """Picks replica `replica_id`'s component from every distributed leaf."""

    def select(leaf):
        if isinstance(leaf, DistributedValues):
            return leaf.values[replica_id]
        return leaf

    return nest.map_structure(select, structure)


def regroup(per_replica_structures, wrap=PerReplica):
    """Merges one structure per replica into one structure of distributed leaves.

    A leaf that is the same object on every replica stays that object (the
    rule from the `call_for_each_replica` contract); otherwise it becomes
    `wrap(components)`. With one replica the structure is returned unchanged.
    """
    if len(per_replica_structures) == 1:
        return per_replica_structures[0]

    def merge(*leaves):
        if all(leaf is leaves[0] for leaf in leaves[1:]):
            return leaves[0]
        return wrap(leaves)

    return nest.map_structure(merge, *per_replica_structures)
