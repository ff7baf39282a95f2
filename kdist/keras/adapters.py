"""Each strategy brings its own Keras adapter: what a model attached to it does differently.

`kdist.keras.hooks` is the same for every strategy: it notices models created
or compiled in a scope, re-enters the scope around `fit` and friends, and sees
every variable being born. What happens next belongs to the strategy, so hooks
asks `adapter_for(strategy)` instead of guessing what the strategy is:

- `kdist.keras.replica.adapter.ReplicaAdapter`, registered for every
  `Strategy` (the default one, `MirroredStrategy`,
  `MultiWorkerMirroredStrategy`): the replica engine and, across processes,
  collective saves and agreeing inputs;
- `kdist.keras.parameter_server.adapter.ParameterServerAdapter`, registered for
  `ParameterServerStrategy`: pushes and pulls on a worker, closures on the
  coordinator.

The lookup walks the strategy's class MRO, so the most specific registration
wins and a subclass inherits its base's adapter (as Lightning's registry of
strategies does).

**The optimizer step.** `optimizer.apply` is intercepted once (`install_optimizer_step`:
on Keras' optimizer classes, and on the instance of a model's optimizer by
`attach_optimizer`, so an `apply` a subclass overrides is routed before its own
code runs). Every call goes to `KerasAdapter.optimizer_step` of the adapter that
owns the optimizer: the strategy of the model it was attached to, else the
current strategy. An adapter decides there what a call means (record a
replica's gradients, merge replicas, apply); whatever finally updates
variables (the replica engine, merge mode, a custom loop's merge, a
parameter-server push) goes through `apply_update`, which calls the owner's
`KerasAdapter.apply_gradients`. That one method is where an update is made:
plain Keras `apply` here, a push to the servers for parameter servers. Sharded
optimizer state replaces what the final `apply` runs (`apply_through`).
"""

import contextlib
import functools
import threading
import types

import keras

from kdist.distribute import context

_registry = {}
_thread = threading.local()
# The strategy whose adapter owns an optimizer (set by `attach_optimizer`).
_OWNER = "_kdist_optimizer_owner"
_optimizer_step_installed = False


class KerasAdapter:
    """How models attached to one strategy train. Subclasses override what differs.

    Stateless apart from the strategy; a new one is made per lookup, so it is
    as thread-safe as the strategy it wraps.

    Args:
        strategy: the `kdist.distribute.Strategy` the models belong to.
    """

    def __init__(self, strategy):
        self.strategy = strategy

    def attach(self, model):
        """Installs the strategy's overrides on `model` (called at every attach; must be idempotent)."""

    def check_compile(self, compile_method, model, args, kwargs):
        """Raises, before Keras' `compile(*args, **kwargs)` runs, for what the strategy cannot train."""

    def route_call(self, method, model, name, args, kwargs):
        """Runs `model.<name>(*args, **kwargs)` inside the strategy's scope; `method` is the class's function."""
        return method(model, *args, **kwargs)

    def on_variable_created(self, variable):
        """Called for every Keras variable initialised inside the strategy's scope."""

    def on_variable_initializing(self, variable, initializer):
        """Called before Keras computes a variable's first value in the scope: a `torch.nn.Parameter`, or None."""
        return None

    def optimizer_step(self, optimizer, gradients, variables):
        """What `optimizer.apply(gradients, variables)` does for an optimizer this adapter owns.

        Args:
            optimizer: the Keras optimizer whose `apply` was called.
            gradients: the gradients passed to it.
            variables: the variables passed to it (None: the optimizer's own).
        """
        return self.apply_gradients(optimizer, gradients, variables)

    def apply_gradients(self, optimizer, gradients, variables):
        """Updates `variables` with final gradients: Keras' own `apply`, not routed again."""
        with _unrouted():
            return optimizer.apply(gradients, variables)


def adapter_of(optimizer):
    """The adapter that owns `optimizer`: its attached strategy's, else the current strategy's."""
    strategy = getattr(optimizer, _OWNER, None)
    return adapter_for(strategy if strategy is not None else context.get_strategy())


def apply_update(optimizer, gradients, variables):
    """Applies final (combined) gradients the way `optimizer`'s owner does: the one way to the real `apply`."""
    return adapter_of(optimizer).apply_gradients(optimizer, gradients, variables)


