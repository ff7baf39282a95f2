"""kdist: tf.distribute-style distributed training for Keras 3 (torch first; TensorFlow and JAX too).

```python
import kdist, keras
strategy = kdist.MirroredStrategy()
with strategy.scope():
    model = keras.Sequential([...])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=256, epochs=5)
```
"""

from kdist._backend import select_backend

# Must run before anything below imports Keras.
_BACKEND = select_backend()

from kdist import errors  # noqa: E402
from kdist import cluster  # noqa: E402
from kdist import ps  # noqa: E402
from kdist.collectives import CommunicationOptions, CrossDeviceOps, ReductionToOneDevice  # noqa: E402
from kdist.distribute import (  # noqa: E402
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
    partitioners,
)
from kdist import coordinator  # noqa: E402
from kdist import nn  # noqa: E402
from kdist.backends import visible_gpus  # noqa: E402
from kdist.keras.sidecar import SidecarEvaluator  # noqa: E402
from kdist.types import ReduceOp, VariableAggregation  # noqa: E402

# The strategy names bind to the implementation of Keras' backend: kdist's own
# engine on torch, tf.distribute on TensorFlow, keras.distribution on JAX.
if _BACKEND == "torch":
    from kdist.keras import hooks as _keras_hooks  # noqa: E402

    _keras_hooks.install()
elif _BACKEND == "tensorflow":
    from kdist.backends.tensorflow import MirroredStrategy, MultiWorkerMirroredStrategy  # noqa: E402,F811
elif _BACKEND == "jax":
    from kdist.backends.jax import MirroredStrategy, MultiWorkerMirroredStrategy  # noqa: E402,F811

__version__ = "0.1.0"

__all__ = [
    "CommunicationOptions",
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
