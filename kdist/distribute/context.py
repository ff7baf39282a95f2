"""Which strategy is current, and whether code runs per replica or across replicas.

Glossary:
    replica: one copy of the model computing on one slice of the global batch.
    cross-replica context: code that sees every replica at once: inside
        `strategy.scope()`, or inside a `merge_call` function. Reductions such as
        `Strategy.reduce` are called here.
    replica context: code that runs once per replica: the function passed to
        `Strategy.run`, or a Keras `train_step` under `model.fit`.
        `get_replica_context()` returns the `ReplicaContext` for it.
    default strategy: the strategy in effect when no scope is active; one
        replica on the current device, ordinary single-device behaviour.

The stack is kdist's own and per thread, not Keras' global state:
`keras.backend.clear_session()` resets Keras' state and must not drop a scope.
"""

import threading

from kdist.distribute import nest
from kdist.distribute.values import DistributedValues, PerReplica
from kdist.errors import StrategyScopeError, UnsupportedError
from kdist.types import ReduceOp

_local = threading.local()

# The attribute a Keras model carries once it belongs to a strategy (set by the
# backend's model hooks; read by `strategy_of`).
_MODEL_STRATEGY_ATTRIBUTE = "_kdist_strategy"


def strategy_of(model):
    """The strategy `model` was created (or, on torch, compiled) in, or None."""
    return getattr(model, _MODEL_STRATEGY_ATTRIBUTE, None)


def bind_model(model, strategy):
    """Records that `model` belongs to `strategy` (without Keras' attribute tracking)."""
    object.__setattr__(model, _MODEL_STRATEGY_ATTRIBUTE, strategy)


class _Frame:
    __slots__ = ("strategy", "replica_context")

    def __init__(self, strategy, replica_context):
        self.strategy = strategy
        self.replica_context = replica_context


def _stack():
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _top():
    stack = _stack()
    if stack:
        return stack[-1]
    from kdist.distribute.default_strategy import default_strategy

    strategy = default_strategy()
    return _Frame(strategy, strategy.extended.default_replica_context)


def push(strategy, replica_context):
    """Makes `strategy` current in this thread (`replica_context=None`: cross-replica).

    Raises:
        kdist.errors.StrategyScopeError: another non-default strategy is current.
    """
    current = _top().strategy
    if current is not strategy and not current.extended.is_default:
        raise StrategyScopeError(
            "Mixing different strategies is not allowed: a scope of "
            f"{type(strategy).__name__} was entered while {type(current).__name__} "
            f"(id {id(current):#x}) is current. Exit the current strategy's scope "
            "first, or create every model and optimizer under one strategy."
        )
    _stack().append(_Frame(strategy, replica_context))


def pop(strategy):
    frame = _stack().pop()
    if frame.strategy is not strategy:
        raise StrategyScopeError(
            "Strategy scopes were exited out of order. Use `with strategy.scope():` "
            "blocks instead of calling __enter__/__exit__ by hand."
        )


def get_strategy():
    """Returns the current strategy: the innermost scope's, else the default strategy.

    Example:

    ```python
    with strategy.scope():
        assert kdist.get_strategy() is strategy
    ```
    """
    return _top().strategy


def has_strategy():
    """Returns True when a non-default strategy is current in this thread."""
    return not _top().strategy.extended.is_default


def in_cross_replica_context():
    """Returns True inside a strategy's scope but outside any replica function."""
    frame = _top()
    return frame.replica_context is None


def get_replica_context():
    """Returns the current `ReplicaContext`, or None in a cross-replica context.

    Outside any scope this is the default strategy's replica context, as in
    TensorFlow: code that knows nothing about strategies runs as one replica.
    """
    return _top().replica_context


def require_cross_replica(api):
    """Raises unless the caller is in a cross-replica context (not inside a replica function).

    Raises:
        kdist.errors.StrategyScopeError: naming `api` and `merge_call` as the way out.
    """
    if get_replica_context() is not None and has_strategy():
        raise StrategyScopeError(
            f"{api} must be called in a cross-replica context, but it was called "
            "from a replica function. Use kdist.get_replica_context().merge_call "
            "to reach the cross-replica context from a replica."
        )


