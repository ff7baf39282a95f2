"""Coordinator-based parameter-server training (TensorFlow 2's `tf.distribute.experimental.coordinator`).

```python
strategy = kdist.ParameterServerStrategy(kdist.cluster.TFConfigClusterResolver())
coordinator = kdist.coordinator.ClusterCoordinator(strategy)
```

See `ClusterCoordinator` and `docs/parameter_server.md`.
"""

from kdist.coordinator.cluster_coordinator import ClusterCoordinator, PerWorkerDataset, PerWorkerIterator
from kdist.coordinator.resources import register_describer
from kdist.coordinator.remote_value import RemoteValue, RemoteValueStatus
from kdist.coordinator.worker_service import (
    WorkerRuntime,
    WorkerServer,
    create_worker_server,
    set_runtime_factory,
)

__all__ = [
    "ClusterCoordinator",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "RemoteValue",
    "RemoteValueStatus",
    "WorkerRuntime",
    "WorkerServer",
    "create_worker_server",
    "register_describer",
    "set_runtime_factory",
]
