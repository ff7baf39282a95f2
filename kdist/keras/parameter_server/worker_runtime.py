"""Keras objects in coordinator training, on the worker: `KerasWorkerRuntime`.

The chief sends what a scheduled function refers to as resources
(`kdist.keras.parameter_server.describers`); the worker rebuilds each one:

- the strategy → the worker's own `ParameterServerStrategy` on the same
  parameter servers;
- a model or layer → rebuilt from its Keras config without creating anything
  on the servers, each weight bound to the chief's variable there, then
  compiled with the chief's compile config;
- a sub-layer or one weight of a model already sent → found by its path;
- a variable created in scope outside any model → bound to its keys and placement;
- an optimizer → from its config, created in scope, so its `apply` pushes
  gradients to the parameter servers, which apply the optimizer;
- a metric → from its config; each closure starts it from zero and returns
  its state variables (an optimizer: how many steps it applied) for the chief
  to add up.

Tables (`Embedding` tables, row-partitioned variables) are read by rows
while a closure runs: its steps pull the rows their batches use and push
only those rows' gradients (`kdist.keras.parameter_server.embeddings`).

Every closure runs inside the worker strategy's scope after one pull of the
latest values of the variables it references (those of the models, layers and
variables in its pickle; one request per parameter server, none when it
references none; skipped for functions marked `kdist_reads_variables_itself`,
such as `fit`'s closures, whose every step pulls), with idempotency keys
derived from the closure id on every push, so a closure re-run after a worker
died does not apply the updates of the first run twice.
"""

import inspect

import keras
import numpy as np

from kdist.cluster import ClusterSpec, SimpleClusterResolver
from kdist.coordinator import WorkerRuntime, set_runtime_factory
from kdist.distribute.input import InputContext
from kdist.distribute.parameter_server.strategy import ParameterServerStrategy
from kdist.errors import InvalidArgumentError
from kdist.keras import _compat
from kdist.keras.parameter_server import embeddings as ps_embeddings
from kdist.keras.parameter_server import remote_tables


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
            resolver = SimpleClusterResolver(ClusterSpec(spec["cluster"]), task_type="worker", task_id=self.task_index)
            self.strategy = ParameterServerStrategy(resolver, options=spec["options"], security=self.security,
                                                    sparse_updates=spec["sparse_updates"])
        return self.strategy

    def _adopt(self, strategy, variable, keys, placement, shape, dtype):
        if tuple(variable.value.shape) != tuple(shape) or str(variable.dtype) != dtype:
            raise InvalidArgumentError(
                f"The worker rebuilt {variable.path!r} as {tuple(variable.value.shape)} {variable.dtype}, "
                f"the chief has {tuple(shape)} {dtype}: the model's config does not rebuild the same "
                "weights. Give custom layers a get_config() that rebuilds them."
            )
        router = strategy.extended.variable_router
        route = router.adopt(variable, placement, keys)
        table = remote_tables.of(variable)
        if table is not None:
            remote_tables.bind(table, route, router)

    def _build_model(self, spec):
        strategy = spec["strategy"]
        with strategy.scope(), strategy.extended.local_variable_creation():
            with keras.saving.custom_object_scope(spec["custom_objects"]):
                with strategy.extended.adopting_tables(spec.get("remote_tables", ())):
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
        # Closures run the model's step functions without `fit`: what fit does first, done here.
        _compat.track_torch_parameters(model)
        # Its tables are read by rows in every closure (`kdist.keras.parameter_server.embeddings`).
        ps_embeddings.mark_tables(model, strategy.extended.variable_router)
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
            # A table the servers hold gets a stand-in (its path is known once created: adopt any).
            with strategy.extended.adopting_tables([spec["name"]] if spec.get("remote") else ()):
                variable = keras.Variable(
                    "zeros" if spec.get("remote") else np.zeros(spec["shape"], dtype=spec["dtype"]),
                    shape=spec["shape"], dtype=spec["dtype"], trainable=spec["trainable"], name=spec["name"],
                )
        self._adopt(strategy, variable, spec["keys"], spec["placement"], spec["shape"], spec["dtype"])
        ps_embeddings.mark_variable(variable, strategy.extended.variable_router)
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
            routes = store.routes(_variables_of(resources))
            if not getattr(function, "kdist_reads_variables_itself", False):
                store.pull(routes)  # tables read by rows are looked up as the closure runs
            with ps_embeddings.row_lookups(store, routes):
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
