"""Flat per-dtype buckets: how many tensors travel in one collective call.

On gloo one call per variable is 4-300x slower than one call for the same
bytes, so `ProcessCollectives` flattens the tensors of one dtype into buckets of
up to `CommunicationOptions.bucket_bytes` and makes one call per bucket.

A layout is the tuple of `(shape, dtype)` of a list of tensors, in order; every
rank derives the same buckets from the same layout, so every rank makes the
same calls in the same order.

With compression (`kdist.Compression`) the buckets hold the wire dtype: wider
floating tensors are cast on the way in, and `decompress()` casts the sums back
into `outputs`.
"""

import math

import torch

# Below this average size per tensor, filling a bucket by one concatenation and
# one in-place scaling beats one multiplication call per tensor (measured: 200
# tensors of 40 KB, 2x faster).
_SMALL_TENSOR_BYTES = 2**20


class ReductionBuffers:
    """Flat per-dtype buckets for a list of tensors, and a view of them per tensor.

    Not thread-safe: filled and reduced by one thread at a time.

    Args:
        like: tensors whose shapes and dtypes (in order) define the layout.
        bucket_bytes: the largest bucket.
        device: where the buckets live.
        compression: a `kdist.collectives.compression.Compressor` (None: none).
        order: bucket the positions in this order (each bucket one dtype, cut
            at the byte caps and where the dtype changes) instead of grouping
            them per dtype: the order gradients become ready during backward.
        first_bucket_bytes: with `order`, the cap of the first bucket.

    Attributes:
        flats: the buckets, in the order they are reduced.
        views: one view into the buckets per tensor of `like` (wire dtype).
        bucket_positions: the positions of `like` each bucket holds.
        bucket_of: the bucket index of each position.
    """

    def __init__(self, like, bucket_bytes, device, compression=None, order=None, first_bucket_bytes=None):
        self.layout = _layout(like)
        wire = tuple(
            (shape, dtype if compression is None else compression.wire_dtype_for(dtype)) for shape, dtype in self.layout
        )
        self.compressed = wire != self.layout
        if order is None:
            groups = list(_bucket_positions(wire, bucket_bytes))
        else:
            groups = list(_ordered_bucket_positions(wire, order, bucket_bytes, first_bucket_bytes or bucket_bytes))
        self.flats = []
        self.views = [None] * len(self.layout)
        self.bucket_positions = []
        self.bucket_of = [None] * len(self.layout)
        for index, positions in enumerate(groups):
            dtype = wire[positions[0]][1]
            sizes = [math.prod(self.layout[p][0]) for p in positions]
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            for p, part in zip(positions, flat.split(sizes)):
                self.views[p] = part.view(self.layout[p][0])
                self.bucket_of[p] = index
            self.flats.append(flat)
            self.bucket_positions.append(positions)
        # Where the sums are read: the views, or (compressed) tensors of the
        # original dtypes that `decompress` fills; allocated once, reused.
        self.outputs = self.views
        if self.compressed:
            self.outputs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.layout]

    def matches(self, like):
        return _layout(like) == self.layout

    def decompress(self, positions=None):
        """Casts the (reduced) views back into `outputs` (no-op when not compressed).

        Args:
            positions: only these (default: all).
        """
        if not self.compressed:
            return
        with torch.no_grad():
            for p in range(len(self.layout)) if positions is None else positions:
                self.outputs[p].copy_(self.views[p])

    def fill_weighted(self, tensor_lists, weights):
        """Writes `Σ_k weights[k] * tensor_lists[k][i]` into view i; returns the views.

        The first contributor's values go straight into the buckets: one
        multiplication per tensor into its view when tensors are large (one
        pass over the bytes), or one concatenation plus one in-place scaling per
        bucket when they are small (per-tensor calls would cost more than the
        second pass). Same arithmetic as `kdist.collectives.local.weighted_sum`.
        """
        if self.compressed:
            # Summed in the tensors' own precision, rounded to the wire dtype once.
            with torch.no_grad():
                for p, view in enumerate(self.views):
                    total = tensor_lists[0][p].detach() * weights[0]
                    for tensors, weight in zip(tensor_lists[1:], weights[1:]):
                        total = total + tensors[p].detach().to(total.device) * weight
                    view.copy_(total)
            return self.views
        first, weight = tensor_lists[0], weights[0]
        with torch.no_grad():
            for flat, positions in zip(self.flats, self.bucket_positions):
                if flat.numel() * flat.element_size() < _SMALL_TENSOR_BYTES * len(positions):
                    torch.cat([first[p].detach().reshape(-1).to(flat.device) for p in positions], out=flat)
                    if weight != 1.0:
                        flat.mul_(weight)
                else:
                    for p in positions:
                        torch.mul(first[p].detach().to(flat.device), weight, out=self.views[p])
            for tensors, weight in zip(tensor_lists[1:], weights[1:]):
                tensors = [t.detach().to(self.views[0].device) for t in tensors]
                torch._foreach_add_(self.views, tensors, alpha=weight)
        return self.views

    def fill(self, tensors):
        """Copies `tensors` into the buckets (one concatenation per bucket)."""
        for flat, positions in zip(self.flats, self.bucket_positions):
            parts = [tensors[p].detach().reshape(-1) for p in positions]
            torch.cat([part if part.device == flat.device else part.to(flat.device) for part in parts], out=flat)


def _layout(tensors):
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def _bucket_positions(layout, bucket_bytes):
    """Positions grouped per dtype (in first-seen order), each group cut at `bucket_bytes`."""
    by_dtype = {}
    for position, (_, dtype) in enumerate(layout):
        by_dtype.setdefault(dtype, []).append(position)
    for dtype, positions in by_dtype.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        bucket, size = [], 0
        for p in positions:
            nbytes = math.prod(layout[p][0]) * itemsize
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(p)
            size += nbytes
        if bucket:
            yield bucket


def _ordered_bucket_positions(layout, order, bucket_bytes, first_bucket_bytes):
    """`order` cut into runs of one dtype, the first at most `first_bucket_bytes`, the rest `bucket_bytes`.

    A tensor larger than the cap gets a bucket of its own.
    """
    bucket, size, cap = [], 0, first_bucket_bytes
    for p in order:
        shape, dtype = layout[p]
        nbytes = math.prod(shape) * dtype.itemsize
        if bucket and (size + nbytes > cap or layout[bucket[0]][1] != dtype):
            yield bucket
            bucket, size, cap = [], 0, bucket_bytes
        bucket.append(p)
        size += nbytes
    if bucket:
        yield bucket
