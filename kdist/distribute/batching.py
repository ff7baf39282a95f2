"""Splitting a global batch into per-replica shards.

The rule everywhere in kdist (`fit`, `evaluate`, `predict`,
`experimental_distribute_dataset`): replica k gets a contiguous slice, the
slices are as even as possible and the first `batch % replicas` replicas get one
extra sample. A global batch of 8 over 2 replicas is `[0..3]`, `[4..7]`; a
partial batch of 7 over 3 replicas is `[0..2]`, `[3..4]`, `[5..6]`.

TensorFlow's rebatching instead fills replicas up to the per-replica batch size
(a batch of 6 over 2 replicas with a global batch of 8 becomes `[0..3]`,
`[4, 5]`); kdist balances the work instead. Both keep every sample exactly once
and in order.
"""

from kdist.distribute import nest
from kdist.errors import InvalidArgumentError


def split_sizes(total, num_parts):
    """Returns `num_parts` sizes that add up to `total`, as even as possible."""
    base, extra = divmod(total, num_parts)
    return [base + 1 if part < extra else base for part in range(num_parts)]


def batch_size_of(batch):
    """The size of the leading dimension shared by every array leaf of `batch`.

    Raises:
        kdist.errors.InvalidArgumentError: the leaves disagree or none has a
            batch dimension.
    """
    sizes = {
        len(leaf)
        for leaf in nest.flatten(batch)
        if leaf is not None and getattr(leaf, "shape", None) is not None and len(leaf.shape)
    }
    if len(sizes) != 1:
        raise InvalidArgumentError(
            "Every array in a batch must have the same leading (batch) dimension. "
            f"Received leading sizes {sorted(sizes)}."
        )
    return sizes.pop()


def split_batch(batch, num_replicas):
    """Splits `batch` into `num_replicas` contiguous shards.

    Returns:
        A list of `(shard, num_samples)` pairs, one per replica. Replicas beyond
        the batch size receive an empty shard and `num_samples=0`.
    """
    total = batch_size_of(batch)
    shards = []
    start = 0
    for size in split_sizes(total, num_replicas):
        shards.append((slice_batch(batch, start, start + size), size))
        start += size
    return shards


def slice_batch(batch, start, stop):
    """Rows `start:stop` of every array leaf of `batch` (views); other leaves as they are."""

    def take(leaf):
        if leaf is None or getattr(leaf, "shape", None) is None or not len(leaf.shape):
            return leaf
        return leaf[start:stop]

    return nest.map_structure(take, batch)
