"""What the TensorFlow and JAX strategies share.

- `BackendStrategy`: a `kdist.Strategy` (so `isinstance(strategy,
  kdist.Strategy)` holds on every backend) whose primitives are a backend's.
  The user-facing API (`scope`, `run`, `reduce`, `gather`, distributed input,
  contexts) and its argument handling are `Strategy`'s; subclasses supply
  calling a function per replica, reducing and gathering components, and
  making per-replica values.
- the scope (the torch strategies' `StrategyScope`, entering the backend's
  own scope where torch enters a device scope) keeps kdist's context stack in
  step with the backend's, so
  `kdist.get_strategy()`, `kdist.get_replica_context()` and
  `kdist.in_cross_replica_context()` mean the same on every backend;
- distributed input from plain iterables is `kdist.distribute.input`'s,
  split with kdist's rule (`kdist.distribute.batching`), so a global batch
  becomes the same shards on every backend.
"""

import abc
import contextlib

from kdist.distribute import context
from kdist.distribute.strategy import Strategy
from kdist.errors import InvalidArgumentError
from kdist.types import ReduceOp


class BackendExtended:
    """The implementer-facing half: devices and the backend's own strategy object."""

    is_default = False
    first_replica_id = 0
    num_input_pipelines = 1
    input_pipeline_id = 0

    def __init__(self, worker_devices, native):
        self._worker_devices = tuple(worker_devices)
        self.native = native

    @property
    def worker_devices(self):
        """Device names used to run replica functions, one per replica (kdist spelling)."""
        return self._worker_devices

    @property
    def parameter_devices(self):
        """Device names holding mirrored variables: every replica's."""
        return self._worker_devices

    @property
    def num_replicas_in_sync(self):
        return len(self._worker_devices)

    def variable_device_scope(self):
        """Entered by `strategy.scope()` inside kdist's context frame: the backend's own scope."""
        return self.native.scope()

    def replica_device_scope(self, replica_id):
        """Entered around a replica's `value_fn`: nothing; the backend places per-replica values itself."""
        del replica_id
        return contextlib.nullcontext()


class BackendReplicaContext(context.ReplicaContext):
    """A replica's context on a non-torch backend; subclasses supply the collectives.

    Args:
        strategy: the kdist strategy.
        replica_id_in_sync_group: the replica's id across every process.
        device: the kdist name of the device it runs on.
    """

    def __init__(self, strategy, replica_id_in_sync_group, device):
        super().__init__(strategy, replica_id_in_sync_group)
        self._device = device

    @property
    def replica_id_in_sync_group(self):
        return self._replica_id

    @property
    def devices(self):
        return (self._device,)


class BackendStrategy(Strategy, metaclass=abc.ABCMeta):
    """`kdist.Strategy` on a backend other than torch: the same API over the backend's primitives.

    Everything users call is `Strategy`'s. Subclasses implement `_backend_run`,
    `_backend_reduce`, `_gather_leaf`, `_local_results`, `_per_replica` and
    `_is_distributed`; every primitive of the torch engine is overridden here
    or by them, so none of its code runs on another backend.

    Args:
        extended: a `BackendExtended` (`worker_devices`, `native`: the backend's object).
    """

    def _call_for_each_replica(self, fn, args, kwargs):
        context.require_cross_replica("run")
        with self.scope():
            return self._backend_run(fn, tuple(args or ()), dict(kwargs or {}))

    def _reduce_leaf(self, reduce_op, value, axis):
        num_replicas = self.num_replicas_in_sync
        if (axis is None and reduce_op is ReduceOp.SUM and num_replicas > 1
                and not self._is_distributed(value)):
            raise InvalidArgumentError(
                "A value that is not distributed cannot be summed across replicas: it "
                f"would count {num_replicas} times. Received a {type(value).__name__}. "
                "Pass the PerReplica result of strategy.run, or use ReduceOp.MEAN."
            )
        return self._backend_reduce(reduce_op, value, axis)

    def _input_placement(self):
        return self._extended.worker_devices, self._per_replica

    def _distributed_values(self, values):
        return self._per_replica(values)

    # ----- the backend's primitives ---------------------------------------------
    @abc.abstractmethod
    def _backend_run(self, fn, args, kwargs):
        """Calls `fn(*args, **kwargs)` once per local replica in its replica context; regrouped results."""

    @abc.abstractmethod
    def _backend_reduce(self, reduce_op, value, axis):
        """Reduces one leaf across replicas (and along `axis`) to the host."""

    @abc.abstractmethod
    def _gather_leaf(self, value, axis):
        """Gathers one leaf's replica components along `axis` on the host."""

    @abc.abstractmethod
    def _local_results(self, value):
        """The tuple of `value`'s components on this process's replicas."""

    @abc.abstractmethod
    def _per_replica(self, values):
        """The backend's distributed value of one structure per local replica, in replica order."""

    @abc.abstractmethod
    def _is_distributed(self, value):
        """Whether `value` is the backend's distributed value (not a plain one)."""
