"""The Keras adapter of synchronous strategies (default, `MirroredStrategy`, `MultiWorkerMirroredStrategy`).

- The optimizer's `apply` records or merges gradients during replica steps
  (`kdist.keras.replica.gradient_merge`, which also routes every optimizer class).
- With more than one replica, `make_train_function`/`make_test_function`/
  `make_predict_function` return the replica engine's step functions.
- Across processes (`MultiWorkerMirroredStrategy`): `fit`/`evaluate`/
  `predict` agree on their inputs and callbacks (`kdist.keras.replica.multi_worker`),
  `save`/`save_weights` are collectives the chief writes, and metrics are not
  reduced a second time by Keras.
"""

import warnings

from kdist import faults
from kdist.distribute.strategy import Strategy
from kdist.keras import _compat, adapters
from kdist.keras.replica import gradient_accumulation, gradient_merge, multi_worker
from kdist.keras.replica.engine import ReplicaEngine, check_steps_per_execution


class ReplicaAdapter(adapters.KerasAdapter):
    """`KerasAdapter` of the replica engine, in one process or several."""

    def attach(self, model):
        strategy = self.strategy
        gradient_merge.wrap(getattr(model, "optimizer", None))
        if strategy.extended.collectives is not None and not faults.ACTIVE.upstream_metrics_result:
            # Metrics are already combined across processes by kdist (see _compat).
            adapters.override(model, "get_metrics_result", lambda self: _compat.local_metrics_result(self))
        if strategy.num_replicas_in_sync > 1:
            engine = ReplicaEngine(model, strategy)
            for kind in ("train", "test", "predict"):
                adapters.override(model, f"make_{kind}_function", make_function(kind, engine))
                # Drop step functions Keras may have built before the model was attached.
                object.__setattr__(model, f"{kind}_function", None)

    def route_call(self, method, model, name, args, kwargs):
        strategy = self.strategy
        collectives = strategy.extended.collectives
        if collectives is None:
            return method(model, *args, **kwargs)
        if name in ("save", "save_weights"):
            filepath, *rest = args if args else (kwargs.pop("filepath"),)
            return multi_worker.collective_save(strategy, method, model, filepath, rest, kwargs)
        if name in ("fit", "evaluate", "predict"):
            share = not faults.ACTIVE.unshared_random_state
            args, kwargs = multi_worker.adjust_call(method, model, args, kwargs, strategy, share)
            with multi_worker.input_synchronisation(collectives):
                result = method(model, *args, **kwargs)
            if name == "fit":
                # Accumulated gradients still pending on each rank join the optimizer's.
                gradient_accumulation.flush(model)
            return result
        return method(model, *args, **kwargs)


def make_function(kind, engine):
    """`model.make_<kind>_function` returning the replica engine's step function."""
    step = getattr(engine, f"{kind}_function")
    attribute = f"{kind}_function"

    def make_function(self, force=False):
        # Keras calls this at the start of every fit/evaluate/predict: the one
        # point where layers or trainability may have changed since the last step.
        engine.forget_layout()
        current = getattr(self, attribute)
        if current is not None and not force:
            return current
        check_steps_per_execution(self)
        if self.jit_compile:
            warnings.warn(
                "jit_compile=True is turned off under MirroredStrategy with several "
                "replicas: torch.compile cannot trace the replica engine's scopes. The "
                "model trains eagerly.",
                stacklevel=2,
            )
            self.jit_compile = False
        object.__setattr__(self, attribute, step)
        return step

    return make_function


def install():
    """Registers `ReplicaAdapter` for every strategy and makes optimizers record replica gradients. Idempotent."""
    # Every optimizer's `apply` records or merges when replicas call it.
    gradient_merge.install()
    adapters.register(Strategy, ReplicaAdapter)
