"""Every write of a variable the parameter servers hold reaches them, or is refused.

Under `ParameterServerStrategy` a model's variables live on the servers; the
local Keras variable is a copy that every step refreshes. A write that
changed the copy only would be silently undone by the next pull, so every
write of a torch Keras variable passes here (`kdist.keras._compat`
hooks `Variable._direct_assign`, where `assign`, `assign_add`, `set_weights`,
`load_weights` and a `BackupAndRestore` restore all end) and, when the
variable is held by the servers, goes to them:

- a model variable (trainable or not, a table held remotely included): its
  new value is sent as an assignment (`VariableRouter.send_gradients`'s
  `assign`, the `assignments` of a `Push`), one push per server for all the
  writes of one call;
- an optimizer slot of such a variable (`optimizer.set_weights`,
  `load_own_variables`, `load_weights`, or `slot.assign`): the servers'
  optimizer state of that variable is read, the written slots replaced and
  the whole state loaded back (`LoadOptimizerState` takes every slot). The
  optimizer's `iterations` travels with the slots when one of those calls
  wrote it; a lone `optimizer.iterations.assign` stays local, because each
  process counts its own steps (the coordinator counts its closures', each
  server the updates it applied, see docs/parameter_server.md).

The writes of one named call (`set_weights`, `load_weights`, ...) are one
unit: they change the local copies at once (as in plain Keras), and are sent
when the call returns. If sending fails, the local copies are put back as
they were and the error (a typed `kdist.errors` one) says which variables
and which call; nothing else is retried or hidden. A lone `assign` is a unit
of one. `assign_add`/`assign_sub` first read the servers' current value, so
they add to what other workers trained, not to a stale copy.

Writes that stay local, by design: kdist's own refreshes (pulls copy into the
tensor directly and never pass here; reading the optimizer state back for a
save, and counting an update that was pushed, run inside `internal()`), and
inside a step that kdist runs, writes of non-trainable state (BatchNorm
statistics, which the step's own push carries) and of the optimizer's
variables (its working state: the servers apply the update).

Thread-safety: the registries below are replaced, never mutated, so any
thread may write variables; a unit belongs to the thread that opened it.
"""

import contextlib
import threading
import weakref

import keras
import torch

from kdist.distribute.parameter_server.route import to_numpy
from kdist.errors import ParameterServerError, UnsupportedError
from kdist.keras import _compat
from kdist.keras.parameter_server.optimizer_config import server_optimizer_config
from kdist.keras.parameter_server import remote_tables, worker_steps

_local = threading.local()  # .internal: depth of internal(); .unit: the open _Unit or None
_lock = threading.Lock()
_routers = ()  # weak references to every VariableRouter a model of this process uses
_optimizers = ()  # weak references to every optimizer connected to parameter servers
_installed = False


def install():
    """Hooks every torch Keras variable write (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        _compat.install_variable_write_hook(_on_write, _call_scope)
        remote_tables.set_writer(write_table)
        _installed = True


def watch(strategy, optimizer=None):
    """Makes writes of `strategy`'s variables (and `optimizer`'s slots, if it pushes) reach the servers."""
    global _routers, _optimizers
    # Hooked on the first variable a parameter-server strategy holds: a process without
    # one never sends its writes (a MirroredStrategy step's) through the hook.
    install()
    router = strategy.extended.variable_router
    with _lock:
        if not any(ref() is router for ref in _routers):
            _routers = tuple(ref for ref in _routers if ref() is not None) + (weakref.ref(router),)
        if (isinstance(optimizer, keras.optimizers.Optimizer) and worker_steps.pushes(optimizer)
                and not any(ref() is optimizer for ref in _optimizers)):
            _optimizers = tuple(ref for ref in _optimizers if ref() is not None) + (weakref.ref(optimizer),)


@contextlib.contextmanager
def internal():
    """kdist's own writes of local copies in this thread (refreshes, step counts): not sent."""
    _local.internal = getattr(_local, "internal", 0) + 1
    try:
        yield
    finally:
        _local.internal -= 1


@contextlib.contextmanager
def writing(call):
    """Makes the writes in the block one unit, sent when it ends (see module doc); `call` names it in errors."""
    if getattr(_local, "unit", None) is not None:
        yield  # joins the enclosing unit
        return
    unit = _local.unit = _Unit(call)
    try:
        yield
    except BaseException:
        _local.unit = None
        unit.send()  # what Keras wrote before it raised stays written, on the servers too
        raise
    _local.unit = None
    unit.send()


