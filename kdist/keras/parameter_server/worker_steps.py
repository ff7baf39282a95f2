"""Keras training against parameter servers (`ParameterServerStrategy`).

What changes for a model attached to a parameter-server strategy:

- every step function (`train`/`test`/`predict`, Keras' own or the replica
  engine's) first pulls the variables that changed on the servers into the
  local copies — one request per server;
- the optimizer's update (`push_update`, the parameter-server adapter's
  `apply_gradients`) changes nothing locally: it scales and
  clips the gradients as the optimizer would (norms need whole gradients,
  which only the worker has), then the step's update goes to the servers in
  one push per server, together with non-trainable state the step changed
  (BatchNorm statistics). The servers apply the optimizer, rebuilt from its
  config, under a per-variable lock;
- tables on parameter servers (`Embedding` tables, row-partitioned variables
  read with `ops.take`) are read by rows: a step (custom loops' too) pulls the
  rows its batch uses and pushes only their sparse gradients, never a dense
  one (`kdist.keras.parameter_server.embeddings`);
- `fit` ends, and `save`/`save_weights` start, by reading the servers' state
  (weights and optimizer slots) into the local model, so the file written is
  the parameter servers' current state and loads in plain Keras. Only the
  chief writes (others skip with a warning), atomically, `BackupAndRestore` too.

Called from `kdist.keras.parameter_server.adapter`; the only Keras internals used come from
`kdist.keras._compat`.
"""

import threading
import warnings

import keras
import torch

from kdist import faults
from kdist.errors import UnsupportedError
from kdist.keras import _compat, adapters, atomic_save
from kdist.keras.parameter_server import closure_outcome, remote_tables
from kdist.keras.parameter_server import embeddings as ps_embeddings
from kdist.keras.parameter_server.optimizer_config import server_optimizer_config
from kdist.ps.wire.conventions import slot_name

_local = threading.local()


def current_step():
    """The `_Step` of the step function running in this thread, or None."""
    return getattr(_local, "step", None)


def on_variable_created(variable, strategy):
    """Places `variable` on the parameter servers unless Keras made it for an optimizer, metric or RNG.

    An optimizer created in scope is connected too (its first variable is
    born in its constructor), so a custom loop's `optimizer.apply` pushes.
    Called for `ParameterServerStrategy` only (its `KerasAdapter`).
    """
    owner = _compat.variable_owner()
    if _compat.is_model_variable(variable, owner):
        strategy.extended._on_variable_created(variable)
        route = strategy.extended.variable_router.route(variable)
        if route is not None and route.row_sparse and isinstance(owner, keras.layers.Layer):
            # A table the servers hold: read by rows in a worker's own custom loop too.
            ps_embeddings.read_tables_in_replicas(owner, strategy.extended.variable_router)
    elif isinstance(owner, keras.optimizers.Optimizer) and not pushes(owner):
        _connect_optimizer(owner, PSSession(None, strategy))


class _Step:
    """The update one step function call produces, pushed when the call returns."""

    def __init__(self):
        self.dense = []
        self.row_updates = []
        self.pending = False


