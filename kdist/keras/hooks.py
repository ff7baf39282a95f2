"""Connects Keras models to kdist strategies.

`install()` wraps `Trainer.__init__` and `Trainer.compile` once per process. A
model created or compiled inside a (non-default) strategy's scope is attached
to that strategy; attaching installs overrides *on that instance only*:

- `fit`, `evaluate`, `predict`, `*_on_batch`, `save`, `save_weights`,
  `load_weights` re-enter the strategy's scope (lazily built models create their
  variables there); a method the model's class does not have is left absent;
- then the strategy's own Keras adapter (`kdist.keras.adapters.adapter_for`)
  installs what the strategy changes (the replica engine's step functions,
  parameter-server pushes and pulls), routes each scoped call, and sees every
  variable created in the scope.

The model's class is never changed, so a saved `.keras` file loads in plain
Keras without kdist.
"""

import functools

from kdist import faults
from kdist.distribute import context
from kdist.errors import InvalidArgumentError, StrategyScopeError
from kdist.keras import _compat, adapters, resume_shuffle, step_resume, sync_batchnorm, tensorboard
from kdist.keras import tensorboard_redirect
from kdist.keras.parameter_server import adapter as parameter_server_adapter
from kdist.keras.replica import adapter as replica_adapter
from kdist.keras.replica import multi_worker

_SCOPED_METHODS = (
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
    "save",
    "save_weights",
    "load_weights",
)
_installed = False


def install():
    """Wraps `Trainer.__init__` and `Trainer.compile`. Idempotent."""
    global _installed
    if _installed:
        return
    # Each strategy's Keras adapter (the most specific registration wins), and
    # every optimizer's `apply` going to its owning adapter's `optimizer_step`.
    adapters.install_optimizer_step()
    replica_adapter.install()
    parameter_server_adapter.install()
    # BatchNormalization(synchronized=True) inside a kdist scope (torch only).
    sync_batchnorm.install()
    # keras.callbacks.TensorBoard without TensorFlow (kdist.keras.tensorboard).
    tensorboard.install()
    # A config serialized (an optimizer's, sent to parameter servers; a compile
    # config, sent to workers) imports no TensorFlow (kdist.keras._compat.serialization).
    _compat.serialize_without_importing_tensorflow()
    trainer = _compat.Trainer
    original_init = trainer.__init__
    original_compile = trainer.compile

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if context.has_strategy():
            attach(self, context.get_strategy())

    @functools.wraps(original_compile)
    def compile(self, *args, **kwargs):
        strategy = _owning_strategy(self)
        if strategy is None:
            return original_compile(self, *args, **kwargs)
        # A strategy refuses what it cannot train before Keras changes the model.
        adapters.adapter_for(strategy).check_compile(original_compile, self, args, kwargs)
        with strategy.scope():
            result = original_compile(self, *args, **kwargs)
        attach(self, strategy)
        return result

    def epoch_iterable(epoch_iterator, make_iterable):
        # No-ops unless a kdist model's fit (or a multi-worker call) runs in this thread.
        resume_shuffle.align(epoch_iterator)
        step_resume.watch(epoch_iterator)
        return multi_worker.synchronised_iterable(epoch_iterator, make_iterable())

    def on_variable_created(variable):
        # The one point every variable passes through, whoever creates it.
        if context.has_strategy():
            adapters.adapter_for(context.get_strategy()).on_variable_created(variable)

    def on_variable_initializing(variable, initializer):
        # Before Keras computes a first value: a strategy may supply it (a table held elsewhere).
        if context.has_strategy():
            return adapters.adapter_for(context.get_strategy()).on_variable_initializing(variable, initializer)
        return None

    trainer.__init__ = __init__
    trainer.compile = compile
    for name in ("fit", "evaluate", "predict"):
        setattr(_compat.TorchTrainer, name, _refusing_unattached(getattr(_compat.TorchTrainer, name)))
    _compat.install_variable_hook(on_variable_created)
    _compat.install_variable_initializer_hook(on_variable_initializing)
    _compat.install_epoch_iterator_hook(epoch_iterable)
    _installed = True


