"""kdist's `MirroredStrategy` on Keras' JAX backend, over `keras.distribution.DataParallel`.

Keras 3 on JAX trains data-parallel under a `keras.distribution.DataParallel`:
variables are replicated over a device mesh, each global batch is sharded along
it, and XLA combines the gradients inside the compiled step. This class gives
that the kdist API:

- `strategy.scope()` is the distribution's scope plus kdist's. A model created
  inside remembers the strategy: its `fit`, `evaluate` and `predict` run under
  the distribution wherever they are called, as on torch;
- `strategy.run` calls the function once per replica, in replica order, each
  inside `jax.default_device` of its replica; per-replica values are
  `kdist.PerReplica` of JAX arrays, one on each replica's device;
- `reduce` and `gather` combine the components on the host and return JAX
  arrays;
- replicas run one after another in one thread, so a replica function cannot
  wait for the others: `merge_call`, `all_reduce` and `all_gather` inside
  `run` raise `UnsupportedError` naming the alternative.

Several CPU replicas (`["cpu:0", "cpu:1"]`) need JAX to show that many CPU
devices, which must be configured before JAX's first computation: create the
strategy first (before `keras.utils.set_random_seed`, which computes).
"""

import functools
import importlib.metadata
import weakref

import jax
import jax.numpy as jnp
import keras

from kdist._backend import STRATEGY_BACKENDS
from kdist.backends.common import BackendExtended, BackendReplicaContext, BackendStrategy
from kdist.distribute import batching, context, nest
from kdist.distribute.extended import check_gather_shapes
from kdist.distribute.devices import resolve_devices
from kdist.distribute.input import per_replica_structure
from kdist.distribute.values import (
    DistributedValues,
    check_num_components,
    local_results,
    regroup,
    select_replica,
)
from kdist.errors import InvalidArgumentError, InvalidDeviceError, UnsupportedError
from kdist.keras import _compat
from kdist.types import ReduceOp

_NO_CROSS_REPLICA_CALLS = (
    "{api} is not available on the JAX backend: kdist runs JAX replica functions one after "
    "another in one thread, so a replica cannot wait for the others. Return per-replica values "
    "from strategy.run and combine them in the cross-replica context with strategy.reduce or "
    "strategy.gather, or write the step with jax.shard_map / keras.distribution instead."
)


# Where `batch_size` stands among the positional arguments of each method.
_BATCH_SIZE_POSITION = {"fit": 2, "evaluate": 2, "predict": 1}


def gpu_count():
    """GPUs JAX sees.

    Asking JAX for its devices starts its runtime, after which the number of
    CPU devices is fixed; without a GPU plugin installed there is nothing to
    ask, so CPU replicas can still be configured afterwards.
    """
    if not _gpu_plugin_installed():
        return 0
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:  # a plugin, but no GPU
        return 0


def _gpu_plugin_installed():
    names = (distribution.metadata["Name"] or "" for distribution in importlib.metadata.distributions())
    return any(name.lower().replace("_", "-").startswith(("jax-cuda", "jax-rocm")) for name in names)


def ensure_cpu_devices(count):
    """Makes JAX show at least `count` CPU devices (logical replicas on one CPU).

    Raises:
        kdist.errors.InvalidDeviceError: JAX already computed with fewer.
    """
    if jax.config.jax_num_cpu_devices >= count:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
        return
    except RuntimeError:
        available = len(jax.devices("cpu"))
    if available < count:
        raise InvalidDeviceError(
            f"JAX needs {count} CPU devices for {count} CPU replicas, and it already started with "
            f"{available}. Received: {count} CPU devices. Create the strategy before JAX's first "
            "computation (e.g. before keras.utils.set_random_seed), or start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count}."
        )


def _jax_device(device):
    return jax.devices("gpu" if device.kind == "cuda" else "cpu")[device.index]


class _ReplicaContext(BackendReplicaContext):
    """A replica's context on JAX: ids and devices; no cross-replica calls."""

    def merge_call(self, merge_fn, args=(), kwargs=None):
        raise UnsupportedError(_NO_CROSS_REPLICA_CALLS.format(api="merge_call"))

    def all_reduce(self, reduce_op, value):
        raise UnsupportedError(_NO_CROSS_REPLICA_CALLS.format(api="all_reduce"))

    def all_gather(self, value, axis):
        raise UnsupportedError(_NO_CROSS_REPLICA_CALLS.format(api="all_gather"))


