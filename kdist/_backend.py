"""Which Keras backend kdist drives, chosen before Keras is imported.

kdist is torch first. `import kdist` settles the backend in this order:

1. Keras already imported: its backend (kdist follows it, or raises
   `BackendError` when it cannot drive it). When that backend is not torch
   and `KERAS_BACKEND` is not set, Keras took it from `keras.json`, not from
   the user: kdist warns once (`kdist.errors.BackendChoiceWarning`), naming the backend its
   strategies will use and the fix.
2. `KERAS_BACKEND` set: that backend.
3. Otherwise torch: kdist sets `KERAS_BACKEND=torch`, the one place it writes
   `os.environ`, before Keras reads it.

`keras.json` is not consulted: Keras writes `"backend": "tensorflow"` into a
new one on its first import, so it records no choice of the user's, and
following it would switch a torch user to TensorFlow as soon as TensorFlow is
installed. TensorFlow and JAX are one variable away: `KERAS_BACKEND=tensorflow`
or `KERAS_BACKEND=jax`.

Each strategy lists the backends it supports in `SUPPORTED_BACKENDS`;
`require_backend` raises a clear error for the others.
"""

import os
import sys
import threading
import warnings

from kdist.errors import BackendChoiceWarning, BackendError

SUPPORTED_BACKENDS = ("torch", "tensorflow", "jax")
DEFAULT_BACKEND = "torch"

# Where each strategy of the public API exists (each class's `SUPPORTED_BACKENDS`).
STRATEGY_BACKENDS = {
    "MirroredStrategy": ("torch", "tensorflow", "jax"),
    "MultiWorkerMirroredStrategy": ("torch", "tensorflow"),
    # The variable service, its optimizer hosts and the worker runtime are torch code.
    "ParameterServerStrategy": ("torch",),
}


# `select_backend` runs on `import kdist` and again on the first public name:
# the warning is given once per process.
_warned_lock = threading.Lock()
_warned = False


def _warn_implicit_backend(backend):
    """Warns once that Keras' backend came from keras.json, not from the user."""
    global _warned
    with _warned_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(
        f"Keras was imported before kdist with the {backend!r} backend, which Keras took from "
        f"keras.json (KERAS_BACKEND is not set), so kdist's strategies will use {backend}: "
        f"kdist.MirroredStrategy is the {backend} strategy, not the torch one. For torch, "
        f"`import kdist` before `import keras`, or set KERAS_BACKEND=torch before starting "
        f"Python. To keep {backend}, set KERAS_BACKEND={backend} and this warning goes away.",
        BackendChoiceWarning,
        stacklevel=3,
    )


def choose_backend(environ):
    """The backend to use when Keras is not imported yet, and whether kdist must set it.

    Args:
        environ: the process environment (read only).

    Returns:
        `(backend, set_environment)`: `set_environment` is True when
        `KERAS_BACKEND` is unset (or empty) and kdist picks torch.
    """
    requested = environ.get("KERAS_BACKEND")
    if requested:
        return requested, False
    return DEFAULT_BACKEND, True


def select_backend():
    """Settles the backend before kdist imports Keras; returns its name.

    Raises:
        kdist.errors.BackendError: the chosen backend is not one kdist drives.
    """
    keras_module = sys.modules.get("keras")
    if keras_module is not None and hasattr(keras_module, "backend"):
        backend = keras_module.backend.backend()
        source = f"Keras was imported with the {backend!r} backend before kdist"
        if backend != DEFAULT_BACKEND and backend in SUPPORTED_BACKENDS and not os.environ.get("KERAS_BACKEND"):
            _warn_implicit_backend(backend)
    else:
        backend, set_environment = choose_backend(os.environ)
        source = f"KERAS_BACKEND={backend!r}"
        if set_environment:
            os.environ["KERAS_BACKEND"] = backend
    if backend not in SUPPORTED_BACKENDS:
        raise BackendError(
            f"kdist drives Keras on the {', '.join(SUPPORTED_BACKENDS)} backends. Received: "
            f"{source}. Set KERAS_BACKEND to one of them before starting Python."
        )
    return backend


def current_backend():
    """The backend of the imported Keras."""
    import keras

    return keras.backend.backend()


def require_backend(feature, supported):
    """Raises unless the current backend is in `supported`.

    Args:
        feature: what needs it, e.g. `"ParameterServerStrategy"`.
        supported: backend names.

    Raises:
        kdist.errors.BackendError: naming the backend, what is supported and the fix.
    """
    backend = current_backend()
    if backend not in supported:
        raise BackendError(
            f"{feature} needs the {' or '.join(repr(name) for name in supported)} backend of "
            f"Keras. Received: keras.backend.backend()={backend!r}. Set KERAS_BACKEND="
            f"{supported[0]} before starting Python (see docs/backends.md)."
        )
    return backend
