"""The Keras adapter of synchronous strategies (default, `MirroredStrategy`, `MultiWorkerMirroredStrategy`).

- `optimizer_step`: the optimizer's `apply` records or merges gradients during
  replica steps (`kdist.keras.replica.gradient_merge`) and applies them otherwise.
- With more than one replica, `make_train_function`/`make_test_function`/
  `make_predict_function` return the replica engine's step functions.
- Across processes (`MultiWorkerMirroredStrategy`): `fit`/`evaluate`/
  `predict` agree on their inputs and callbacks (`kdist.keras.replica.multi_worker`),
  `save`/`save_weights` are collectives the chief writes, and metrics are not
  reduced a second time by Keras.
- With `shard_optimizer_state`, the final `apply` updates this rank's share
  of the optimizer state (`kdist.keras.replica.sharded_optimizer`).
- A step whose split would hand a torch `BatchNorm` (inside a
  `TorchModuleWrapper`) one sample on some replica is refused before it runs
  (`BatchNormShardGuard`): torch cannot take batch statistics of one value.
"""

import inspect
import warnings

import keras
import torch

from kdist import faults
from kdist.distribute.batching import batch_size_of, split_sizes
from kdist.distribute.strategy import Strategy
from kdist.errors import InvalidArgumentError
from kdist.keras import _compat, adapters
from kdist.keras._compat.layers import torch_batchnorm_modules
from kdist.keras.replica import gradient_accumulation, gradient_merge, multi_worker, per_rank_input, sharded_optimizer
from kdist.keras.replica.engine import ReplicaEngine, check_steps_per_execution


class ReplicaAdapter(adapters.KerasAdapter):
    """`KerasAdapter` of the replica engine, in one process or several."""

    def attach(self, model):
        strategy = self.strategy
        adapters.attach_optimizer(getattr(model, "optimizer", None), strategy)
        if getattr(strategy.extended, "shard_optimizer_state", False):
            sharded_optimizer.install(getattr(model, "optimizer", None), strategy)
        if strategy.extended.collectives is not None and not faults.ACTIVE.upstream_metrics_result:
            # Metrics are already combined across processes by kdist (see _compat).
            adapters.override(model, "get_metrics_result", lambda self: _compat.local_metrics_result(self))
        if strategy.num_replicas_in_sync > 1:
            engine = ReplicaEngine(model, strategy)
            for kind in ("train", "test", "predict"):
                adapters.override(model, f"make_{kind}_function", make_function(kind, engine))
                # Drop step functions Keras may have built before the model was attached.
                object.__setattr__(model, f"{kind}_function", None)

    def optimizer_step(self, optimizer, gradients, variables):
        # Replicas record (the engine's steps) or merge (strategy.run, merge mode) first.
        if gradient_merge.route(optimizer, gradients, variables):
            return None
        return self.apply_gradients(optimizer, gradients, variables)

    def check_compile(self, compile_method, model, args, kwargs):
        if getattr(self.strategy.extended, "shard_optimizer_state", False):
            bound = inspect.signature(compile_method).bind(model, *args, **kwargs)
            bound.apply_defaults()
            sharded_optimizer.check(keras.optimizers.get(bound.arguments["optimizer"]))

    def route_call(self, method, model, name, args, kwargs):
        strategy = self.strategy
        collectives = strategy.extended.collectives
        if collectives is None:
            if name in ("fit", "evaluate", "predict"):
                args, kwargs = per_rank_input.unwrap_one_process(args, kwargs)
            return method(model, *args, **kwargs)
        if name in ("save", "save_weights"):
            filepath, *rest = args if args else (kwargs.pop("filepath"),)
            return multi_worker.collective_save(strategy, method, model, filepath, rest, kwargs)
        if name in ("fit", "evaluate", "predict"):
            share = not faults.ACTIVE.unshared_random_state
            args, kwargs, inputs = multi_worker.adjust_call(method, model, args, kwargs, strategy, share)
            with multi_worker.input_synchronisation(collectives, inputs):
                result = method(model, *args, **kwargs)
            if name == "fit":
                # Accumulated gradients still pending on each rank join the optimizer's.
                gradient_accumulation.flush(model)
            return result
        return method(model, *args, **kwargs)


def make_function(kind, engine):
    """`model.make_<kind>_function` returning the replica engine's step function.

    The step is the engine's own method, or, while the model holds torch
    BatchNorm modules (`BatchNormShardGuard`), that method behind the guard.
    """
    engine_step = getattr(engine, f"{kind}_function")
    attribute = f"{kind}_function"
    guard = BatchNormShardGuard(engine, kind)

    def guarded_step(data):
        guard.check(data)
        return engine_step(data)

    def make_function(self, force=False):
        # Keras calls this at the start of every fit/evaluate/predict: the one
        # point where layers or trainability may have changed since the last step.
        engine.forget_layout()
        guard.refresh()
        step = guarded_step if guard.modules else engine_step
        current = getattr(self, attribute)
        # A wrapper of torch BatchNorm may have been added since the unguarded step was made.
        if current is not None and not force and not (current == engine_step and step is guarded_step):
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