class PSSession:
    """Per-model state: which variables are remote, which optimizer the servers use.

    Not thread-safe: used by the thread that runs the model's `fit`.
    """

    def __init__(self, model, strategy):
        self.model = model
        self.strategy = strategy
        self.router = strategy.extended.variable_router
        self._configured = set()

    # ----- reads ----------------------------------------------------------------
    def routes(self):
        """Remote routes of the model's weights (none for an optimizer used without a model)."""
        return [] if self.model is None else self.router.routes(self.model.weights)

    def pull(self, include_row_sparse=False):
        """Reads what changed on the servers since the last read (one request per server)."""
        self.router.pull(self.routes(), include_row_sparse=include_row_sparse)

    # ----- optimizer --------------------------------------------------------------
    def configure(self, optimizer, routes):
        missing = [route for route in routes if route.trainable and id(route) not in self._configured]
        if not missing or optimizer is None:
            return
        self.router.configure_optimizer(server_optimizer_config(optimizer), missing)
        self._configured.update(id(route) for route in missing)

    def check_supported(self):
        for route in self.routes():
            if route.trainable and getattr(route.variable, "constraint", None) is not None:
                raise UnsupportedError(
                    "Variables with a constraint cannot live on parameter servers: the servers "
                    f"apply updates and do not know the constraint. Received: variable "
                    f"{route.variable.path!r} with constraint {route.variable.constraint!r}. "
                    "Drop the constraint or train this model with MirroredStrategy."
                )

    def update_from(self, optimizer, gradients, variables, step):
        """Turns `optimizer.apply(gradients, variables)` into a server update (see module doc)."""
        tensors, targets, local = [], [], []
        for gradient, variable in zip(gradients, variables):
            route = self.router.route(variable)
            if route is None:
                local.append((gradient, variable))
            elif gradient is not None and gradient.is_sparse:
                # Rows looked up by this step (by all its replicas): duplicate ids summed.
                ids, values = ps_embeddings.rows_of(gradient)
                versions, route.lookup_versions = route.lookup_versions, {}
                tensors.append(values)
                targets.append((route, ids, versions))
            elif route.row_sparse and gradient is not None:
                raise UnsupportedError(
                    f"The table {variable.path!r} is read by rows from the parameter servers: its gradient "
                    "must be the sparse row gradient autograd gives it, pushed as rows only. Received: a "
                    f"dense gradient of shape {tuple(gradient.shape)} (it would send the whole table). Pass "
                    "it as torch.autograd.grad or .grad returns it (no .to_dense()), computed inside fit, "
                    "strategy.run or a scheduled closure, where the table is read by rows.")
            elif gradient is not None:
                tensors.append(gradient)
                targets.append((route, None, None))
        if local:
            raise UnsupportedError(
                "Under ParameterServerStrategy every trainable variable must be created in "
                "strategy.scope() so it lives on the parameter servers. Received local variables "
                f"{[variable.path for _, variable in local]}. Build the model inside the scope."
            )
        scale = optimizer.loss_scale_factor
        if scale is not None:
            tensors = [tensor / scale for tensor in tensors]
        tensors = _compat.clip_gradients(optimizer, tensors)
        dense = [(route, tensor) for tensor, (route, ids, _) in zip(tensors, targets) if ids is None]
        rows = [(route, ids, tensor, versions) for tensor, (route, ids, versions) in zip(tensors, targets) if ids is not None]
        self.configure(optimizer, [route for route, _ in dense] + [route for route, *_ in rows])
        return dense, rows

    def send_updates(self, dense, rows, state_routes=()):
        """Sends a step's update and the changed `state_routes` (non-trainable); see `closure_outcome.send`."""
        assign = [route for route in state_routes if not route.trainable and self.router.changed(route)]
        if dense or rows or assign:
            closure_outcome.send(self.router, self.model, dense, rows, assign)

    # ----- save -------------------------------------------------------------------
    def read_back(self):
        """Makes the local model and optimizer hold the parameter servers' current state."""
        routes = self.routes()
        self.router.pull(routes, include_row_sparse=True, only_changed=False)
        optimizer = self.model.optimizer
        trainable = [route for route in routes if route.trainable]
        if optimizer is None or not trainable:
            return
        # Idempotent on the servers; a chief that never trained has not sent it yet.
        self.configure(optimizer, trainable)
        if not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        states = self.router.optimizer_state(trainable)
        iterations = 0
        for route, (route_iterations, slots) in zip(trainable, states):
            iterations = max(iterations, route_iterations)
            for server_slot, value in slots.items():
                slot = getattr(optimizer, "_kdist_ps_slots", {}).get((id(route.variable), server_slot))
                if slot is None:
                    raise UnsupportedError(
                        f"Cannot map the server's optimizer slot {server_slot!r} of "
                        f"{route.variable.path!r} to the local optimizer. The optimizer must be "
                        "built after the model is compiled in strategy.scope() (Keras does this "
                        "in fit), and its slots must be made with add_variable_from_reference."
                    )
                slot.assign(value)
        # The servers count the steps they applied since they started; a
        # coordinator counts every closure's steps exactly once (restored ones
        # included), so its count wins even where the servers applied steps
        # the chief never counted (in flight, or before a chief restart).
        if not self.strategy.extended.drives_workers:
            optimizer.iterations.assign(max(iterations, int(optimizer.iterations.numpy())))