def write_table(table, value):
    """Sends a whole new value of a table the servers hold only (`RemoteTable.write`: an in-place torch op)."""
    with writing("an in-place write of its tensor"):
        _local.unit.tables[id(table.route)] = (table.router, table.route, table.variable, value)


# ----- the hook ----------------------------------------------------------------------
def _on_write(variable, value, write_locally):
    if getattr(_local, "internal", 0) or not (_routers or _optimizers):
        return write_locally(variable, value)
    target = _target_of(variable)
    if target is None:
        return write_locally(variable, value)
    kind = target[0]
    in_step = worker_steps.current_step() is not None
    if in_step and (kind != "model" or not target[2].trainable):
        # Step state: its push sends non-trainable values; the servers apply the optimizer.
        return write_locally(variable, value)
    unit = getattr(_local, "unit", None)
    if kind == "iterations" and unit is None:
        return write_locally(variable, value)  # each process counts its own steps (module doc)
    if unit is None:
        with writing("variable.assign()"):
            return _local.unit.record(target, variable, value, write_locally)
    return unit.record(target, variable, value, write_locally)


def _call_scope(obj, call):
    if getattr(_local, "internal", 0) or not (_routers or _optimizers):
        return None
    if call in ("variable.assign_add()", "variable.assign_sub()"):
        target = _target_of(obj)
        if target is None:
            return None
        if target[0] == "model" and getattr(_local, "unit", None) is None and worker_steps.current_step() is None:
            _, router, route = target
            # Adds to the servers' value, not to a copy other workers have moved past.
            router.pull([route], include_row_sparse=True)
    return writing(call)


def _target_of(variable):
    """`("model", router, route)`, `("slot", optimizer, reference id, server slot name)`,
    `("iterations", optimizer)`, `("learning_rate", optimizer)`, or None for a variable no server holds."""
    for ref in _routers:
        router = ref()
        route = None if router is None else router.route(variable)
        if route is not None:
            return ("model", router, route)
    for ref in _optimizers:
        optimizer = ref()
        if optimizer is None:
            continue
        key = _slot_keys(optimizer).get(id(variable))
        if key is not None:
            return ("slot", optimizer) + key
        try:
            iterations = _compat.iterations_variable(optimizer)
            learning_rate = _compat.learning_rate_variable(optimizer)
        except AttributeError:
            # Watched from its first variable on, so another thread's write can come
            # while its __init__ has not yet set these: `variable` is neither.
            continue
        if variable is iterations:
            return ("iterations", optimizer)
        if variable is learning_rate:
            return ("learning_rate", optimizer)
    return None


def _slot_keys(optimizer):
    """`{id(slot): (id(reference variable), server slot name)}`, rebuilt when slots were added."""
    slots = optimizer._kdist_ps_slots
    cached = getattr(optimizer, "_kdist_ps_slot_keys", None)
    if cached is None or cached[0] != len(slots):
        cached = (len(slots), {id(slot): key for key, slot in slots.items()})
        object.__setattr__(optimizer, "_kdist_ps_slot_keys", cached)
    return cached[1]


