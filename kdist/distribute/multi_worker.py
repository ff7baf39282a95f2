"""`MultiWorkerMirroredStrategy`: synchronous data parallelism over processes and hosts.

One process per device (or per host, driving several local devices with the
one-process engine). The processes form a `torch.distributed` group (gloo on
CPU, NCCL on GPUs) found through a cluster resolver: the `torchrun`
environment, `TF_CONFIG`, or one given explicitly. Every process runs the same
program; `model.fit` in every process trains one model on the global batch.
See `docs/multi_worker.md`.
"""

import warnings

import torch

from kdist._backend import STRATEGY_BACKENDS, require_backend
from kdist.cluster import resolve_cluster
from kdist.cluster.resolve import is_local_cluster
from kdist.collectives.process import CommunicationOptions, ProcessCollectives
from kdist.distribute.devices import resolve_devices
from kdist.distribute.mirrored import MirroredExtended
from kdist.distribute.extended import HOST_DEVICE, ChiefRoles
from kdist.distribute.strategy import Strategy
from kdist.distribute.values import DistributedValues, Mirrored
from kdist.errors import InvalidArgumentError
from kdist.types import ReduceOp

# Warned when the environment names no cluster: a script meant for several
# processes, started with plain `python`, would otherwise train alone silently.
SINGLE_WORKER_MESSAGE = (
    "MultiWorkerMirroredStrategy found no cluster in the environment (no TF_CONFIG cluster, "
    "no torchrun variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, no srun step, no "
    "Kubeflow Trainer PET_* variables) and runs as a single worker: this process alone. To "
    "train in N processes, start the script with `kdist launch --nproc N script.py`, with "
    "torchrun, with `srun`, or with a TF_CONFIG in each process's environment "
    "(docs/multi_worker.md). To run as one worker without this warning, pass "
    "cluster_resolver=kdist.cluster.local_cluster_resolver()."
)


