"""Keras objects in coordinator training, on the chief: how each travels to the workers.

Describers, registered with `kdist.coordinator` when this module is imported: when a
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

The worker rebuilds them: `kdist.keras.parameter_server.worker_runtime`.
"""

import keras
import torch

from kdist.coordinator import register_describer
from kdist.distribute.parameter_server.strategy import ParameterServerStrategy
from kdist.errors import InvalidArgumentError
from kdist.keras import _compat
from kdist.keras.parameter_server import remote_tables


def _is_ps_strategy(obj):
    return isinstance(obj, ParameterServerStrategy)


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
    # sparse_updates travels too: a worker's router sends it with the optimizer config.
    spec = {"cluster": extended.cluster_resolver.cluster_spec().as_dict(), "options": extended.options,
            "sparse_updates": extended.sparse_updates}
    return "strategy", spec, None


def _describe_layer(layer, coordinator):
    known = _layer_index(coordinator).get(id(layer))
    if known is not None and known[1] == "layer":
        return "sublayer", (known[0], known[2]), None
    strategy = coordinator.strategy
    store = strategy.extended.variable_router
    layout = []
    for weight in layer.weights:
        route = store.route(weight)
        if route is None:
            raise InvalidArgumentError(
                "A model used in a scheduled function must be created in strategy.scope(), so that "
                f"its weights live on the parameter servers. Received: weight {weight.path!r} of "
                f"{layer.name!r}, which lives on the chief only."
            )
        layout.append((route.keys, route.placement, tuple(weight.shape), str(weight.dtype)))
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
        # Tables the servers hold: the worker creates no local value for them.
        "remote_tables": [remote_tables.table_key(weight.path) for weight in layer.weights
                          if store.route(weight).remote],
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
    route = strategy.extended.variable_router.route(variable)
    if route is None:
        raise InvalidArgumentError(
            "A variable used in a scheduled function must be created in strategy.scope() (it then "
            "lives on the parameter servers) or belong to a model, optimizer or metric. Received: "
            f"{variable.path!r}, a variable of the chief only."
        )
    spec = {
        "strategy": strategy, "keys": route.keys, "placement": route.placement,
        "shape": tuple(variable.shape), "dtype": str(variable.dtype),
        "trainable": bool(variable.trainable), "name": variable.name, "remote": route.remote,
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