def session_of(model):
    return getattr(model, "_kdist_ps_session", None)


def session_for(model, strategy):
    """The model's `PSSession` with `strategy`, created on first use."""
    session = session_of(model)
    if session is None or session.strategy is not strategy:
        session = PSSession(model, strategy)
        object.__setattr__(model, "_kdist_ps_session", session)
    return session


def connect_optimizer(model, strategy):
    """Makes the model's optimizer push to the parameter servers."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        _connect_optimizer(optimizer, session_for(model, strategy))


def wrap_step_functions(model, strategy):
    """Makes every step function pull first and push last (after the replica engine's overrides)."""
    session = session_for(model, strategy)
    for kind in ("train", "test", "predict"):
        _wrap_make_function(model, kind, session)


def _connect_optimizer(optimizer, session):
    """Makes `optimizer` push to `session`'s servers (through its adapter); later calls only switch the session.

    `kdist.keras.adapters.attach_optimizer` makes the parameter-server adapter
    own it: its `apply_gradients` is `push_update`. Its slots are recorded
    under the servers' names as they are made.
    """
    already_connected = pushes(optimizer)
    object.__setattr__(optimizer, "_kdist_ps_session", session)
    adapters.attach_optimizer(optimizer, session.strategy)
    if already_connected:
        return
    original_add = optimizer.add_variable_from_reference

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        with remote_tables.slot_of(reference_variable):  # a table the servers hold: so are its slots
            slot = original_add(reference_variable, *args, **kwargs)
        name = kwargs.get("name", args[0] if args else None)
        # Named as the servers name it (`kdist.ps.wire.conventions.slot_name`):
        # unique per (variable, slot), so two slots of one short name both map.
        taken = optimizer._kdist_ps_slot_names.setdefault(id(reference_variable), [])
        taken.append(slot_name(name, taken))
        optimizer._kdist_ps_slots[(id(reference_variable), taken[-1])] = slot
        return slot

    object.__setattr__(optimizer, "_kdist_ps_slots", {})
    object.__setattr__(optimizer, "_kdist_ps_slot_names", {})
    object.__setattr__(optimizer, "add_variable_from_reference", add_variable_from_reference)


def pushes(optimizer):
    """Whether `optimizer` was connected to parameter servers (made in the scope, or a model's compiled there)."""
    return getattr(optimizer, "_kdist_ps_session", None) is not None


def check_local_update(optimizer, variables, strategy):
    """Refuses a local update of variables the servers hold, by an optimizer connected to none.

    Raises:
        kdist.errors.UnsupportedError: naming the first such variable.
    """
    if variables is None:
        variables = _compat.optimizer_trainable_variables(optimizer)
    router = strategy.extended.variable_router
    for variable in variables:
        if router.route(variable) is not None:
            raise UnsupportedError(
                f"The optimizer {optimizer.name!r} was created outside strategy.scope() and is not "
                f"connected to the parameter servers, which hold variable {variable.path!r}: applying "
                "it would change only this process's copy. Received: optimizer.apply on that "
                "variable. Create the optimizer inside strategy.scope(), or compile the model with "
                "it there."
            )


def push_update(optimizer, gradients, variables):
    """The update of `optimizer.apply(gradients, variables)` under parameter servers: a push.

    In a step function the push waits for the call's end (one per step); in a
    custom loop it goes at once, and what it changed is read back as a local
    `apply` would have changed the variables.
    """
    session = optimizer._kdist_ps_session
    if variables is None:
        variables = _compat.optimizer_trainable_variables(optimizer)
    step = current_step()
    with torch.no_grad():
        dense, rows = session.update_from(optimizer, list(gradients), list(variables), step)
        optimizer.iterations.assign_add(1)
    if step is not None:
        if step.pending:
            # A second apply in one step function call: send the first now.
            session.send_updates(step.dense, step.row_updates)
        step.dense, step.row_updates, step.pending = dense, rows, True
        return
    session.send_updates(dense, rows)
    # Tables read by rows stay on the servers: the next lookup reads the new rows.
    session.router.pull([route for route, _ in dense] + [route for route, *_ in rows if not route.row_sparse])


def _wrap_make_function(model, kind, session):
    attribute = f"make_{kind}_function"
    base = getattr(model, f"_kdist_ps_base_{attribute}", None)
    if base is None or getattr(model, attribute) is not getattr(model, f"_kdist_ps_{attribute}", None):
        base = getattr(model, attribute)
        object.__setattr__(model, f"_kdist_ps_base_{attribute}", base)

    def make_function(force=False):
        if model.jit_compile:
            warnings.warn(
                "jit_compile=True is turned off under ParameterServerStrategy: each step talks "
                "to the parameter servers, which torch.compile cannot trace. The model trains eagerly.",
                stacklevel=2,
            )
            model.jit_compile = False
        base(force=force)
        function = getattr(model, f"{kind}_function")
        if getattr(function, "_kdist_ps_wrapped", False):
            return function
        wrapped = _train_wrapper(function, session) if kind == "train" else _read_wrapper(function, session)
        wrapped._kdist_ps_wrapped = True
        object.__setattr__(model, f"{kind}_function", wrapped)
        return wrapped

    object.__setattr__(model, f"_kdist_ps_{attribute}", make_function)
    object.__setattr__(model, attribute, make_function)
    object.__setattr__(model, f"{kind}_function", None)


def _train_wrapper(function, session):
    def train_function(data):
        # Once per step: which variables are remote (used by the pull and the push).
        routes = session.routes()
        if not faults.ACTIVE.skip_pull:
            session.router.pull(routes)
        step = _Step()
        _local.step = step
        try:
            with ps_embeddings.row_lookups(session.router, routes):
                logs = function(data)
        finally:
            _local.step = None
        session.send_updates(step.dense, step.row_updates, state_routes=routes)
        return logs

    return train_function


def _read_wrapper(function, session):
    def read_function(data):
        # Other workers keep training while this one evaluates: read what changed.
        session.pull()
        with ps_embeddings.row_lookups(session.router, session.routes()):
            return function(data)

    return read_function


# ----- fit / evaluate / predict / save ----------------------------------------------
def local_call(method, model, name, args, kwargs):
    """Runs `model.<name>` (already inside the strategy's scope) on this process, against the parameter servers.

    `kdist.keras.parameter_server.adapter` decides which calls come here (all
    but the coordinator's `fit` and `evaluate`).
    """
    session = session_of(model)
    strategy = session.strategy
    if name in ("fit", "train_on_batch"):
        session.check_supported()
        ps_embeddings.mark_tables(model, session.router)
        try:
            return method(model, *args, **kwargs)
        finally:
            # The servers hold the result; the local copies lag by the last push.
            # Embedding tables are read whole after fit only, not after each
            # train_on_batch (that would move the table every step).
            session.pull(include_row_sparse=name == "fit")
    if name in ("save", "save_weights"):
        if not strategy.extended.should_checkpoint:
            warnings.warn(
                f"model.{name}() was skipped on this worker: under ParameterServerStrategy only "
                "the chief writes files (strategy.extended.should_checkpoint is False here).",
                stacklevel=3,
            )
            return None
        session.read_back()
        return atomic_save.save(method, model, args, kwargs)
    if name == "load_weights":
        # The chief's optimizer applies nothing itself, so it may be unbuilt;
        # Keras would then skip its saved state (iterations included).
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        # What it loads reaches the servers: `adapter` runs it as one unit of `variable_writes`.
        return method(model, *args, **kwargs)
    if name in ("evaluate", "predict", "test_on_batch", "predict_on_batch"):
        ps_embeddings.mark_tables(model, session.router)
    return method(model, *args, **kwargs)