class MirroredStrategy(BackendStrategy):
    """Synchronous training on the devices of one machine, by `keras.distribution.DataParallel`.

    Args:
        devices: device strings as on torch (`["cpu:0", "cpu:1"]`,
            `["cuda:0", "cuda:1"]`, ...). Several CPU entries are logical
            replicas; kdist asks JAX for that many CPU devices, which must
            happen before JAX's first computation. `None` means every visible
            GPU, else one CPU replica.
        cross_device_ops: must be None: XLA reduces between devices.

    Raises:
        kdist.errors.InvalidDeviceError: as on torch, or JAX already started
            with fewer CPU devices than requested.
        kdist.errors.UnsupportedError: `cross_device_ops` given.

    Example:

    ```python
    strategy = kdist.MirroredStrategy(["cpu:0", "cpu:1"])   # KERAS_BACKEND=jax
    with strategy.scope():
        model = build_and_compile()
    model.fit(x, y, batch_size=128)    # 64 samples per replica per step
    ```
    """

    SUPPORTED_BACKENDS = STRATEGY_BACKENDS["MirroredStrategy"]

    def __init__(self, devices=None, cross_device_ops=None):
        if cross_device_ops is not None:
            raise UnsupportedError(
                "On the JAX backend XLA reduces between devices, so there is no cross-device op to "
                f"choose. Received: cross_device_ops={cross_device_ops!r}. Pass None."
            )
        parsed = resolve_devices(devices, "devices", gpu_count)
        if parsed[0].kind == "cpu" and len(parsed) > 1:
            ensure_cpu_devices(max(device.index for device in parsed) + 1)
        self._devices = [_jax_device(device) for device in parsed]
        # Models created in the scope (their variables are the replicas' state in `run`).
        self._models = weakref.WeakSet()
        distribution = keras.distribution.DataParallel(
            devices=[f"{'gpu' if device.kind == 'cuda' else 'cpu'}:{device.index}" for device in parsed])
        super().__init__(BackendExtended([device.name for device in parsed], distribution))
        _install_model_hook()

    @property
    def distribution(self):
        """The `keras.distribution.DataParallel` this strategy drives."""
        return self._extended.native

    def _backend_run(self, fn, args, kwargs):
        check_num_components((args, kwargs), len(self._devices), "args/kwargs")
        variables = [variable for model in list(self._models) for variable in model.variables]
        results = []
        for replica_id, device in enumerate(self._devices):
            replica_args, replica_kwargs = select_replica(replica_id, (args, kwargs))
            replica_context = _ReplicaContext(self, replica_id, self._extended.worker_devices[replica_id])
            # The models' variables as this replica's copies (they are replicated
            # over every device; a computation must not mix devices).
            mapping = [(variable, _on_device(variable.value, device)) for variable in variables]
            context.push(self, replica_context)
            try:
                with keras.StatelessScope(state_mapping=mapping) as scope, jax.default_device(device):
                    initial = dict(scope.state_mapping)
                    results.append(fn(*replica_args, **replica_kwargs))
            finally:
                context.pop(self)
            _refuse_updates(scope, initial, variables)
        return regroup(results)

    def _is_distributed(self, value):
        return isinstance(value, DistributedValues)

    def _components(self, value):
        host = jax.devices("cpu")[0]
        components = [jax.device_put(jnp.asarray(component), host) for component in local_results(value)]
        if not self._is_distributed(value):
            components = components * len(self._devices)
        return components

    def _backend_reduce(self, reduce_op, value, axis):
        components = self._components(value)
        if axis is None:
            if reduce_op is ReduceOp.MEAN and not self._is_distributed(value):
                return components[0]
            total = functools.reduce(jnp.add, components)
            return total if reduce_op is ReduceOp.SUM else total / len(components)
        total = functools.reduce(jnp.add, [component.sum(axis=axis) for component in components])
        if reduce_op is ReduceOp.SUM:
            return total
        # True division: the mean of integer flags must not truncate.
        return total / sum(component.shape[axis] for component in components)

    def _gather_leaf(self, value, axis):
        components = self._components(value)
        if any(component.ndim == 0 for component in components):
            raise InvalidArgumentError(
                "Cannot gather scalars: components must have rank >= 1. Received a "
                "rank-0 value. Add a dimension first (e.g. x[None])."
            )
        check_gather_shapes(components, axis)
        return jnp.concatenate(components, axis=axis)

    def _local_results(self, value):
        return local_results(value)

    def _per_replica(self, values):
        return per_replica_structure([nest.map_structure(lambda leaf, device=device: _to_device(leaf, device), value)
                                      for value, device in zip(values, self._devices)])

    def check_batches(self, method, args, kwargs):
        """Raises if a `fit`/`evaluate`/`predict` call on arrays has a batch that does not split evenly.

        JAX shards every batch over the replicas in equal parts, so each batch,
        the last partial one too, must divide by the number of replicas.
        """
        position = _BATCH_SIZE_POSITION[method]
        x = kwargs["x"] if "x" in kwargs else (args[0] if args else None)
        batch_size = kwargs["batch_size"] if "batch_size" in kwargs else (
            args[position] if len(args) > position else None)
        self._check_arrays("x", x, batch_size)
        validation = kwargs.get("validation_data")
        if method == "fit" and isinstance(validation, (tuple, list)) and validation:
            self._check_arrays("validation_data", validation[0], kwargs.get("validation_batch_size") or batch_size)

    def _check_arrays(self, name, x, batch_size):
        leaves = [leaf for leaf in nest.flatten(x) if hasattr(leaf, "shape") and len(leaf.shape)]
        if not leaves:
            return  # a dataset or generator: JAX checks each batch itself
        num_samples = batching.batch_size_of(x)
        batch_size = batch_size or 32
        num_replicas = self.num_replicas_in_sync
        for size in {min(batch_size, num_samples), num_samples % batch_size or batch_size}:
            if size % num_replicas:
                raise InvalidArgumentError(
                    f"On the JAX backend every batch is split over {num_replicas} replicas in equal "
                    f"parts. Received: {name} with {num_samples} samples and batch_size={batch_size}, "
                    f"which makes a batch of {size}. Use a batch size and a number of samples that "
                    f"are multiples of {num_replicas} (drop the last {num_samples % num_replicas} "
                    "samples, for example)."
                )


