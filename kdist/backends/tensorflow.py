"""kdist's strategies on Keras' TensorFlow backend: thin layers over `tf.distribute`.

Keras 3 on TensorFlow supports `tf.distribute` natively: a model built in a
`tf.distribute` strategy's scope trains data-parallel in `fit`. These classes
give that the kdist API (the same names, arguments, batch semantics and
contexts as on torch) and delegate the work to TensorFlow:

- `strategy.scope()` enters the TensorFlow strategy's scope and kdist's;
- `strategy.run` is TensorFlow's `run`; inside it `kdist.get_replica_context()`
  wraps TensorFlow's replica context (`merge_call`, `all_reduce`, `all_gather`);
- `reduce`, `gather` and `experimental_local_results` are TensorFlow's, and
  return TensorFlow tensors;
- distributed input: a `tf.data.Dataset` goes to TensorFlow's own input
  pipeline (its rebatching rule); any other iterable of global batches is split
  with kdist's rule, so it gives the same shards as on torch.

`strategy.extended.native` is the `tf.distribute` strategy itself; other
`StrategyExtended` methods (`reduce_to`, `update`, `colocate_vars_with`, ...)
are TensorFlow's. Differences from torch are listed in `docs/backends.md`.
"""

import tensorflow as tf

from kdist._backend import STRATEGY_BACKENDS
from kdist.backends.common import BackendExtended, BackendReplicaContext, BackendStrategy
from kdist.cluster import TorchrunClusterResolver, resolve_cluster
from kdist.collectives import CommunicationOptions, Compression, CrossDeviceOps, ReductionToOneDevice
from kdist.distribute import context
from kdist.distribute.devices import resolve_devices
from kdist.distribute.input import call_dataset_fn
from kdist.errors import BackendError, InvalidArgumentError, InvalidDeviceError, UnsupportedError
from kdist.types import ReduceOp

_REDUCE_OPS = {ReduceOp.SUM: tf.distribute.ReduceOp.SUM, ReduceOp.MEAN: tf.distribute.ReduceOp.MEAN}


def _native_op(reduce_op):
    return _REDUCE_OPS[ReduceOp.from_value(reduce_op)]


def gpu_count():
    """GPUs TensorFlow sees."""
    return len(tf.config.list_physical_devices("GPU"))


def _tf_device(device):
    return f"/{'gpu' if device.kind == 'cuda' else 'cpu'}:{device.index}"


def ensure_logical_cpus(count):
    """Makes TensorFlow show at least `count` CPU devices (logical replicas on one CPU).

    TensorFlow sees one CPU device; more must be configured before its runtime
    starts (the first op or device listing).

    Raises:
        kdist.errors.InvalidDeviceError: the runtime already started with fewer.
    """
    [cpu] = tf.config.list_physical_devices("CPU")[:1]
    configured = tf.config.get_logical_device_configuration(cpu)
    if configured is not None and len(configured) >= count:
        return
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError:
        available = len(tf.config.list_logical_devices("CPU"))
        if available < count:
            raise InvalidDeviceError(
                f"TensorFlow needs {count} logical CPU devices for {count} CPU replicas, and its "
                f"runtime already started with {available}. Received: {count} CPU devices. Create "
                "the strategy before any TensorFlow computation, or configure them first with "
                "tf.config.set_logical_device_configuration."
            ) from None


def _native_cross_device_ops(cross_device_ops):
    if cross_device_ops is None or isinstance(cross_device_ops, tf.distribute.CrossDeviceOps):
        return cross_device_ops
    if isinstance(cross_device_ops, ReductionToOneDevice):
        return tf.distribute.ReductionToOneDevice()
    if isinstance(cross_device_ops, CrossDeviceOps):
        raise UnsupportedError(
            f"{type(cross_device_ops).__name__} has no TensorFlow counterpart. Received: "
            f"cross_device_ops={cross_device_ops!r}. Pass kdist.ReductionToOneDevice(), a "
            "tf.distribute.CrossDeviceOps, or None."
        )
    raise InvalidArgumentError(
        "Expected a kdist.CrossDeviceOps or tf.distribute.CrossDeviceOps. Received: "
        f"cross_device_ops={cross_device_ops!r}."
    )


class _Extended(BackendExtended):
    """`strategy.extended`: kdist's device names plus TensorFlow's `StrategyExtended`."""

    def __init__(self, worker_devices, native, first_replica_id=0, num_input_pipelines=1, input_pipeline_id=0):
        super().__init__(worker_devices, native)
        self.first_replica_id = first_replica_id
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id

    @property
    def num_replicas_in_sync(self):
        return self.native.num_replicas_in_sync

    def __getattr__(self, name):
        # reduce_to, batch_reduce_to, broadcast_to, update, colocate_vars_with, ...
        if name.startswith("_") or name == "native":
            raise AttributeError(name)
        return getattr(self.native.extended, name)