class _Unit:
    """The writes of one call: applied locally at once, sent to the servers by `send`."""

    def __init__(self, call):
        self.call = call
        self.routes = {}  # id(route) -> (router, route, variable): ordinary variables
        self.tables = {}  # id(route) -> (variable, route, value): tables the servers hold only
        self.slots = {}  # optimizer -> {"keys": set of (reference id, slot name), "iterations": bool}
        self.previous = {}  # id(variable) -> (variable, value before the unit, write_locally)

    def record(self, target, variable, value, write_locally):
        kind = target[0]
        if kind == "model" and target[2].remote:
            self.tables[id(target[2])] = target[1:] + (variable, value)
            return None
        if id(variable) not in self.previous:
            stand_in = remote_tables.of(variable) is not None  # a table's slot held by the servers
            before = None if stand_in else variable.value.detach().clone()
            self.previous[id(variable)] = (variable, before, write_locally)
        unchanged = kind == "learning_rate" and bool(torch.equal(variable.value.detach(), value.to(variable.value)))
        write_locally(variable, value)
        if kind == "model":
            self.routes[id(target[2])] = target[1:] + (variable,)
        elif not unchanged:
            written = self.slots.setdefault(target[1], {"keys": set(), "iterations": False, "learning_rate": False})
            if kind == "slot":
                written["keys"].add(target[2:])
            else:
                written[kind] = True
        return None

    def send(self):
        if not (self.routes or self.tables or self.slots):
            return
        try:
            with internal():
                self._send_variables()
                for optimizer, written in self.slots.items():
                    _send_optimizer_state(optimizer, written)
        except Exception as error:
            self._undo()
            names = sorted({variable.path for variable, *_ in self.previous.values()}
                           | {variable.path for _, _, variable, _ in self.tables.values()})
            error.add_note(
                f"kdist could not write {names} to the parameter servers during {self.call}. "
                "The local values were left as they were before the call; the servers keep "
                "their own (the next read fetches them). Retry the call once the servers answer."
            )
            raise

    def _send_variables(self):
        by_router = {}
        for router, route, variable in self.routes.values():
            by_router.setdefault(id(router), (router, []))[1].append((route, variable.value))
        for router, route, _, value in self.tables.values():
            by_router.setdefault(id(router), (router, []))[1].append((route, value))
        for router, items in by_router.values():
            # One push per server: the values arrive together (`PushHeader.assignments`).
            results = router.send_gradients((), (), assign=items)
            versions = {}
            for result in results:
                versions.update(result.versions)
            for route, _ in items:
                if route.remote:
                    route.versions[:] = [-1] * len(route.versions)
                    continue
                # The local copy is the servers' value at these versions (unknown: read it again).
                route.versions[:] = [versions.get(key, -1) for key in route.keys]
                route.take_snapshot()

    def _undo(self):
        for variable, before, write_locally in self.previous.values():
            if before is not None:
                with internal():
                    write_locally(variable, before)
        for router, route, _ in self.routes.values():
            route.versions[:] = [-1] * len(route.versions)


def _send_optimizer_state(optimizer, written):
    """Replaces the servers' optimizer state of the variables whose slots (or iterations) were written."""
    session = optimizer._kdist_ps_session
    router = session.router
    if written["learning_rate"]:
        _send_learning_rate(optimizer, session)
    if not (written["keys"] or written["iterations"]):
        return
    by_id = {id(route.variable): route for route in router.all_routes() if route.trainable}
    reference_ids = {reference for reference, _ in written["keys"]}
    if written["iterations"]:
        reference_ids |= {id(route.variable) for route in session.routes() if route.trainable}
        reference_ids |= set(optimizer._kdist_ps_slot_names)
    routes = [by_id[reference] for reference in sorted(reference_ids, key=_creation_order(by_id)) if reference in by_id]
    if not routes:
        return
    session.configure(optimizer, routes)
    states = router.optimizer_state(routes)
    iterations = int(to_numpy(optimizer.iterations.value))
    loaded = []
    for route, (server_iterations, slots) in zip(routes, states):
        slots = dict(slots)
        for reference, name in written["keys"]:
            if reference == id(route.variable):
                slots[name] = to_numpy(optimizer._kdist_ps_slots[(reference, name)].value)
        loaded.append((iterations if written["iterations"] else server_iterations, slots))
    router.load_optimizer_state(routes, loaded)


def _send_learning_rate(optimizer, session):
    """A new learning rate reaches servers that have no optimizer yet; servers that have one refuse it.

    Their optimizer was rebuilt from the config once (`configure_optimizer`);
    a different learning rate is another config, which they refuse rather
    than let workers disagree.

    Raises:
        kdist.errors.UnsupportedError: a server already applies another learning rate.
    """
    routes = [route for route in session.routes() if route.trainable]
    if not routes:
        return
    try:
        session.router.configure_optimizer(server_optimizer_config(optimizer), routes)
    except ParameterServerError as error:
        if error.code_name != "FAILED_PRECONDITION":
            raise
        raise UnsupportedError(
            "The parameter servers already apply this optimizer with the learning rate it had "
            "when training started, and cannot take a new one: their optimizer is rebuilt from "
            f"its config once. Received: a new value of {optimizer.name!r}'s learning rate. Give "
            "the optimizer a keras.optimizers.schedules.LearningRateSchedule instead (the servers "
            "compute it from their step count), or set the learning rate before the first step."
        ) from error


def _creation_order(by_id):
    order = {reference: position for position, reference in enumerate(by_id)}
    return lambda reference: order.get(reference, len(order))

