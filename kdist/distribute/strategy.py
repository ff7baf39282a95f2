"""`Strategy`: what users call. Its implementer-facing half, `StrategyExtended`,
is in `kdist.distribute.extended`.

A strategy owns a list of replica devices. Everything in this module works for
any such list; `MirroredStrategy` and the default strategy differ only in their
devices and in how `model.fit` runs (see `kdist.keras`).

`Strategy` is also the base of the TensorFlow and JAX strategies
(`kdist.backends.common.BackendStrategy`): the API, its argument handling,
the contexts and the distributed input are written once, here; the engine's
primitives (the `# ----- the engine's primitives` section) are the torch
engine's, and a backend overrides each of them. This module never imports
`kdist.backends`.
"""

from kdist.distribute import context, nest
from kdist.distribute.extended import HOST_DEVICE, to_tensor
from kdist.distribute.input import (
    DistributedDataset,
    DistributedDatasetFromFunction,
    InputContext,
    ValueContext,
)
from kdist.distribute.values import DistributedValues, PerReplica, local_results, select_replica
from kdist.types import ReduceOp


class StrategyScope:
    """Context manager returned by `scope()`: kdist's context frame plus `extended.variable_device_scope()`.

    Re-entrant and nestable. The TensorFlow and JAX strategies use it too;
    their `variable_device_scope()` is the backend's own scope.
    """

    def __init__(self, strategy):
        self._strategy = strategy
        self._pushed = []

    def __enter__(self):
        frame_strategy = context.get_strategy()
        if frame_strategy is self._strategy and not context.in_cross_replica_context():
            # Re-entering our own scope from one of our replicas keeps the replica
            # context (Keras' fit re-enters the scope inside train_step paths).
            self._pushed.append(None)
            return self._strategy
        context.push(self._strategy, None)
        try:
            device_scope = self._strategy.extended.variable_device_scope()
            device_scope.__enter__()
        except BaseException:
            context.pop(self._strategy)  # no frame left behind by a scope that did not open
            raise
        self._pushed.append(device_scope)
        return self._strategy

    def __exit__(self, *exc_info):
        device_scope = self._pushed.pop()
        if device_scope is None:
            return False
        try:
            device_scope.__exit__(*exc_info)
        finally:
            context.pop(self._strategy)
        return False


def _load_public_surface():
    """Makes sure `kdist`'s public surface, and so its Keras hooks, is loaded.

    `import kdist` is lazy; a program that reaches strategies through
    `kdist.distribute` directly must still get the hooks, or its models would
    silently train on one device. At run time, not import time: loading imports
    the Keras layer, which imports this package.
    """
    import kdist

    kdist._load()