class _ReplicaContext(BackendReplicaContext):
    """A replica's context: kdist's interface over TensorFlow's `ReplicaContext`."""

    def __init__(self, strategy, native):
        replica_id = int(tf.get_static_value(native.replica_id_in_sync_group))
        extended = strategy.extended
        device = extended.worker_devices[replica_id - extended.first_replica_id]
        super().__init__(strategy, replica_id, device)
        self._native = native

    def merge_call(self, merge_fn, args=(), kwargs=None):
        """Runs `merge_fn(strategy, *args, **kwargs)` once across replicas (TensorFlow's merge_call)."""
        if not isinstance(args, tuple):
            args = (args,)
        strategy = self._strategy

        def native_merge_fn(native_strategy, *merge_args, **merge_kwargs):
            del native_strategy
            context.push(strategy, None)
            try:
                return merge_fn(strategy, *merge_args, **merge_kwargs)
            finally:
                context.pop(strategy)

        return self._native.merge_call(native_merge_fn, args=args, kwargs=kwargs or {})

    def all_reduce(self, reduce_op, value):
        """Reduces `value` across replicas; every replica gets the result."""
        return self._native.all_reduce(_native_op(reduce_op), value)

    def all_gather(self, value, axis):
        """Concatenates `value` from every replica along `axis`; every replica gets the result."""
        return self._native.all_gather(value, axis)


class _TensorFlowStrategy(BackendStrategy):
    """The kdist API over one `tf.distribute` strategy (see the module docstring)."""

    def _backend_run(self, fn, args, kwargs):
        strategy = self

        def replica_fn(*replica_args, **replica_kwargs):
            context.push(strategy, _ReplicaContext(strategy, tf.distribute.get_replica_context()))
            try:
                return fn(*replica_args, **replica_kwargs)
            finally:
                context.pop(strategy)

        return self._extended.native.run(replica_fn, args=args, kwargs=kwargs)

    def _is_distributed(self, value):
        return isinstance(value, tf.distribute.DistributedValues)

    def _backend_reduce(self, reduce_op, value, axis):
        if reduce_op is ReduceOp.MEAN:
            # TensorFlow divides integers by the count with integer division;
            # a mean of per-example 0/1 flags must not truncate to 0.
            components = [tf.convert_to_tensor(component) for component in self._local_results(value)]
            if not components[0].dtype.is_floating:
                floats = [tf.cast(component, tf.float32) for component in components]
                value = self._per_replica(floats) if self._is_distributed(value) else floats[0]
        return self._extended.native.reduce(_native_op(reduce_op), value, axis=axis)

    def _gather_leaf(self, value, axis):
        return self._extended.native.gather(value, axis)

    def _local_results(self, value):
        return self._extended.native.experimental_local_results(value)

    def _per_replica(self, values):
        first = self._extended.first_replica_id
        converted = [tf.nest.map_structure(_to_tensor, value) for value in values]
        return self._extended.native.experimental_distribute_values_from_function(
            lambda value_context: converted[value_context.replica_id_in_sync_group - first])

    def experimental_distribute_dataset(self, dataset, options=None):
        """A `tf.data.Dataset` goes to TensorFlow's input pipeline; other iterables are split by kdist's rule."""
        if isinstance(dataset, tf.data.Dataset):
            return self._extended.native.experimental_distribute_dataset(dataset, options)
        return super().experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """`dataset_fn(InputContext)`; a `tf.data.Dataset` result goes to TensorFlow's input pipeline."""
        dataset = call_dataset_fn(dataset_fn, self._input_context())
        if isinstance(dataset, tf.data.Dataset):
            return self._extended.native.distribute_datasets_from_function(lambda _: dataset, options)
        # `dataset_fn` runs once: kdist's input takes the dataset it already returned.
        return super().distribute_datasets_from_function(lambda _: dataset, options)


def _to_tensor(value):
    return value if value is None else tf.convert_to_tensor(value)


class MirroredStrategy(_TensorFlowStrategy):
    """Synchronous training on the devices of one machine, by `tf.distribute.MirroredStrategy`.

    Args:
        devices: device strings as on torch (`["cpu:0", "cpu:1"]`,
            `["cuda:0", "cuda:1"]`, `"/gpu:0"`, ...). Several CPU entries are
            logical replicas; kdist configures TensorFlow's logical CPUs for
            them, which must happen before TensorFlow's first computation.
            `None` means every visible GPU, else one CPU replica.
        cross_device_ops: `kdist.ReductionToOneDevice()`, a
            `tf.distribute.CrossDeviceOps`, or None (TensorFlow's choice).

    Raises:
        kdist.errors.InvalidDeviceError: as on torch, or TensorFlow already
            started with fewer logical CPUs than requested.

    Example:

    ```python
    strategy = kdist.MirroredStrategy(["cpu:0", "cpu:1"])   # KERAS_BACKEND=tensorflow
    with strategy.scope():
        model = build_and_compile()
    model.fit(x, y, batch_size=128)    # 64 samples per replica per step
    ```
    """

    SUPPORTED_BACKENDS = STRATEGY_BACKENDS["MirroredStrategy"]

    def __init__(self, devices=None, cross_device_ops=None):
        parsed = resolve_devices(devices, "devices", gpu_count)
        if parsed[0].kind == "cpu" and len(parsed) > 1:
            ensure_logical_cpus(max(device.index for device in parsed) + 1)
        native = tf.distribute.MirroredStrategy(
            [_tf_device(device) for device in parsed],
            cross_device_ops=_native_cross_device_ops(cross_device_ops))
        super().__init__(_Extended([device.name for device in parsed], native))


