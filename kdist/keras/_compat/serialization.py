"""Keras' serialization without its TensorFlow import.

`keras.saving.serialize_keras_object` (behind `get_config`, `get_compile_config`,
`keras.optimizers.serialize`, `model.save`) asks `tf.available` before its
`isinstance(obj, tf.TensorShape)` checks, and `available` imports TensorFlow
when it is installed: seconds of start-up and hundreds of MB of memory in every
process that serializes, on any backend. kdist serializes where plain Keras
would not (a parameter-server worker sends its optimizer's config, a coordinator
its model's compile config), so on torch every such process paid for
TensorFlow without using it.

An object can only be a TensorFlow `TensorShape`, `DType` or `TypeSpec` once
TensorFlow is imported, so those checks answer the same with
`available` read as "installed and imported": `serialization_lib`'s `tf` is
replaced by a view of Keras' lazy module that says so, and delegates every
other attribute (deserializing a saved TypeSpec still imports TensorFlow).
Nothing else changes: Keras' other users of the lazy module (`StringLookup`,
`set_random_seed`, ...) keep theirs.
"""

import sys

from keras.src.saving import serialization_lib as _serialization_lib

PINNED = {
    # The module-level lazy `tf` whose `available` the checks read.
    "serialization_lib.tf": lambda: type(_serialization_lib.tf).available,
}


class _ImportedTensorFlow:
    """Keras' lazy `tensorflow` module, `available` only once TensorFlow is imported."""

    def __init__(self, lazy_module):
        self._lazy_module = lazy_module

    @property
    def available(self):
        return "tensorflow" in sys.modules and self._lazy_module.available

    def __getattr__(self, name):
        return getattr(self._lazy_module, name)

    def __repr__(self):
        return f"{self._lazy_module!r} (available once imported)"


def serialize_without_importing_tensorflow():
    """Makes Keras' serialization stop importing TensorFlow (see module doc). Idempotent."""
    if not isinstance(_serialization_lib.tf, _ImportedTensorFlow):
        _serialization_lib.tf = _ImportedTensorFlow(_serialization_lib.tf)


def serialization_imports_tensorflow():
    """True while Keras' serialization still imports TensorFlow when it is installed."""
    return not isinstance(_serialization_lib.tf, _ImportedTensorFlow)
