"""kdist: tf.distribute-style distributed training for Keras 3 (torch first; TensorFlow and JAX too).

```python
import kdist, keras
strategy = kdist.MirroredStrategy()
with strategy.scope():
    model = keras.Sequential([...])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=256, epochs=5)
```

`import kdist` is light: it settles the Keras backend (torch unless
`KERAS_BACKEND` says otherwise, see `kdist._backend`) and imports neither
Keras nor torch, so the `kdist` command starts at once. The public names
below load on first use (PEP 562): the first access to any of them imports
Keras and kdist's engine and, on torch, installs kdist's Keras hooks, before
the user can create a model in a strategy's scope. Go through these names
(`kdist.MirroredStrategy`, `from kdist import MirroredStrategy`): importing an
internal module such as `kdist.distribute` directly does not install the hooks.
"""

import threading

from kdist._backend import select_backend

__version__ = "0.1.0"

# Must run before anything imports Keras: Keras reads KERAS_BACKEND once, on import.
_BACKEND = select_backend()

__all__ = [
    "CommunicationOptions",
    "Compression",
    "CrossDeviceOps",
    "DistributedValues",
    "InputContext",
    "Mirrored",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "SidecarEvaluator",
    "Strategy",
    "StrategyExtended",
    "ValueContext",
    "VariableAggregation",
    "callbacks",
    "cluster",
    "coordinator",
    "distribute",
    "errors",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "nn",
    "partitioners",
    "ps",
    "visible_gpus",
]

# Loading imports modules under the import lock of each; this lock makes the
# whole sequence (hooks included) happen once when threads race to a first access.
_LOAD_LOCK = threading.RLock()
_loaded = False
# The thread running `_load`, while it runs: `from kdist import cluster` inside
# it asks this module for `cluster` first and must be told "not yet" (Python then
# imports the submodule); other threads wait for the load instead.
_loading_thread = None


def _load():
    """Imports the public surface into this module and binds it to Keras' backend. Idempotent.

    Raises:
        kdist.errors.BackendError: Keras was imported with a backend kdist cannot drive.
    """
    global _loaded, _loading_thread
    with _LOAD_LOCK:
        if _loaded or _loading_thread is not None:
            return
        _loading_thread = threading.get_ident()
        try:
            _bind_public_names()
        finally:
            _loading_thread = None
        _loaded = True


def _bind_public_names():
    """Imports the public names into this module (with `_LOAD_LOCK` held)."""
    global _BACKEND
    # Keras may have been imported since `import kdist`; follow the backend it has.
    backend = select_backend()
    from kdist import callbacks, cluster, coordinator, distribute, errors, nn, ps
    from kdist.backends import visible_gpus
    from kdist.collectives import CommunicationOptions, Compression, CrossDeviceOps, ReductionToOneDevice
    from kdist.distribute import (
        DistributedValues,
        InputContext,
        Mirrored,
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
        ParameterServerStrategy,
        PerReplica,
        ReplicaContext,
        Strategy,
        StrategyExtended,
        ValueContext,
        get_cross_replica_context,
        get_replica_context,
        get_strategy,
        has_strategy,
        in_cross_replica_context,
    )
    from kdist.distribute.parameter_server import partitioners
    from kdist.keras.sidecar import SidecarEvaluator
    from kdist.types import ReduceOp, VariableAggregation

    # The strategy names bind to the implementation of Keras' backend: kdist's
    # own engine on torch, tf.distribute on TensorFlow, keras.distribution on JAX.
    if backend == "torch":
        from kdist.keras import hooks

        hooks.install()
    elif backend == "tensorflow":
        from kdist.backends.tensorflow import MirroredStrategy, MultiWorkerMirroredStrategy  # noqa: F811
    elif backend == "jax":
        from kdist.backends.jax import MirroredStrategy, MultiWorkerMirroredStrategy  # noqa: F811
    public = dict(locals())
    globals().update({name: public[name] for name in __all__})
    _BACKEND = backend


def __getattr__(name):
    # Only for names not yet in the module: after `_load` they are ordinary globals.
    if name in __all__ and _loading_thread != threading.get_ident():
        _load()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module 'kdist' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