class BatchNormShardGuard:
    """Refuses, before a step runs, a split that gives a torch BatchNorm one sample on a replica.

    A `torch.nn` BatchNorm module inside a `TorchModuleWrapper` normalises each
    replica's shard with that shard's own statistics; on a shard of one sample
    torch raises ("Expected more than 1 value per channel") in the middle of
    the step, after earlier replicas already ran (their updates of the
    module's buffers live in per-replica copies, see `torch_buffers`, and are
    dropped). Plain Keras on the whole batch trains. So kdist checks the
    split first and raises `InvalidArgumentError` with nothing changed.

    Which modules count: in a training step every such module (the wrapper
    puts it in training mode); in `evaluate`/`predict` only those without
    running statistics (`track_running_stats=False`), which use batch
    statistics there too. The modules are looked up again at every
    `make_*_function` call (the start of every `fit`/`evaluate`/`predict`).

    Args:
        engine: the model's `ReplicaEngine`.
        kind: `"train"`, `"test"` or `"predict"`.
    """

    def __init__(self, engine, kind):
        self.engine = engine
        self.kind = kind
        self.modules = []

    def refresh(self):
        """Finds the BatchNorm modules the model's wrappers hold now."""
        found = torch_batchnorm_modules(self.engine.model)
        if self.kind != "train":
            found = [(n, m) for n, m in found if m.running_mean is None and m.running_var is None]
        self.modules = found

    def check(self, data):
        """Raises `InvalidArgumentError` when a batch of `data` (a list of batches) splits to a 1-sample shard.

        With input split per rank in a multi-worker job, each rank checks its
        own batch, and one small all-reduce makes every rank raise when any
        rank's batch splits badly (a rank raising alone would leave the others
        waiting in the step's collectives until they time out).
        """
        if not self.modules:
            return
        # Input split per rank: this rank's batch is split over its own replicas only.
        whole = per_rank_input.uses_batch_whole()
        replicas = self.engine.num_replicas if whole else self.engine.strategy.num_replicas_in_sync
        bad = None
        for batch in data:
            total = per_rank_input.rank_batch_size(batch) if whole else batch_size_of(batch)
            if 1 in split_sizes(total, replicas):
                bad = total
                break
        if whole and getattr(self.engine, "processes", None) is not None:
            self._agree(bad, replicas)
        elif bad is not None:
            raise InvalidArgumentError(self._message(bad, replicas, whole))

    def _agree(self, bad, replicas):
        collectives = self.engine.strategy.extended.collectives
        # Each rank's bad batch size + 1 (0: its batch splits well).
        flags = torch.zeros(collectives.world_size, dtype=torch.int64)
        flags[collectives.rank] = 0 if bad is None else bad + 1
        (flags,) = collectives.all_reduce_sum([flags], name="batchnorm_split")
        failing = [(rank, int(flag) - 1) for rank, flag in enumerate(flags.tolist()) if flag]
        if failing:
            rank, total = failing[0]
            owner = "this rank's" if rank == collectives.rank else f"rank {rank}'s"
            raise InvalidArgumentError(self._message(total, replicas, True, owner))

    def _message(self, total, replicas, per_rank=False, owner="this rank's"):
        name, module = self.modules[0]
        split = "+".join(str(n) for n in split_sizes(total, replicas))
        more = f" (and {len(self.modules) - 1} more)" if len(self.modules) > 1 else ""
        where = "a training step" if self.kind == "train" else f"a {self.kind} step"
        batch = f"{owner} batch (input split per rank)" if per_rank else "the global batch"
        return (
            f"batch_size: {batch} of {total} samples is split {split} over {replicas} "
            f"replicas in {where}, so a replica gets 1 sample, and the torch module '{name}' "
            f"({type(module).__name__} inside a TorchModuleWrapper){more} cannot normalise one "
            "sample: torch refuses batch statistics of one value per channel. Nothing was "
            f"changed; the step did not run. Received: a batch of {total} for {replicas} "
            "replicas. Expected: at least 2 samples on every replica that gets any. Fix: "
            f"a batch_size of at least {2 * replicas} (2 per replica) whose last partial batch "
            f"is also at least {2 * replicas} samples or absent (a sample count that is a "
            "multiple of batch_size, or drop_remainder=True on a dataset), or "
            "train with one replica."
        )


def install():
    """Registers `ReplicaAdapter` for every strategy. Idempotent."""
    adapters.register(Strategy, ReplicaAdapter)
