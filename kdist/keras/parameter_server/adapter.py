"""The Keras adapter of `ParameterServerStrategy`, and where each call of a model goes.

A model attached to a parameter-server strategy first gets everything the
replica engine does (`ReplicaAdapter`: several local devices train in sync,
their gradients recorded or merged by `optimizer_step`), then the
parameter-server parts of `kdist.keras.parameter_server.worker_steps`: the
optimizer's update is a push (`apply_gradients`), step functions pull first
and push last.

Who writes logs, checkpoints and summaries: `kdist.keras.chief_only`, for
every task (a worker other than the chief writes none; the coordinator is the
chief).

Routing (`ParameterServerAdapter.route_call`), decided here so that the
worker's steps and the chief's driver never import each other:

- on the coordinator (`strategy.extended.drives_workers`), `fit` and
  `evaluate` schedule closures onto the workers
  (`kdist.keras.parameter_server.chief_fit`);
- `save`/`save_weights` read the servers' state into the local copies, a
  refresh that `kdist.keras.parameter_server.variable_writes` does not send
  back; every other write of a variable the servers hold reaches them there;
- everything else runs locally against the servers
  (`kdist.keras.parameter_server.worker_steps.local_call`), one step per
  execution for the single-batch calls and `predict`.
"""

import inspect

from kdist.distribute.parameter_server.strategy import ParameterServerStrategy
from kdist.keras import _compat, adapters, atomic_save, chief_only
from kdist.keras.parameter_server import chief_fit, remote_tables, variable_writes, worker_runtime, worker_steps
from kdist.keras.parameter_server import embeddings as ps_embeddings
from kdist.keras.replica.adapter import ReplicaAdapter

# Calls that run the chief's own torch steps, which accept one step per
# execution only (`steps_per_execution` packs coordinator closures).
_ONE_STEP_CALLS = ("predict", "predict_on_batch", "test_on_batch", "train_on_batch")


class ParameterServerAdapter(ReplicaAdapter):
    """`KerasAdapter` of `ParameterServerStrategy` (worker and coordinator alike)."""

    def attach(self, model):
        super().attach(model)
        worker_steps.connect_optimizer(model, self.strategy)
        variable_writes.watch(self.strategy, getattr(model, "optimizer", None))
        # After the replica engine's overrides: pull first, push last around them.
        worker_steps.wrap_step_functions(model, self.strategy)

    def route_call(self, method, model, name, args, kwargs):
        session = worker_steps.session_of(model)
        strategy = session.strategy
        # One binding of the call: the chief-only rule first (a worker other than the
        # chief moves its backups to its own directory), then atomic backups for the rest.
        args, kwargs, callbacks = _task_callbacks(method, name, args, kwargs, strategy)
        if name == "fit":
            atomic_save.make_backups_atomic(callbacks)
        if name in ("fit", "evaluate") and strategy.extended.drives_workers:
            # The chief drives the workers; it trains nothing itself. During the call
            # its tables are row-read (the coordinator's joins skip them); they are
            # read whole once, below, and joins read them again afterwards.
            session.check_supported()
            marked = ps_embeddings.mark_tables(model, strategy.extended.variable_router)
            run = chief_fit.fit if name == "fit" else chief_fit.evaluate
            try:
                return run(model, strategy, *args, **kwargs)
            finally:
                session.pull(include_row_sparse=True)
                for route in marked:
                    route.row_sparse = route.remote  # a table the servers hold stays read by rows
        if name in ("save", "save_weights"):
            with variable_writes.internal():  # reads the servers' state into the local copies
                return worker_steps.local_call(method, model, name, args, kwargs)
        if name == "load_weights":
            # Everything Keras assigns while loading (weights, tables, the optimizer's slots
            # and iterations when the file holds them) is sent when it returns, and nothing
            # if it fails: the servers apply every update with their own optimizer, so a
            # restore that left their slots behind would be silently unlike one device.
            with variable_writes.writing("model.load_weights()"):
                return worker_steps.local_call(method, model, name, args, kwargs)
        if name in _ONE_STEP_CALLS:
            with chief_fit.one_step_per_execution(model):
                return worker_steps.local_call(method, model, name, args, kwargs)
        return worker_steps.local_call(method, model, name, args, kwargs)

    def apply_gradients(self, optimizer, gradients, variables):
        # The servers apply the optimizer; this worker pushes the gradients. An
        # optimizer made outside the scope updates local variables only.
        if not worker_steps.pushes(optimizer):
            worker_steps.check_local_update(optimizer, variables, self.strategy)
            return super().apply_gradients(optimizer, gradients, variables)
        with variable_writes.internal():  # counts the pushed update in the local optimizer
            return worker_steps.push_update(optimizer, gradients, variables)

    def on_variable_created(self, variable):
        worker_steps.on_variable_created(variable, self.strategy)
        # Writes of it (or of this optimizer's slots) go to the servers from now on.
        variable_writes.watch(self.strategy, _compat.variable_owner())

    def on_variable_initializing(self, variable, initializer):
        return remote_tables.placeholder_for(variable, initializer, self.strategy)


def _task_callbacks(method, name, args, kwargs, strategy):
    """`(args, kwargs, callbacks)` of `fit`/`evaluate`/`predict` with `kdist.keras.chief_only`'s rule applied.

    Each worker trains alone (no collective saves); the coordinator is the
    chief, so its callbacks all run. `callbacks` is what the call then passes.
    Other calls, and calls Keras will refuse, are returned unchanged (with
    no callbacks).
    """
    if name not in ("fit", "evaluate", "predict"):
        return args, kwargs, None
    try:
        signature = inspect.signature(method)
        bound = signature.bind(None, *args, **kwargs)
    except TypeError:
        return args, kwargs, None  # Keras reports the bad call itself
    resolver = strategy.cluster_resolver
    chief_only.task_callbacks(bound.arguments, strategy, collective_saves=False,
                              has_verbose="verbose" in signature.parameters,
                              task=f"{resolver.task_type}-{resolver.task_id}")
    return bound.args[1:], bound.kwargs, bound.arguments.get("callbacks")


def install():
    """Registers `ParameterServerAdapter`; workers started in this process build Keras resources."""
    worker_runtime.install()
    adapters.register(ParameterServerStrategy, ParameterServerAdapter)