class Strategy:
    """A set of replicas and a policy for running and combining work on them.

    Users create a concrete strategy (`kdist.MirroredStrategy`, ...), build and
    compile models inside `scope()`, and call `model.fit` as usual; or write a
    custom loop with `run` and `reduce`.

    The same class is the base of the strategies on every Keras backend: an
    engine other than torch's overrides the primitives at the end of the class
    (`_call_for_each_replica`, `_reduce_leaf`, `_gather_leaf`,
    `_local_results`, `_input_placement`, `_distributed_values`).

    Args:
        extended: the `StrategyExtended` implementation (on TensorFlow and JAX,
            `kdist.backends.common.BackendExtended`).
    """

    def __init__(self, extended):
        self._extended = extended
        _load_public_surface()

    @property
    def extended(self):
        """The `StrategyExtended` with implementer-level methods."""
        return self._extended

    @property
    def num_replicas_in_sync(self):
        """How many replicas compute each step and have their gradients combined (in every process)."""
        return self._extended.num_replicas_in_sync

    def scope(self):
        """Makes this strategy current: models, optimizers and metrics created inside belong to it.

        Models created or compiled inside the scope remember it: `fit`,
        `evaluate`, `predict` and `save` can then be called inside or outside.

        Raises:
            kdist.errors.StrategyScopeError: (on entry) another strategy is current.

        Example:

        ```python
        with strategy.scope():
            model = keras.Sequential([...])
            model.compile(optimizer="adam", loss="mse")
        ```
        """
        return StrategyScope(self)

    def run(self, fn, args=(), kwargs=None, options=None):
        """Calls `fn` once per replica in a replica context.

        Distributed leaves of `args`/`kwargs` (from a distributed dataset or
        `experimental_distribute_values_from_function`) are unwrapped to each
        replica's component; other arguments are passed to every replica. `fn`
        may call `kdist.get_replica_context()` and its `merge_call`,
        `all_reduce` and `all_gather`.

        Returns:
            The regrouped results: each leaf is a `PerReplica`, or the object
            itself where every replica returned the same object.

        Example:

        ```python
        per_replica = strategy.run(lambda x: x * 2, args=(dist_batch,))
        total = strategy.reduce("sum", per_replica, axis=0)
        ```
        """
        del options
        return self._call_for_each_replica(fn, args, kwargs)

    def reduce(self, reduce_op, value, axis):
        """Reduces `value` across replicas (and along `axis`) to a host tensor.

        With `axis=None` the components are combined element-wise across
        replicas (they must have the same shape). With `axis=0` each component
        is first reduced along its batch dimension; for `MEAN` the denominator
        is the total number of elements along `axis` across replicas, so a
        partial last batch split 4/2 averages over 6, not over 2 means, and
        integer values give a floating-point mean.

        Args:
            reduce_op: `kdist.ReduceOp` or `"sum"`/`"mean"` (any case).
            value: a distributed value (or a structure of them), or a plain
                tensor (treated as the same on every replica).
            axis: the dimension to reduce within each component, or None.

        Returns:
            A tensor on the host (or a structure of them): a torch tensor on
            torch, the backend's tensor type on TensorFlow and JAX.

        Raises:
            kdist.errors.InvalidArgumentError: an unknown `reduce_op`, or a
                plain value summed across several replicas (it would count
                once per replica).
            kdist.errors.StrategyScopeError: called from a replica function.

        Example:

        ```python
        per_example = strategy.run(lambda x: x, args=(dist_batch,))
        strategy.reduce("mean", per_example, axis=0)
        ```
        """
        reduce_op = ReduceOp.from_value(reduce_op)
        context.require_cross_replica("reduce")
        with self.scope():
            return nest.map_structure(lambda leaf: self._reduce_leaf(reduce_op, leaf, axis), value)

    def gather(self, value, axis):
        """Concatenates every replica's component of `value` along `axis` on the host.

        Components must agree in every dimension except `axis` and have rank >= 1.

        Example:

        ```python
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: torch.tensor([[1], [2]]))
        strategy.gather(values, axis=0)   # [[1], [2], [1], [2]] with 2 replicas
        ```
        """
        context.require_cross_replica("gather")
        with self.scope():
            return nest.map_structure(lambda leaf: self._gather_leaf(leaf, axis), value)

    def experimental_local_results(self, value):
        """Returns the components of `value` held by this process, as a tuple.

        A plain value gives `(value,)`. A structure of distributed values gives
        one structure per replica.
        """
        return tuple(self._local_results(value))

    def unwrap(self, value):
        """TF1 spelling of `experimental_local_results`, returning a list."""
        return list(self.experimental_local_results(value))

    def experimental_distribute_dataset(self, dataset, options=None):
        """Splits each global batch of `dataset` into per-replica shards.

        Shards are contiguous and as even as possible: a batch of 8 over 2
        replicas gives `[0..3]` and `[4..7]`.

        Args:
            dataset: an iterable of global batches (list, DataLoader, PyDataset, ...).
            options: accepted for API compatibility; unused.

        Returns:
            A `DistributedDataset`; iterate it and pass elements to `run`.
        """
        del options
        devices, make_element = self._input_placement()
        return DistributedDataset(
            dataset,
            devices,
            first_replica=self._extended.first_replica_id,
            num_replicas_in_sync=self.num_replicas_in_sync,
            make_element=make_element,
        )

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """Builds the input with `dataset_fn(InputContext)`; batches are per replica.

        Each step takes one element per replica from the returned dataset. The
        function must batch with `ctx.get_per_replica_batch_size(global_batch)`.
        The result may also be passed to Keras' `fit`, `evaluate` and `predict`
        (or as `validation_data`): each process's batches are its part of the
        global batch, which is the processes' batches concatenated in rank
        order (see docs/multi_worker.md, "Input already split per rank").

        Raises:
            kdist.errors.InvalidArgumentError: `dataset_fn` is not a function,
                or what it returned is not iterable.
        """
        del options
        devices, make_element = self._input_placement()
        return DistributedDatasetFromFunction(
            dataset_fn, self._input_context(), devices, make_element=make_element
        )

    def _input_context(self):
        """The `InputContext` of this process's input pipeline."""
        return InputContext(
            num_input_pipelines=self._extended.num_input_pipelines,
            input_pipeline_id=self._extended.input_pipeline_id,
            num_replicas_in_sync=self.num_replicas_in_sync,
        )

    def experimental_distribute_values_from_function(self, value_fn):
        """Builds a `PerReplica` by calling `value_fn(ValueContext)` for each replica.

        Example:

        ```python
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: [3.0, 2.0, 1.0][ctx.replica_id_in_sync_group])
        strategy.experimental_local_results(values)   # (3.0, 2.0) with 2 replicas
        ```
        """
        first = self._extended.first_replica_id
        values = []
        for replica_id in range(len(self._extended.worker_devices)):
            with self._extended.replica_device_scope(replica_id):
                values.append(value_fn(ValueContext(first + replica_id, self.num_replicas_in_sync)))
        return self._distributed_values(values)

    def __repr__(self):
        return f"{type(self).__name__}(devices={list(self._extended.worker_devices)})"

    # ----- the engine's primitives ----------------------------------------------
    # The torch engine's; `kdist.backends.common.BackendStrategy` overrides every one.
    def _call_for_each_replica(self, fn, args, kwargs):
        """`run` after its argument handling: checks the context, then runs `fn` per replica."""
        return self._extended.call_for_each_replica(fn, args, kwargs)

    def _reduce_leaf(self, reduce_op, value, axis):
        """`reduce` of one leaf, in the cross-replica context and this strategy's scope."""
        if axis is None:
            return self._extended.reduce_to(reduce_op, value, HOST_DEVICE)
        components = self._extended._components(ReduceOp.MEAN, value)
        if not isinstance(value, DistributedValues):
            components = components * len(self._extended.replica_devices)
        total = sum(to_tensor(c).to(HOST_DEVICE).sum(dim=axis) for c in components)
        count = sum(to_tensor(c).shape[axis] for c in components)
        total, count = self._extended._sum_over_processes(total, count)
        if reduce_op is ReduceOp.SUM:
            return total
        # True division, as TensorFlow's `truediv`: the mean of integer values
        # (e.g. per-example correct/incorrect flags) must not truncate to 0.
        return total / count

    def _gather_leaf(self, value, axis):
        """`gather` of one leaf, in the cross-replica context and this strategy's scope."""
        return self._extended.gather_to(value, axis, HOST_DEVICE)

    def _local_results(self, value):
        """This process's components of `value`, one per local replica (a plain value: itself once)."""
        if isinstance(value, DistributedValues) or not nest.is_nested(value):
            return local_results(value)
        return tuple(select_replica(k, value) for k in range(len(self._extended.replica_devices)))

    def _input_placement(self):
        """`(devices, make_element)` for the distributed datasets (see `kdist.distribute.input`).

        `make_element` None: shards' torch tensors are moved to their replica's device.
        """
        return self._extended.replica_devices, None

    def _distributed_values(self, values):
        """The distributed value of one `value_fn` result per local replica."""
        return values[0] if len(values) == 1 else PerReplica(values)