class _NativeMultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """TensorFlow's strategy, with the `reduce` that Keras 3's TensorFlow trainer calls.

    Keras 3.x `fit` under `tf.distribute.MultiWorkerMirroredStrategy` fails
    (keras-team/keras#20585): its trainer reduces the first `(x, y)` batch as
    one structure, which the collective strategy refuses, then reduces each
    step's scalar logs with `axis=0`, or with no `axis` at all. This `reduce`
    takes a structure leaf by leaf (in `tf.nest` order, the same on every
    worker), treats `axis` of a scalar as None, and defaults `axis` to None.
    """

    def reduce(self, reduce_op, value, axis=None):
        parent = super()

        def reduce_leaf(leaf):
            first = self.experimental_local_results(leaf)[0]
            scalar = getattr(getattr(first, "shape", None), "rank", None) == 0
            return parent.reduce(reduce_op, leaf, None if scalar else axis)

        return tf.nest.map_structure(reduce_leaf, value)


class MultiWorkerMirroredStrategy(_TensorFlowStrategy):
    """Synchronous training across processes, by `tf.distribute.MultiWorkerMirroredStrategy`.

    Args:
        cluster_resolver: a `kdist.cluster` resolver, or None for the one the
            environment describes (`TF_CONFIG`). TensorFlow needs every
            worker's address, so the torchrun variables (which name only the
            rendezvous) are refused: launch with `kdist launch --workers N`.
        communication_options: `kdist.CommunicationOptions`; its
            `timeout_seconds` becomes TensorFlow's collective timeout.
            TensorFlow reduces in its own buckets during its own graph, so
            `compression` must stay `Compression.none`; the bucket and overlap
            fields do not apply.
        devices: must be None: TensorFlow uses every local GPU, else the CPU.

    Raises:
        kdist.errors.UnsupportedError: torchrun variables, `devices` given,
            or gradient compression asked for.
        kdist.errors.BackendError: TensorFlow's runtime already started (the
            strategy must be created before any TensorFlow computation).
    """

    SUPPORTED_BACKENDS = STRATEGY_BACKENDS["MultiWorkerMirroredStrategy"]

    def __init__(self, cluster_resolver=None, communication_options=None, devices=None):
        if devices is not None:
            raise UnsupportedError(
                "On the TensorFlow backend MultiWorkerMirroredStrategy uses every local GPU, else "
                f"the CPU, and takes no device list. Received: devices={devices!r}. Pass devices=None."
            )
        communication_options = CommunicationOptions.from_argument(communication_options)
        if communication_options.compression != Compression.none:
            raise UnsupportedError(
                "Gradient compression is not available on the TensorFlow backend: "
                "tf.distribute's collectives send gradients in their own dtype. Received: "
                f"compression={communication_options.compression!r}. Use "
                "kdist.Compression.none there, or KERAS_BACKEND=torch."
            )
        resolver = resolve_cluster(cluster_resolver)
        if isinstance(resolver, TorchrunClusterResolver):
            raise UnsupportedError(
                "On the TensorFlow backend MultiWorkerMirroredStrategy needs every worker's "
                "address (TF_CONFIG or a kdist.cluster resolver). Received: the torchrun variables, "
                "which name only the rendezvous. Launch with `kdist launch --workers N` or set TF_CONFIG."
            )
        rendezvous = resolver.rendezvous()
        native_resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(resolver.cluster_spec().as_dict()),
            task_type=resolver.task_type, task_id=resolver.task_id, rpc_layer="grpc")
        try:
            native = _NativeMultiWorkerMirroredStrategy(
                cluster_resolver=native_resolver,
                communication_options=tf.distribute.experimental.CommunicationOptions(
                    timeout_seconds=communication_options.timeout_seconds))
        except (RuntimeError, ValueError) as error:
            raise BackendError(
                "TensorFlow could not start MultiWorkerMirroredStrategy: create it before any "
                f"TensorFlow computation (first thing in the program). TensorFlow said: {error}"
            ) from error
        num_gpus = gpu_count()
        local = [f"cuda:{index}" for index in range(num_gpus)] or ["cpu:0"]
        super().__init__(_Extended(
            local, native, first_replica_id=rendezvous.rank * len(local),
            num_input_pipelines=rendezvous.world_size, input_pipeline_id=rendezvous.rank))
        self.cluster_resolver = resolver
