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
"""

import types

_registry = {}


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

    def route_call(self, method, model, name, args, kwargs):
        """Runs `model.<name>(*args, **kwargs)` inside the strategy's scope; `method` is the class's function."""
        return method(model, *args, **kwargs)

    def on_variable_created(self, variable):
        """Called for every Keras variable initialised inside the strategy's scope."""

    def on_variable_initializing(self, variable, initializer):
        """Called before Keras computes a variable's first value in the scope: a `torch.nn.Parameter`, or None."""
        return None


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
