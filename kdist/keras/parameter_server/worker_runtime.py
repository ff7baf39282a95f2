"""Keras objects in coordinator training: how they travel to workers and live there.

On the chief (describers, registered with `kdist.coordinator`): when a
scheduled function refers to something created in `strategy.scope()`, it is
sent once per worker as a resource:

- the strategy → the worker's own `ParameterServerStrategy` on the same
  parameter servers;
- a model or layer → its Keras config (`keras.saving.serialize_keras_object`;
  classes defined in the chief's `__main__` travel by value with cloudpickle),
  the server keys and placements of its weights, and its compile config. The
  worker rebuilds it without creating anything on the servers and binds each
  weight to the chief's variable there;
- a sub-layer or one weight of a model already sent → a path into it;
- a variable created in scope outside any model → its keys and placement;
- an optimizer → its config; on the worker its `apply` pushes gradients to
  the parameter servers, which apply the optimizer;
- a metric → its config. Each closure starts the worker's copy from zero and
  returns its state variables; the chief adds them into its own metric, so
  `metric.result()` on the chief covers every closure exactly once (metric
  states are sums — counts and totals — for every built-in Keras metric).
  An optimizer's steps are counted the same way: each closure returns how
  many times its copy applied gradients, and the chief adds that into its
  `optimizer.iterations`.

On the worker (`KerasWorkerRuntime`): resources are rebuilt as above, and every
closure runs inside the worker strategy's scope after one pull of the latest
values of the variables it references (those of the models, layers and
variables in its pickle; one request per parameter server, none when it
references none; skipped for functions marked `kdist_reads_variables_itself`,
such as `fit`'s closures, whose every step pulls), with idempotency keys
derived from the closure id on every push, so a closure re-run after a worker
died does not apply the updates of the first run twice.
"""

import inspect

import keras
import numpy as np
import torch

from kdist.cluster import ClusterSpec, SimpleClusterResolver
from kdist.coordinator import WorkerRuntime, register_describer, set_runtime_factory
from kdist.distribute.input import InputContext
from kdist.errors import InvalidArgumentError
from kdist.keras import _compat
from kdist.keras.parameter_server import worker_steps as ps_training


def _is_ps_strategy(obj):
    return hasattr(getattr(obj, "extended", None), "variable_router") and hasattr(obj, "scope")


def _layer_index(coordinator):
    # id(object) -> (model, "layer" | "weight", index), for models already sent.
    return coordinator.__dict__.setdefault("_kdist_layer_index", {})


def _custom_objects(objects):
    """Classes that a worker may not import by name: those defined outside keras."""
    custom = {}
    for obj in objects:
        cls = type(obj)
        if not cls.__module__.startswith("keras."):
            custom[keras.saving.get_registered_name(cls)] = cls
            custom[cls.__name__] = cls
    return custom


# ----- chief side ---------------------------------------------------------------------
def _describe_strategy(strategy, coordinator):
    extended = strategy.extended
    spec = {"cluster": extended.cluster_resolver.cluster_spec().as_dict(), "options": extended.options}
    return "strategy", spec, None


def _describe_layer(layer, coordinator):
    known = _layer_index(coordinator).get(id(layer))
    if known is not None and known[1] == "layer":
        return "sublayer", (known[0], known[2]), None
    strategy = coordinator.strategy
    store = strategy.extended.variable_router
    layout = []
    for weight in layer.weights:
        entry = store.entry(weight)
        if entry is None:
            raise InvalidArgumentError(
                "A model used in a scheduled function must be created in strategy.scope(), so that "
                f"its weights live on the parameter servers. Received: weight {weight.path!r} of "
                f"{layer.name!r}, which lives on the chief only."
            )
        layout.append((entry.keys, entry.placement, tuple(weight.shape), str(weight.dtype)))
    if not layer.built and not _builds_no_weights(layer):
        raise InvalidArgumentError(
            f"Build the model before scheduling functions that use it. Received: {layer.name!r} "
            "is not built (call it on a batch, or give its first layer an input shape)."
        )
    layers = [layer, *_compat.sublayers(layer)]
    index = _layer_index(coordinator)
    for position, sublayer in enumerate(layers[1:]):
        index.setdefault(id(sublayer), (layer, "layer", position))
    for position, weight in enumerate(layer.weights):
        index.setdefault(id(weight), (layer, "weight", position))
    optimizer = getattr(layer, "optimizer", None)
    compile_config = layer.get_compile_config() if getattr(layer, "compiled", False) else None
    spec = {
        "strategy": strategy,
        "config": keras.saving.serialize_keras_object(layer),
        "custom_objects": _custom_objects(layers),
        "layout": layout,
        "compile": compile_config,
        "optimizer": optimizer if compile_config else None,
    }
    return "model", spec, None


