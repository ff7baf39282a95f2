"""What the TensorFlow and JAX strategies share.

- `BackendStrategy`: the user-facing API (`scope`, `run`, `reduce`, `gather`,
  distributed input, contexts). Subclasses supply the backend's primitives:
  entering its native scope, calling a function per replica, reducing and
  gathering components, and making per-replica values.
- the scope (the torch strategies' `StrategyScope`, entering the backend's
  own scope where torch enters a device scope) keeps kdist's context stack in
  step with the backend's, so
  `kdist.get_strategy()`, `kdist.get_replica_context()` and
  `kdist.in_cross_replica_context()` mean the same on every backend;
- distributed input from plain iterables is split with kdist's rule
  (`kdist.distribute.batching`), so a global batch becomes the same shards on
  every backend.
"""

from kdist.distribute import context, nest
from kdist.distribute.batching import split_batch
from kdist.distribute.input import InputContext, ValueContext, _check_iterable
from kdist.distribute.strategy import StrategyScope
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


class BackendStrategy:
    """The user-facing strategy API on a backend other than torch.

    Subclasses implement `_call_for_each_replica`,
    `_reduce_leaf`, `_gather_leaf`, `_per_replica`, `_local_results` and
    `_is_distributed`.
    """

    def __init__(self, extended):
        self._extended = extended

    @property
    def extended(self):
        """The `StrategyExtended`-like half: `worker_devices`, `native` (the backend's object)."""
        return self._extended

    @property
    def num_replicas_in_sync(self):
        """How many replicas compute each step, in every process."""
        return self._extended.num_replicas_in_sync

    def scope(self):
        """Makes this strategy current: models, optimizers and metrics created inside belong to it."""
        return StrategyScope(self)

    def run(self, fn, args=(), kwargs=None, options=None):
        """Calls `fn` once per replica in a replica context; see `kdist.Strategy.run`."""
        del options
        context.require_cross_replica("run")
        with self.scope():
            return self._call_for_each_replica(fn, tuple(args or ()), dict(kwargs or {}))

    def reduce(self, reduce_op, value, axis):
        """Reduces `value` across replicas (and along `axis`); see `kdist.Strategy.reduce`.

        Returns:
            The backend's tensor type, on the host.
        """
        reduce_op = ReduceOp.from_value(reduce_op)
        context.require_cross_replica("reduce")
        with self.scope():
            return nest.map_structure(
                lambda leaf: self._reduce_leaf(reduce_op, self._check_reducible(reduce_op, leaf, axis), axis),
                value)

    def _check_reducible(self, reduce_op, value, axis):
        num_replicas = self.num_replicas_in_sync
        if (axis is None and reduce_op is ReduceOp.SUM and num_replicas > 1
                and not self._is_distributed(value)):
            raise InvalidArgumentError(
                "A value that is not distributed cannot be summed across replicas: it "
                f"would count {num_replicas} times. Received a {type(value).__name__}. "
                "Pass the PerReplica result of strategy.run, or use ReduceOp.MEAN."
            )
        return value

    def gather(self, value, axis):
        """Concatenates every replica's component of `value` along `axis` on the host."""
        context.require_cross_replica("gather")
        with self.scope():
            return nest.map_structure(lambda leaf: self._gather_leaf(leaf, axis), value)

    def experimental_local_results(self, value):
        """The components of `value` held by this process, one per replica, as a tuple."""
        return tuple(self._local_results(value))

    def unwrap(self, value):
        """TF1 spelling of `experimental_local_results`, returning a list."""
        return list(self.experimental_local_results(value))

    def experimental_distribute_dataset(self, dataset, options=None):
        """Splits each global batch of `dataset` into per-replica shards (kdist's rule)."""
        del options
        return SplitDataset(self, dataset)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Builds the input with `dataset_fn(InputContext)`; each step takes one element per replica."""
        del options
        return PerReplicaElements(self, self._call_dataset_fn(dataset_fn))

    def _call_dataset_fn(self, dataset_fn):
        """`dataset_fn(InputContext)` with this process's input pipeline."""
        if not callable(dataset_fn):
            raise InvalidArgumentError(
                f"Expected a function taking an InputContext. Received: dataset_fn={dataset_fn!r}.")
        return dataset_fn(InputContext(
            num_input_pipelines=self._extended.num_input_pipelines,
            input_pipeline_id=self._extended.input_pipeline_id,
            num_replicas_in_sync=self.num_replicas_in_sync,
        ))

    def experimental_distribute_values_from_function(self, value_fn):
        """A per-replica value from `value_fn(ValueContext)` called once per local replica."""
        first = self._extended.first_replica_id
        values = [value_fn(ValueContext(first + replica, self.num_replicas_in_sync))
                  for replica in range(len(self._extended.worker_devices))]
        return self._per_replica(values)

    def __repr__(self):
        return f"{type(self).__name__}(devices={list(self._extended.worker_devices)})"


class SplitDataset:
    """Each global batch of an iterable, split into one contiguous shard per replica."""

    def __init__(self, strategy, dataset):
        _check_iterable(dataset, "dataset")
        self._strategy = strategy
        self._dataset = dataset

    def __iter__(self):
        extended = self._strategy.extended
        first, count = extended.first_replica_id, len(extended.worker_devices)
        for batch in self._dataset:
            shards = split_batch(batch, self._strategy.num_replicas_in_sync)[first:first + count]
            yield self._strategy._per_replica([shard for shard, _ in shards])


class PerReplicaElements:
    """One element per replica per step from a dataset already batched per replica."""

    def __init__(self, strategy, dataset):
        _check_iterable(dataset, "the dataset returned by dataset_fn")
        self._strategy = strategy
        self._dataset = dataset

    def __iter__(self):
        iterator = iter(self._dataset)
        count = len(self._strategy.extended.worker_devices)
        while True:
            elements = []
            for _ in range(count):
                try:
                    elements.append(next(iterator))
                except StopIteration:
                    return  # a final step with too few elements: a replica would have none
            yield self._strategy._per_replica(elements)
