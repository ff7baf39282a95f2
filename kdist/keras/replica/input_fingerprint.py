"""The fingerprint of a batch that ranks compare to show they read the same global batch.

Used once per epoch (`per_rank_input.EpochInput`), so it reads everything:
a digest of every byte of every leaf, not a sample. A strided sample can keep
landing on constant values (the blank border of MNIST-shaped images) and call
two different batches equal.
"""

import hashlib

import numpy as np
import torch

from kdist.distribute import nest

# Bits of each fingerprint digest: a float64 (what the comparison all-reduces)
# holds integers below 2**53 exactly.
_FINGERPRINT_BITS = 52


def fingerprint(batch):
    """`[structure checksum, contents checksum]` of a batch (floats; equal batches, equal lists).

    Both are BLAKE2b digests folded to 52 bits, which a float64 carries
    exactly. The contents digest covers every byte of every leaf (strings
    and other objects by their `repr`): a strided sample can keep landing on
    constant values (an image's blank border) and miss two different batches.
    """
    structure, contents = hashlib.blake2b(digest_size=8), hashlib.blake2b(digest_size=8)
    for leaf in nest.flatten(batch):
        shape = getattr(leaf, "shape", None)
        kind = type(leaf).__name__ if shape is None else f"{tuple(shape)}:{leaf.dtype}"
        structure.update(f"{kind};".encode())
        contents.update(_leaf_bytes(leaf))
        contents.update(b"\x00;")  # leaf boundary: (ab, c) and (a, bc) differ
    return [_fold(structure), _fold(contents)]


def _fold(digest):
    return float(int.from_bytes(digest.digest(), "little") >> (64 - _FINGERPRINT_BITS))


def _leaf_bytes(leaf):
    if isinstance(leaf, torch.Tensor):
        flat = leaf.detach().reshape(-1).cpu().contiguous()
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes()
    if getattr(leaf, "shape", None) is None and not isinstance(leaf, (list, tuple)):
        return repr(leaf).encode()
    array = np.asarray(leaf)
    if array.dtype.kind == "O":  # Python objects (strings of a tf.data batch): their values, not pointers
        return "\x1f".join(repr(item) for item in array.reshape(-1)).encode()
    return np.ascontiguousarray(array).tobytes()