def get_cross_replica_context():
    """Returns the current strategy in a cross-replica context, else None."""
    frame = _top()
    return frame.strategy if frame.replica_context is None else None


class ReplicaContext:
    """What code running on one replica can ask and do.

    Attributes:
        strategy: the strategy this replica belongs to.
        replica_id_in_sync_group: this replica's index, 0-based.
        num_replicas_in_sync: how many replicas run in lock-step.

    Example:

    ```python
    def step(x):
        ctx = kdist.get_replica_context()
        return ctx.all_reduce("sum", x * ctx.replica_id_in_sync_group)
    strategy.run(step, args=(1.0,))
    ```
    """

    def __init__(self, strategy, replica_id_in_sync_group, merge_handler=None):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._merge_handler = merge_handler

    @property
    def strategy(self):
        return self._strategy

    @property
    def replica_id_in_sync_group(self):
        # Replicas are numbered across every process of a multi-worker job.
        return self._strategy.extended.first_replica_id + self._replica_id

    @property
    def num_replicas_in_sync(self):
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self):
        """The devices this replica computes on (a one-element tuple)."""
        return (self._strategy.extended.worker_devices[self._replica_id],)

    def merge_call(self, merge_fn, args=(), kwargs=None):
        """Pauses every replica, runs `merge_fn` once across replicas, resumes.

        `merge_fn(strategy, *args, **kwargs)` runs in the cross-replica context;
        each argument arrives as a `PerReplica` of every replica's value (or the
        value itself where all replicas passed the same object). Its return
        value is handed back to each replica, unwrapped to that replica's
        component where it is distributed.

        Args:
            merge_fn: the function to run once.
            args: positional arguments; a value that is not a tuple is taken as
                the single positional argument, as in `merge_call(fn, v)`.
            kwargs: keyword arguments.

        Returns:
            `merge_fn`'s result as seen by this replica.

        Raises:
            kdist.errors.UnsupportedError: inside a Keras `train_step` run by
                `model.fit`, whose replicas run one after the other.
        """
        if not isinstance(args, tuple):
            args = (args,)
        kwargs = kwargs or {}
        if self._merge_handler is None:
            # One replica: nothing to wait for.
            push(self._strategy, None)
            try:
                return merge_fn(self._strategy, *args, **kwargs)
            finally:
                pop(self._strategy)
        return self._merge_handler(merge_fn, args, kwargs)

    def all_reduce(self, reduce_op, value):
        """Reduces `value` (a structure of tensors) across replicas; every replica gets the result."""
        reduce_op = ReduceOp.from_value(reduce_op)

        def merge_fn(strategy, per_replica):
            devices = strategy.extended.worker_devices

            def reduce_leaf(leaf):
                if not isinstance(leaf, DistributedValues):
                    # Every replica passed this same object (e.g. the constant 1);
                    # each replica still contributes it once.
                    leaf = PerReplica([leaf] * len(devices))
                return strategy.extended.reduce_to(reduce_op, leaf, devices)

            return nest.map_structure(reduce_leaf, per_replica)

        return self.merge_call(merge_fn, args=(value,))

    def all_gather(self, value, axis):
        """Concatenates `value` from every replica along `axis`; every replica gets the result."""

        def merge_fn(strategy, per_replica):
            devices = strategy.extended.worker_devices

            def gather(leaf):
                gathered = strategy.extended.gather_to(leaf, axis, devices[0])
                return strategy.extended.broadcast_to(gathered, devices)

            return nest.map_structure(gather, per_replica)

        return self.merge_call(merge_fn, args=(value,))

    def __repr__(self):
        return (
            f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def sequential_merge_handler(merge_fn, args, kwargs):
    """Merge handler for replicas that run one after another (the Keras engine's evaluate/predict)."""
    raise UnsupportedError(
        "merge_call, all_reduce and all_gather are not available inside a Keras "
        "test_step/predict_step run by model.evaluate/predict: kdist runs those "
        "replicas one after another and combines metrics after the step. They work "
        "inside train_step (fit) and in a custom loop with strategy.run(...)."
    )

