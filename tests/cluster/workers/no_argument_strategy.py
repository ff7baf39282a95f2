"""One process that builds `kdist.MultiWorkerMirroredStrategy()` with no arguments.

The cluster comes from whatever launcher variables the test set (Slurm's
`SLURM_*`, Kubeflow Trainer's `PET_*`, or none). The process prints

    RESOLVER <class> RANK <rank> WORLD <world size> TASK <task_type>:<task_id>
    SUM <all-reduce of rank + 1 over every process>
    WEIGHTS <checksum of the weights after a tiny fit>

so that the test can check the ranks, that the processes really formed one
group (SUM), and that they trained as one (WEIGHTS equal on every rank).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from tests import seeding  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import kdist  # noqa: E402


def main():
    strategy = kdist.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    rendezvous = resolver.rendezvous()
    print(
        f"RESOLVER {type(resolver).__name__} RANK {rendezvous.rank} WORLD {rendezvous.world_size} "
        f"TASK {resolver.task_type}:{resolver.task_id}",
        flush=True,
    )

    def step():
        context = kdist.get_replica_context()
        return context.all_reduce("sum", torch.tensor([float(context.replica_id_in_sync_group + 1)]))

    print(f"SUM {float(strategy.run(step).reshape(-1)[0]):g}", flush=True)

    seeding.set_random_seed(1)
    features = np.arange(32, dtype="float32").reshape(16, 2) / 32.0
    targets = features.sum(axis=1, keepdims=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(features, targets, batch_size=8, epochs=1, shuffle=False, verbose=0)
    checksum = sum(float(np.abs(weight).sum()) for weight in model.get_weights())
    print(f"WEIGHTS {checksum:.8f}", flush=True)


if __name__ == "__main__":
    main()