def _builds_no_weights(layer):
    """True for an unbuilt layer that creates nothing when built (a `StringLookup`, for one).

    Its class keeps `Layer.build` and every sublayer is built, so the worker
    may build its copy lazily: no weight can be born there, off the servers.
    """
    return type(layer).build is keras.layers.Layer.build and all(sub.built for sub in _compat.sublayers(layer))


def _describe_variable(variable, coordinator):
    known = _layer_index(coordinator).get(id(variable))
    if known is not None and known[1] == "weight":
        return "model_variable", (known[0], known[2]), None
    strategy = coordinator.strategy
    entry = strategy.extended.variable_router.entry(variable)
    if entry is None:
        raise InvalidArgumentError(
            "A variable used in a scheduled function must be created in strategy.scope() (it then "
            "lives on the parameter servers) or belong to a model, optimizer or metric. Received: "
            f"{variable.path!r}, a variable of the chief only."
        )
    spec = {
        "strategy": strategy, "keys": entry.keys, "placement": entry.placement,
        "shape": tuple(variable.shape), "dtype": str(variable.dtype),
        "trainable": bool(variable.trainable), "name": variable.name,
    }
    return "variable", spec, None


def _describe_optimizer(optimizer, coordinator):
    spec = {
        "strategy": coordinator.strategy,
        "config": keras.optimizers.serialize(optimizer),
        "custom_objects": _custom_objects([optimizer]),
    }
    return "optimizer", spec, merge_optimizer_steps


def merge_optimizer_steps(optimizer, arrays):
    """Adds the steps a closure applied (its worker copy's `iterations`) into `optimizer.iterations` on the chief.

    Like a metric's state, it counts only from the run whose result arrives,
    so `iterations` on the chief is the number of steps applied, each once.
    """
    add_state([optimizer.iterations], arrays, what=f"optimizer {optimizer.name!r}")


def _describe_metric(metric, coordinator):
    spec = {"config": keras.metrics.serialize(metric), "custom_objects": _custom_objects([metric])}
    return "metric", spec, merge_metric_state


def merge_metric_state(metric, arrays):
    """Adds a closure's metric state (its variables' values) into `metric` on the chief."""
    add_state(list(metric.variables), arrays, what=f"metric {metric.name!r}")


def add_state(variables, arrays, what):
    """Adds each array into its variable in place.

    The chief does this once per closure, so it bypasses `Variable.assign`
    (which converts and copies twice; about 8x slower).

    Raises:
        kdist.errors.InvalidArgumentError: the counts differ (nothing is added).
    """
    if len(variables) != len(arrays):
        raise InvalidArgumentError(
            f"The worker's copy of {what} has {len(arrays)} state variables, the chief's has "
            f"{len(variables)}. Build it the same way on both (create it in strategy.scope() with "
            "all its arguments)."
        )
    with torch.no_grad():
        for variable, delta in zip(variables, arrays):
            value = variable.value
            value.add_(torch.as_tensor(delta, dtype=value.dtype, device=value.device))


register_describer(_is_ps_strategy, _describe_strategy)
register_describer(lambda obj: isinstance(obj, keras.metrics.Metric), _describe_metric)
register_describer(lambda obj: isinstance(obj, keras.layers.Layer), _describe_layer)
register_describer(lambda obj: isinstance(obj, keras.Variable), _describe_variable)
register_describer(lambda obj: isinstance(obj, keras.optimizers.Optimizer), _describe_optimizer)