strategy_of = context.strategy_of


def _refusing_unattached(method):
    """`Trainer.fit`/`evaluate`/`predict`, refused for a model no strategy owns inside a strategy's scope.

    As tf.distribute refuses variables created outside the scope: such a model
    would silently run on one device.
    """

    @functools.wraps(method)
    def refusing(self, *args, **kwargs):
        if context.has_strategy() and strategy_of(self) is None:
            strategy = context.get_strategy()
            raise StrategyScopeError(
                f"model.{method.__name__}() was called inside the scope of {strategy!r}, but "
                f"model '{self.name}' was created and compiled outside every strategy's scope, "
                "so it would run on one device. Received: a model no strategy owns. Create "
                "(or load) and compile the model inside `with strategy.scope():`, or call "
                f"{method.__name__}() outside the scope to train it without the strategy."
            )
        return method(self, *args, **kwargs)

    return refusing


def _owning_strategy(model):
    owner = strategy_of(model)
    current = context.get_strategy() if context.has_strategy() else None
    if owner is not None and current is not None and current is not owner:
        raise StrategyScopeError(
            f"Model '{model.name}' was created under {owner!r} but is compiled inside the "
            f"scope of {current!r}. A model belongs to one strategy: compile it under "
            "the strategy it was created with, or rebuild it inside the new scope."
        )
    return owner or current


def attach(model, strategy):
    """Makes `model` train with `strategy` (see the module docstring)."""
    context.bind_model(model, strategy)
    if not getattr(model, "_kdist_attached", False):
        for name in _SCOPED_METHODS:
            # A `Trainer` mixed into a bare `Layer` (as Keras' own trainer tests do)
            # has no `save`/`save_weights`/`load_weights`: leave what the class
            # lacks absent, so `model.save` raises the AttributeError plain Keras does.
            if callable(getattr(type(model), name, None)):
                adapters.override(model, name, _scoped(model, name))
        object.__setattr__(model, "_kdist_attached", True)
    if not faults.ACTIVE.upstream_ddp_wrap:
        # kdist decides how gradients are combined, on every role and strategy.
        _compat.keep_out_of_upstream_ddp(model)
    adapters.adapter_for(strategy).attach(model)


def _scoped(model, name):
    method = getattr(type(model), name)

    def scoped(self, *args, **kwargs):
        strategy = strategy_of(self)
        if name == "fit":
            _check_fit_batch_size(strategy, args, kwargs)
        if context.has_strategy() and context.get_strategy() is not strategy:
            raise StrategyScopeError(
                f"model.{name}() was called inside the scope of {context.get_strategy()!r}, "
                f"but model '{self.name}' belongs to {strategy!r}."
            )
        if name != "fit":
            return call(self, strategy, args, kwargs)
        with resume_shuffle.fit_call(self), step_resume.fit_call(self, strategy, method, args, kwargs):
            return call(self, strategy, args, kwargs)

    def call(self, strategy, args, kwargs):
        # Keras TensorBoards built before kdist loaded become kdist's here, for every adapter.
        tensorboard_redirect.adopt_keras_callbacks(method, args, kwargs)
        with strategy.scope():
            return adapters.adapter_for(strategy).route_call(method, self, name, args, kwargs)

    functools.update_wrapper(scoped, method)
    return scoped


def _check_fit_batch_size(strategy, args, kwargs):
    batch_size = kwargs.get("batch_size", args[2] if len(args) > 2 else None)
    num_replicas = strategy.num_replicas_in_sync
    if batch_size is not None and batch_size < num_replicas:
        # Every full step would leave replicas idle: almost always a per-replica
        # batch size passed where kdist expects the global one.
        raise InvalidArgumentError(
            f"batch_size is the global batch, split across {num_replicas} replicas, so it "
            f"must be at least {num_replicas}. Received: batch_size={batch_size}. Pass "
            f"batch_size=per_replica_batch * strategy.num_replicas_in_sync."
        )