def _on_device(array, device):
    """`array`'s copy on `device` (its shard there when it is replicated over a mesh)."""
    for shard in getattr(array, "addressable_shards", ()):
        if shard.device == device and shard.data.shape == array.shape:
            return shard.data
    return jax.device_put(array, device)


def _refuse_updates(scope, initial, variables):
    updated = [key for key, value in scope.state_mapping.items() if initial.get(key) is not value]
    if not updated:
        return
    names = {id(variable): variable.path for variable in variables}
    described = sorted(names.get(key, "a variable outside the strategy's models") for key in updated)
    raise UnsupportedError(
        "strategy.run on the JAX backend cannot update variables: replicas run one after another "
        "on their own copies, and each replica's update would differ. Received updates of "
        f"{described[:5]}. Train with model.fit, or write the step functionally "
        "(model.stateless_call, jax.grad, optimizer.stateless_apply) and combine per-replica "
        "results with strategy.reduce."
    )


def _to_device(leaf, device):
    if leaf is None or not hasattr(leaf, "shape"):
        return leaf
    return jax.device_put(leaf, device)


class MultiWorkerMirroredStrategy:
    """Not on the JAX backend in this release; see `docs/backends.md`.

    Raises:
        kdist.errors.UnsupportedError: always, naming the alternatives.
    """

    SUPPORTED_BACKENDS = STRATEGY_BACKENDS["MultiWorkerMirroredStrategy"]

    def __init__(self, cluster_resolver=None, communication_options=None, devices=None):
        raise UnsupportedError(
            "MultiWorkerMirroredStrategy is not available on the JAX backend of kdist. Received: "
            "keras.backend.backend()='jax'. Use kdist.MirroredStrategy for every device of one "
            "machine, KERAS_BACKEND=torch or tensorflow for several processes, or Keras' own "
            "keras.distribution.initialize(...) with DataParallel."
        )


_hook_installed = False


def _install_model_hook():
    """Models created in a JAX strategy's scope run `fit`/`evaluate`/`predict` in it (once per process)."""
    global _hook_installed
    if _hook_installed:
        return
    trainer = _compat.Trainer
    original_init = trainer.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        strategy = context.get_strategy()
        if isinstance(strategy, MirroredStrategy) and context.strategy_of(self) is None:
            context.bind_model(self, strategy)
            strategy._models.add(self)
            for name in ("fit", "evaluate", "predict"):
                object.__setattr__(self, name, _scoped(self, name, strategy))

    trainer.__init__ = __init__
    _hook_installed = True


def _scoped(model, name, strategy):
    method = getattr(type(model), name)

    @functools.wraps(method)
    def scoped(*args, **kwargs):
        strategy.check_batches(name, args, kwargs)
        with strategy.scope():
            return method(model, *args, **kwargs)

    return scoped
