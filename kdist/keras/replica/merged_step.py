"""The replica engine's merge mode: replicas that stop together at every `optimizer.apply`.

A `train_step` that applies gradients more than once (a GAN's discriminator,
then its generator) must compute the second gradients with the first update
already applied, as one device would. Here every replica runs its
`train_step` in its own thread (one thread at a time, see
`kdist.distribute.replica_runner`); each `apply` becomes a `merge_call`: when
every replica has reached it, the gradients are combined with the engine's
weights, applied once to the canonical variables, and the replicas go on
reading the updated values. `merge_call` and `all_reduce` inside the step
work here too.

The engine chooses this mode when a step applies twice. Thread hand-offs
cost a few tens of microseconds per replica and `apply`, which is why the
engine's default stays sequential.
"""

import functools
import math

import torch

from kdist.collectives.local import copy_to_device
from kdist.distribute import context, replica_runner
from kdist.keras import _compat, adapters, sync_batchnorm
from kdist.keras.replica import gradient_combine, gradient_merge, loss_denominators


def train_batch(engine, state, replicas, total):
    """One training step of `engine` in merge mode; returns the merged logs.

    Args:
        engine: the `ReplicaEngine`.
        state: its `StateVariables`.
        replicas: this process's `(replica id, shard, size)` that take part.
        total: the global batch size.
    """
    combiner = _MergedApply(engine, state, replicas, total)
    step_fn = engine.model.train_step

    def replica_step(replica_id, shard, size):
        prepare = engine.replica_on_enter(replica_id, state, size / total, training=True)

        def on_enter(scope):
            combiner.scopes[replica_id] = scope
            if prepare is not None:
                prepare(scope)

        # Synchronized BatchNormalization weighs this replica's statistics
        # gradients as the engine will weigh its parameter gradients.
        sync_batchnorm.annotate_replica(
            context.get_replica_context(),
            gradient_weight=functools.partial(_gradient_weight, size),
            counts_samples=size > 0,
        )
        loss_denominators.begin()
        try:
            with gradient_merge.combining(combiner):
                return engine.run_in_scope(replica_id, step_fn, shard, state, training=True, on_enter=on_enter)
        finally:
            loss_denominators.end()

    calls = [(replica_id, (replica_id, shard, size), {}) for replica_id, shard, size in replicas]
    parameters = [tensor for _, tensor in state.canonical_mapping]
    results = replica_runner.run_replicas(
        engine.strategy, replica_step, calls, switch=_SeparateGradients(parameters, len(calls))
    )
    scopes = [scope for scope, _ in results]
    gradient_combine.check_summed_loss_has_no_penalties(engine, state, scopes)
    engine.reconcile(state, scopes, combiner.weights)
    return engine.merge_logs([logs for _, logs in results], combiner.weights)


def _gradient_weight(size):
    """The weight the engine gives this replica's gradients, up to a common factor (read in backward)."""
    denominator = loss_denominators.peek()
    if denominator is None:
        return float(size)
    value = float(denominator)
    return float(size) if math.isnan(value) else value


class _SeparateGradients:
    """Gives each replica its own `.grad` on the canonical Parameters that replicas share.

    A replica may pause mid-backward (inside a synchronized BatchNormalization);
    the next replica's backward must not accumulate into its gradients.
    """

    def __init__(self, parameters, num_replicas):
        self._parameters = parameters
        self._grads = [[None] * len(parameters) for _ in range(num_replicas)]

    def enter(self, position):
        for parameter, grad in zip(self._parameters, self._grads[position]):
            parameter.grad = grad

    def leave(self, position):
        self._grads[position] = [parameter.grad for parameter in self._parameters]


class _MergedApply:
    """Combines and applies each merged `apply` call of one step (runs in the cross-replica context)."""

    def __init__(self, engine, state, replicas, total):
        self._engine = engine
        self._state = state
        self._replicas = replicas
        self._total = total
        self._num_calls = 0
        self.scopes = {}
        # The last call's weights, which the loss tracker follows (sample shares until a call).
        self.weights = gradient_combine.weights_for_call(engine, replicas, total, [None] * len(replicas))

    def __call__(self, optimizer, gradient_lists, variables, denominators):
        engine = self._engine
        # Before the first update: a summed loss with penalties is refused unapplied.
        gradient_combine.check_summed_loss_has_no_penalties(engine, self._state, list(self.scopes.values()))
        self.weights = gradient_combine.weights_for_call(engine, self._replicas, self._total, denominators)
        gradients, pending = gradient_combine.combine_call(
            engine, self._num_calls, self._replicas, variables, gradient_lists, self.weights
        )
        if pending:
            engine.processes.wait(pending)
        self._num_calls += 1
        with torch.no_grad():
            adapters.apply_update(optimizer, gradients, variables)
        self._refresh_copies(variables)

    def _refresh_copies(self, variables):
        """Replicas on other devices read copies made at step start: give them the updated values."""
        canonical = self._engine.devices[0].torch_device
        for replica_id, scope in self.scopes.items():
            device = self._engine.devices[replica_id].torch_device
            if device == canonical:
                continue  # they read the canonical Parameters themselves
            copies = copy_to_device([_compat.torch_tensor_of(v).detach() for v in variables], device)
            for variable, copy in zip(variables, copies):
                scope.add_update((variable, copy.detach().requires_grad_(bool(variable.trainable))))
