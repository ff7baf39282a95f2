"""Which Keras backend kdist drives, chosen before Keras is imported.

kdist respects the user's choice of backend, in Keras' own order:

1. Keras already imported: its backend.
2. `KERAS_BACKEND` set: that backend.
3. `keras.json` (in `$KERAS_HOME`, else `~/.keras`) names a backend: that one,
   except `"tensorflow"` when TensorFlow is not installed (Keras writes that
   default into a new `keras.json` itself, so it is no choice where Keras
   could not even import).
4. Nothing chosen: Keras' default (TensorFlow) when TensorFlow is installed,
   else torch. Only in this last case does kdist set `KERAS_BACKEND=torch`:
   the one place kdist writes `os.environ`, before Keras reads it.

Each strategy lists the backends it supports in `SUPPORTED_BACKENDS`;
`require_backend` raises a clear error for the others.
"""

import importlib.util
import json
import os
import sys

from kdist.errors import BackendError

SUPPORTED_BACKENDS = ("torch", "tensorflow", "jax")
DEFAULT_BACKEND = "torch"

# Where each strategy of the public API exists (each class's `SUPPORTED_BACKENDS`).
STRATEGY_BACKENDS = {
    "MirroredStrategy": ("torch", "tensorflow", "jax"),
    "MultiWorkerMirroredStrategy": ("torch", "tensorflow"),
    # The variable service, its optimizer hosts and the worker runtime are torch code.
    "ParameterServerStrategy": ("torch",),
}


def keras_config_path(environ=None):
    """Where Keras reads `keras.json`, following Keras' own rules."""
    environ = os.environ if environ is None else environ
    if "KERAS_HOME" in environ:
        directory = environ["KERAS_HOME"]
    else:
        base = os.path.expanduser("~")
        if not os.access(base, os.W_OK):
            base = "/tmp"
        directory = os.path.join(base, ".keras")
    return os.path.expanduser(os.path.join(directory, "keras.json"))


def _configured_backend(config_path):
    try:
        with open(config_path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    backend = config.get("backend") if isinstance(config, dict) else None
    return backend if isinstance(backend, str) and backend else None


def choose_backend(environ, config_backend, tensorflow_installed):
    """The backend to use when Keras is not imported yet, and whether kdist must set it.

    Args:
        environ: the process environment (read only).
        config_backend: the backend `keras.json` names, or None.
        tensorflow_installed: whether `import tensorflow` would find a package.

    Returns:
        `(backend, set_environment)`: `set_environment` is True when nothing
        was chosen and kdist picks torch.
    """
    requested = environ.get("KERAS_BACKEND")
    if requested:
        return requested, False
    if config_backend and (config_backend != "tensorflow" or tensorflow_installed):
        return config_backend, False
    if tensorflow_installed:
        return "tensorflow", False
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
    else:
        backend, set_environment = choose_backend(
            os.environ,
            _configured_backend(keras_config_path()),
            importlib.util.find_spec("tensorflow") is not None,
        )
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
