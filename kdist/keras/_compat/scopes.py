"""Keras' `StatelessScope`: a replica's scope opened from entries Keras converted once.

`keras.StatelessScope(mapping)` converts and shape-checks every `(variable,
value)` pair each time it is made (`convert_to_tensor` per variable, about
thirty Python calls each). A replica on the canonical device reads the
canonical Parameters themselves, the same tensors at every step of a layout,
so Keras' conversion of them is kept (per Keras device) and each step's scope
starts from a copy of it.
"""

import keras
from keras.src.backend.torch import core as _torch_core_module

PINNED = {
    "StatelessScope.state_mapping": lambda: keras.StatelessScope().state_mapping,
}


def stateless_scope(pairs, collect_losses, canonical=(), converted=None):
    """`keras.StatelessScope(canonical + pairs, collect_losses=...)`, converting `canonical` once.

    Args:
        pairs: `(variable, value)` pairs converted by this scope, as Keras does.
        collect_losses: as for `keras.StatelessScope`.
        canonical: `(variable, tensor)` pairs whose tensors are what the
            variables hold (the same at every call of a layout).
        converted: a dict owned by the caller for as long as `canonical`
            stays the same: Keras' conversion of `canonical` per Keras
            device, kept where it leaves every tensor as it is (the same
            object: right dtype, shape and device). Where a conversion
            would copy, `canonical` is converted again at every call.
    """
    entries = None
    if canonical:
        device = _torch_core_module.get_device()
        if device not in converted:
            converted[device] = _unchanged_entries(canonical)
        entries = converted[device]
        if entries is None:
            pairs = list(canonical) + list(pairs)
    scope = keras.StatelessScope(pairs, collect_losses=collect_losses)
    if entries:
        scope.state_mapping = {**entries, **scope.state_mapping}
    return scope


def _unchanged_entries(pairs):
    """Keras' `StatelessScope` entries `{id(variable): tensor}` for `pairs`, or None where one is not the tensor given."""
    entries = keras.StatelessScope(pairs).state_mapping
    if any(entries.get(id(variable)) is not tensor for variable, tensor in pairs):
        return None
    return entries