# ----- worker side --------------------------------------------------------------------
class KerasWorkerRuntime(WorkerRuntime):
    """Builds Keras resources on a worker and runs closures against the parameter servers."""

    def __init__(self, cluster_spec, task_index, security):
        super().__init__(cluster_spec, task_index, security)
        self.strategy = None

    def build(self, kind, spec):
        builder = getattr(self, f"_build_{kind}", None)
        if builder is None:
            return super().build(kind, spec)
        return builder(spec)

    def _build_strategy(self, spec):
        if self.strategy is None:
            from kdist.distribute.parameter_server.strategy import ParameterServerStrategy

            resolver = SimpleClusterResolver(ClusterSpec(spec["cluster"]), task_type="worker", task_id=self.task_index)
            self.strategy = ParameterServerStrategy(resolver, options=spec["options"], security=self.security)
        return self.strategy

    def _adopt(self, strategy, variable, keys, placement, shape, dtype):
        if tuple(variable.value.shape) != tuple(shape) or str(variable.dtype) != dtype:
            raise InvalidArgumentError(
                f"The worker rebuilt {variable.path!r} as {tuple(variable.value.shape)} {variable.dtype}, "
                f"the chief has {tuple(shape)} {dtype}: the model's config does not rebuild the same "
                "weights. Give custom layers a get_config() that rebuilds them."
            )
        strategy.extended.variable_router.adopt(variable, placement, keys)

    def _build_model(self, spec):
        strategy = spec["strategy"]
        with strategy.scope(), strategy.extended.local_variable_creation():
            with keras.saving.custom_object_scope(spec["custom_objects"]):
                model = keras.saving.deserialize_keras_object(spec["config"])
        if len(model.weights) != len(spec["layout"]):
            raise InvalidArgumentError(
                f"The worker rebuilt {model.name!r} with {len(model.weights)} weights, the chief's has "
                f"{len(spec['layout'])}. Give custom layers a get_config() that rebuilds them."
            )
        for weight, (keys, placement, shape, dtype) in zip(model.weights, spec["layout"]):
            self._adopt(strategy, weight, keys, placement, shape, dtype)
        if spec["compile"]:
            with keras.saving.custom_object_scope(spec["custom_objects"]):
                config = keras.saving.deserialize_keras_object(spec["compile"])
            if spec["optimizer"] is not None:
                config["optimizer"] = spec["optimizer"]
            # kdist packs steps itself; the torch trainer accepts only 1.
            config["steps_per_execution"] = 1
            config["jit_compile"] = False
            with strategy.scope():
                model.compile(**config)
        return model

    def _build_sublayer(self, spec):
        model, position = spec
        return list(_compat.sublayers(model))[position]

    def _build_model_variable(self, spec):
        model, position = spec
        return model.weights[position]

    def _build_variable(self, spec):
        strategy = spec["strategy"]
        with strategy.scope(), strategy.extended.local_variable_creation():
            variable = keras.Variable(
                np.zeros(spec["shape"], dtype=spec["dtype"]), dtype=spec["dtype"],
                trainable=spec["trainable"], name=spec["name"],
            )
        self._adopt(strategy, variable, spec["keys"], spec["placement"], spec["shape"], spec["dtype"])
        return variable

    def _build_optimizer(self, spec):
        # Created in scope: its `apply` becomes a push to the parameter servers.
        with spec["strategy"].scope():
            return keras.optimizers.deserialize(spec["config"], custom_objects=spec["custom_objects"])

    def _build_metric(self, spec):
        return keras.metrics.deserialize(spec["config"], custom_objects=spec["custom_objects"])

    def _build_dataset(self, dataset_fn):
        if _takes_argument(dataset_fn):
            workers = self.cluster_spec.num_tasks("worker")
            replicas = 1 if self.strategy is None else self.strategy.num_replicas_in_sync
            return dataset_fn(InputContext(num_input_pipelines=workers, input_pipeline_id=self.task_index,
                                           num_replicas_in_sync=replicas))
        return dataset_fn()

    def _build_iterator(self, dataset):
        return iter(dataset)

    def run(self, function, args, kwargs, closure_id, metrics, resources):
        for metric in metrics:
            if isinstance(metric, keras.optimizers.Optimizer):
                # Its steps are counted on the chief; here it counts one closure's.
                metric.iterations.assign(0)
            else:
                metric.reset_state()
        if self.strategy is None:
            return function(*args, **kwargs)
        store = self.strategy.extended.variable_router
        with self.strategy.scope(), store.idempotent_updates(closure_id):
            if not getattr(function, "kdist_reads_variables_itself", False):
                store.pull(store.entries(_variables_of(resources)))
            return function(*args, **kwargs)

    def metric_state(self, metric):
        if isinstance(metric, keras.optimizers.Optimizer):
            return [np.asarray(metric.iterations.numpy())]
        return [np.asarray(variable.numpy()) for variable in metric.variables]

    def close(self):
        if self.strategy is not None:
            self.strategy.extended.variable_router.close()


def _variables_of(resources):
    """The variables a closure can read: those of the layers and variables it references."""
    for resource in resources:
        if isinstance(resource, keras.layers.Layer):
            yield from resource.weights
        elif isinstance(resource, keras.Variable):
            yield resource


def _takes_argument(function):
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    return len(positional) == 1


def install():
    """Makes workers started in this process build Keras resources."""
    set_runtime_factory(KerasWorkerRuntime)


def is_coordinator_mode(strategy):
    """True when `model.fit` on this process should drive the workers (see `ParameterServerExtended.is_coordinator`)."""
    if not ps_training.is_parameter_server(strategy):
        return False
    return bool(getattr(strategy.extended, "is_coordinator", False))
