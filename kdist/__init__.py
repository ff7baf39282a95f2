"""kdist: tf.distribute-style distributed training for Keras 3 on the torch backend.

```python
import kdist, keras
strategy = kdist.MirroredStrategy()
with strategy.scope():
    model = keras.Sequential([...])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=256, epochs=5)
```
"""

from kdist._backend import ensure_torch_backend

# Must run before anything below imports Keras.
ensure_torch_backend()

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
from kdist.keras import hooks as _keras_hooks  # noqa: E402
from kdist.keras.sidecar import SidecarEvaluator  # noqa: E402
from kdist.types import ReduceOp, VariableAggregation  # noqa: E402

_keras_hooks.install()

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
    "partitioners",
    "ps",
]