@contextlib.contextmanager
def _unrouted():
    """While active (in this thread), `apply` runs Keras' own code: the adapter already decided."""
    previous = getattr(_thread, "unrouted", False)
    _thread.unrouted = True
    try:
        yield
    finally:
        _thread.unrouted = previous


def unrouted():
    """While active (in this thread), `apply` of any optimizer is Keras' own (e.g. a slice optimizer's)."""
    return _unrouted()


def _intercepted(optimizer, original, grads, trainable_variables=None):
    # Owned by no strategy and called outside any: Keras' own `apply`, with no
    # lookup (a parameter server applies every push this way).
    if getattr(_thread, "unrouted", False) or (
            getattr(optimizer, _OWNER, None) is None and not context.has_strategy()):
        return original(grads, trainable_variables)
    return adapter_of(optimizer).optimizer_step(optimizer, grads, trainable_variables)


def attach_optimizer(optimizer, strategy):
    """Makes `strategy`'s adapter own `optimizer`, routing `apply` on the instance first. Idempotent.

    The latest attach wins: an optimizer compiled again under another strategy follows it.
    """
    if optimizer is None:
        return
    object.__setattr__(optimizer, _OWNER, strategy)
    if getattr(optimizer, "_kdist_routed_instance", False):
        return
    original = optimizer.apply
    object.__setattr__(optimizer, "apply", functools.partial(_intercepted, optimizer, original))
    object.__setattr__(optimizer, "_kdist_routed_instance", True)


def apply_through(optimizer, function):
    """Makes `function(grads, trainable_variables)` what `optimizer.apply` runs once routed, instead of Keras' own.

    Calls are still routed to the owner's `optimizer_step` first (replicas
    record, merge mode merges); the adapter's final, unrouted `apply` then
    reaches `function`. Used by optimizer-state sharding.
    """
    object.__setattr__(optimizer, "apply", functools.partial(_intercepted, optimizer, function))
    object.__setattr__(optimizer, "_kdist_routed_instance", True)


def install_optimizer_step():
    """Routes `apply` of every Keras optimizer class to its owner's `optimizer_step`. Idempotent.

    `keras.optimizers.Optimizer` is routed, and so is every subclass that
    defines its own `apply` (`LossScaleOptimizer`, `MultiOptimizer`, a user's),
    those that exist now and those defined later: the outermost `apply` is the
    step, so a subclass's own code (`MultiOptimizer` splitting the gradients
    and counting its iterations) runs once per update, not once per replica.
    """
    global _optimizer_step_installed
    if _optimizer_step_installed:
        return
    base = keras.optimizers.Optimizer
    _route_class(base)
    pending = list(base.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "apply" in cls.__dict__:
            _route_class(cls)
    own_hook = base.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        # What `base` had: its own hook, or (as `super().__init_subclass__` in its body) its parents'.
        if own_hook is not None:
            own_hook.__get__(None, cls)(**kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        if "apply" in cls.__dict__:
            _route_class(cls)

    base.__init_subclass__ = classmethod(__init_subclass__)
    _optimizer_step_installed = True


def _route_class(cls):
    if cls.__dict__.get("_kdist_routed_apply", False):
        return
    original_apply = cls.apply

    @functools.wraps(original_apply)
    def apply(self, grads, trainable_variables=None):
        return _intercepted(self, functools.partial(original_apply, self), grads, trainable_variables)

    cls.apply = apply
    cls._kdist_routed_apply = True


def register(strategy_class, adapter_class):
    """Makes `adapter_for` answer `adapter_class` for `strategy_class` and its subclasses.

    Args:
        strategy_class: a `kdist.distribute.Strategy` subclass.
        adapter_class: a `KerasAdapter` subclass, made with the strategy.
    """
    _registry[strategy_class] = adapter_class


def adapter_for(strategy):
    """The `KerasAdapter` for `strategy`: the registration nearest in its class's MRO.

    A strategy class nobody registered gets the plain `KerasAdapter` (Keras
    runs unchanged inside its scope).
    """
    for cls in type(strategy).__mro__:
        adapter_class = _registry.get(cls)
        if adapter_class is not None:
            return adapter_class(strategy)
    return KerasAdapter(strategy)


def override(model, name, function):
    """Binds `function` as `model.<name>` on this instance only (the class stays Keras')."""
    object.__setattr__(model, name, types.MethodType(function, model))
