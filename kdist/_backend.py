"""Chooses Keras' backend before Keras is imported (the one place kdist writes os.environ)."""

import os
import sys

from kdist.errors import BackendError

SUPPORTED_BACKENDS = ("torch",)


def ensure_torch_backend():
    """Sets `KERAS_BACKEND=torch` if Keras is not imported yet; checks it otherwise.

    Raises:
        kdist.errors.BackendError: Keras is already imported with another
            backend, or `KERAS_BACKEND` names another backend.
    """
    keras_module = sys.modules.get("keras")
    if keras_module is None:
        requested = os.environ.get("KERAS_BACKEND")
        if requested not in (None, "", "torch"):
            raise BackendError(
                "kdist drives Keras on the torch backend. Received: "
                f"KERAS_BACKEND={requested!r}. Unset it or set KERAS_BACKEND=torch "
                "before starting Python."
            )
        os.environ["KERAS_BACKEND"] = "torch"
        return
    backend = keras_module.backend.backend()
    if backend not in SUPPORTED_BACKENDS:
        raise BackendError(
            f"Keras was imported with the {backend!r} backend before kdist. Received: "
            f"keras.backend.backend()={backend!r}; kdist needs 'torch'. Import kdist "
            "before keras, or set KERAS_BACKEND=torch before starting Python."
        )