class MultiWorkerExtended(ChiefRoles, MirroredExtended):
    """`StrategyExtended` of `MultiWorkerMirroredStrategy`.

    Attributes:
        cluster_resolver: the resolver the job's layout came from.
        collectives: the `kdist.collectives.process.ProcessCollectives` of the job.
        shard_optimizer_state: whether each process keeps the optimizer state of
            its share of the model only (`kdist.keras.replica.sharded_optimizer`).
    """

    def __init__(self, container_strategy, cluster_resolver, communication_options, devices,
                 shard_optimizer_state=False):
        if not isinstance(shard_optimizer_state, bool):
            raise InvalidArgumentError(
                "shard_optimizer_state must be True or False. Received: "
                f"shard_optimizer_state={shard_optimizer_state!r} (of type {type(shard_optimizer_state).__name__}).")
        self.shard_optimizer_state = shard_optimizer_state
        communication_options = CommunicationOptions.from_argument(communication_options)
        resolver = resolve_cluster(cluster_resolver)
        if cluster_resolver is None and is_local_cluster(resolver):
            # stacklevel 3 names the user's line; Python's default filter shows it once per line.
            warnings.warn(SINGLE_WORKER_MESSAGE, UserWarning, stacklevel=3)
        rendezvous = resolver.rendezvous()
        super().__init__(container_strategy, _local_devices(devices, rendezvous), None)
        self.cluster_resolver = resolver
        first_device = self.replica_devices[0].torch_device
        communication_device = first_device if first_device.type == "cuda" else torch.device("cpu")
        self.collectives = ProcessCollectives(rendezvous, communication_options, communication_device)

    @property
    def num_replicas_in_sync(self):
        return self.collectives.world_size * len(self.replica_devices)

    @property
    def first_replica_id(self):
        return self.collectives.rank * len(self.replica_devices)

    @property
    def num_input_pipelines(self):
        return self.collectives.world_size

    @property
    def input_pipeline_id(self):
        return self.collectives.rank

    # ----- roles (TensorFlow's names) ----------------------------------------
    @property
    def is_chief(self):
        """True on rank 0: the `chief` task, or worker 0 when there is no chief."""
        return self.collectives.rank == 0


    # ----- reductions across processes ------------------------------------------
    def reduce_to(self, reduce_op, value, destinations, options=None):
        """Reduces `value` over every replica of every process; see `StrategyExtended.reduce_to`."""
        del options
        reduce_op = ReduceOp.from_value(reduce_op)
        devices = self._destination_devices(destinations)
        components = self._components(reduce_op, value)
        local = self._cross_device_ops().reduce(ReduceOp.SUM, components, [HOST_DEVICE])[0]
        if not isinstance(value, DistributedValues):
            # As in TensorFlow, a plain value is this process's value for each of
            # its replicas (with one replica per process, what `run` returns).
            local = local * len(self.replica_devices)
        (total,) = self.collectives.all_reduce_sum([local], name="reduce")
        reduced = total.to(HOST_DEVICE)
        if reduce_op is ReduceOp.MEAN:
            from kdist.collectives.local import divide

            reduced = divide(reduced, self.num_replicas_in_sync)
        copies = self._cross_device_ops().broadcast(reduced, devices)
        return copies[0] if len(copies) == 1 else Mirrored(copies)

    def _sum_over_processes(self, total, count):
        summed, counts = self.collectives.all_reduce_sum(
            [total, torch.tensor(float(count), dtype=torch.float64)], name="reduce"
        )
        return summed.to(total.dtype), int(counts.item())

    def gather_to(self, value, axis, destination):
        """Concatenates the components of every process along `axis`, in replica order."""
        local = super().gather_to(value, axis, HOST_DEVICE)
        moved = local.movedim(axis, 0)
        rows = torch.zeros(self.collectives.world_size, dtype=torch.float64)
        rows[self.collectives.rank] = moved.shape[0]
        (rows,) = self.collectives.all_reduce_sum([rows], name="gather_sizes")
        gathered = self.collectives.all_gather_rows(moved, [int(r) for r in rows.tolist()], name="gather")
        device = destination.torch_device if hasattr(destination, "torch_device") else torch.device(destination)
        return gathered.movedim(0, axis).to(device)


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training in several processes, on one host or many.

    Every process runs the same script. `model.fit` splits each global batch
    over the replicas of all processes, combines gradients with one bucketed
    all-reduce per step, and keeps every process's model bitwise identical.
    Checkpoints, CSV logs and progress bars come from the chief (rank 0) only.

    Args:
        cluster_resolver: where the job's layout comes from. `None` reads the
            `torchrun` environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) when it
            is set, else `TF_CONFIG` (chief first, then workers); with neither,
            a one-process job.
        communication_options: a `kdist.CommunicationOptions` (timeout of
            every collective, bucket size, backend).
        devices: this process's devices. `None` means `cuda:LOCAL_RANK` when
            several processes share a host with GPUs, every visible GPU when the
            process is alone on its host, else the CPU. A list such as
            `["cpu:0", "cpu:1"]` gives each process several replicas.
        shard_optimizer_state: each process keeps the optimizer's state (Adam's
            moments, accumulators, ...) of its 1/N share of the model's elements
            only, updates that share and all-gathers the rest (ZeRO-1). The
            weights are bitwise those of `False`; checkpoints hold the whole
            state and load anywhere. For element-wise optimizers (SGD, Adam,
            AdamW, Adamax, Adagrad, Adadelta, RMSprop, Nadam, Lion); others
            are refused at compile. See docs/multi_worker.md, "Sharded optimizer state".

    Raises:
        kdist.errors.InvalidArgumentError: the cluster or an argument is malformed.
        kdist.errors.CollectiveTimeoutError: the other processes did not join
            within the timeout.

    Example:

    ```python
    # kdist launch --nproc 2 train.py   (or torchrun, or TF_CONFIG per process)
    strategy = kdist.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=256, epochs=3)
    ```
    """

    # `kdist.MultiWorkerMirroredStrategy` exists on these backends; this class is the torch one.
    SUPPORTED_BACKENDS = STRATEGY_BACKENDS["MultiWorkerMirroredStrategy"]

    def __init__(self, cluster_resolver=None, communication_options=None, devices=None,
                 shard_optimizer_state=False):
        require_backend("kdist.distribute.MultiWorkerMirroredStrategy (kdist's torch engine)", ("torch",))
        super().__init__(MultiWorkerExtended(
            self, cluster_resolver, communication_options, devices, shard_optimizer_state))

    @property
    def cluster_resolver(self):
        """The `kdist.cluster.ClusterResolver` describing the job."""
        return self._extended.cluster_resolver

    def __repr__(self):
        collectives = self._extended.collectives
        return (
            f"MultiWorkerMirroredStrategy(rank={collectives.rank}, world_size="
            f"{collectives.world_size}, devices={list(self._extended.worker_devices)}"
            + (", shard_optimizer_state=True)" if self._extended.shard_optimizer_state else ")")
        )


def _local_devices(devices, rendezvous):
    if devices is not None:
        return resolve_devices(devices)
    num_gpus = torch.cuda.device_count()
    if num_gpus == 0:
        return resolve_devices(["cpu"])
    if rendezvous.local_world_size > 1:
        return resolve_devices([f"cuda:{rendezvous.local_rank % num_gpus}"])
    return resolve_devices(None)
