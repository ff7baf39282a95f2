"""`MirroredStrategy`: synchronous data parallelism over the devices of one process.

The user's model is the canonical replica; its variables live on the first
device. Each step, every replica runs the model's own `train_step` on its
shard of the global batch, gradients are combined as a batch-size-weighted
mean and applied once. See `kdist.keras.replica.engine` for how `model.fit`
does this and `docs/glossary.md` for the terms.
"""

from kdist._backend import STRATEGY_BACKENDS, require_backend
from kdist.collectives.local import CrossDeviceOps, ReductionToOneDevice
from kdist.distribute.devices import device_scope, resolve_devices
from kdist.distribute.extended import StrategyExtended
from kdist.distribute.strategy import Strategy
from kdist.errors import InvalidArgumentError


class MirroredExtended(StrategyExtended):
    """`StrategyExtended` of `MirroredStrategy`."""

    def __init__(self, container_strategy, devices, cross_device_ops):
        super().__init__(container_strategy, resolve_devices(devices))
        if cross_device_ops is None:
            cross_device_ops = ReductionToOneDevice()
        elif not isinstance(cross_device_ops, CrossDeviceOps):
            raise InvalidArgumentError(
                "Expected a kdist.CrossDeviceOps instance (e.g. "
                "kdist.ReductionToOneDevice()). Received: cross_device_ops="
                f"{cross_device_ops!r}."
            )
        self._cross_device_ops_instance = cross_device_ops

    def _cross_device_ops(self):
        return self._cross_device_ops_instance

    def variable_device_scope(self):
        # Variables are born on the canonical replica's device.
        return device_scope(self.replica_devices[0])


class MirroredStrategy(Strategy):
    """Synchronous training on several devices of one machine, one replica per device.

    Args:
        devices: device strings such as `["cuda:0", "cuda:1"]` or, on a
            CPU-only machine, logical replicas `["cpu:0", "cpu:1"]`. `None`
            means every visible GPU, or one CPU replica when there is none.
        cross_device_ops: a `kdist.CrossDeviceOps` deciding how the Strategy
            API reduces values between devices: `Strategy.reduce`,
            `extended.reduce_to`, `batch_reduce_to`, `broadcast_to` and
            `ReplicaContext.all_reduce`; default `kdist.ReductionToOneDevice()`.
            The reductions of `model.fit`, `evaluate` and `predict` do not use
            it: the replica engine combines gradients and state itself
            (`docs/mirrored.md`, "Reductions and `cross_device_ops`").

    Raises:
        kdist.errors.InvalidDeviceError: a device is unknown or not visible,
            the list is empty, has duplicates, or mixes CPU and GPU.
        kdist.errors.InvalidArgumentError: `cross_device_ops` is not a
            `kdist.CrossDeviceOps` instance.

    Example:

    ```python
    strategy = kdist.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=128)      # 64 samples per replica per step
    ```
    """

    # `kdist.MirroredStrategy` exists on these backends; this class is the torch one.
    SUPPORTED_BACKENDS = STRATEGY_BACKENDS["MirroredStrategy"]

    def __init__(self, devices=None, cross_device_ops=None):
        require_backend("kdist.distribute.MirroredStrategy (kdist's torch engine)", ("torch",))
        super().__init__(MirroredExtended(self, devices, cross_device_ops))
