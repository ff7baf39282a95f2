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

import torch

from kdist.collectives.local import copy_to_device
from kdist.distribute import replica_runner
from kdist.keras import _compat, gradient_merge


def train_batch(engine, state, replicas, weights):
    """One training step of `engine` in merge mode; returns the merged logs.

    Args:
        engine: the `ReplicaEngine`.
        state: its `StateVariables`.
        replicas: this process's `(replica id, shard, size)` that take part.
        weights: each replica's share of the global batch.
    """
    combiner = _MergedApply(engine, state, replicas, weights)
    step_fn = engine._model.train_step

    def replica_step(replica_id, shard):
        def on_enter(scope):
            combiner.scopes[replica_id] = scope

        with gradient_merge.combining(combiner):
            return engine.run_in_scope(replica_id, step_fn, shard, state, training=True, on_enter=on_enter)

    calls = [(replica_id, (replica_id, shard), {}) for replica_id, shard, _ in replicas]
    results = replica_runner.run_replicas(engine._strategy, replica_step, calls)
    scopes = [scope for scope, _ in results]
    engine._check_summed_loss_has_no_penalties(state, scopes)
    engine._reconcile(state, scopes, weights)
    return engine._merge_logs([logs for _, logs in results], weights)


class _MergedApply:
    """Combines and applies each merged `apply` call of one step (runs in the cross-replica context)."""

    def __init__(self, engine, state, replicas, weights):
        self._engine = engine
        self._state = state
        self._replicas = replicas
        self._weights = weights
        self._num_calls = 0
        self.scopes = {}

    def __call__(self, optimizer, gradient_lists, variables):
        engine = self._engine
        # Before the first update: a summed loss with penalties is refused unapplied.
        engine._check_summed_loss_has_no_penalties(self._state, list(self.scopes.values()))
        gradients, pending = engine.combine_call(
            self._num_calls, self._replicas, variables, gradient_lists, self._weights
        )
        if pending:
            engine._processes.wait(pending)
        self._num_calls += 1
        with torch.no_grad():
            optimizer.apply(gradients, variables)
        self._refresh_copies(variables)

    def _refresh_copies(self, variables):
        """Replicas on other devices read copies made at step start: give them the updated values."""
        canonical = self._engine._devices[0].torch_device
        for replica_id, scope in self.scopes.items():
            device = self._engine._devices[replica_id].torch_device
            if device == canonical:
                continue  # they read the canonical Parameters themselves
            copies = copy_to_device([_compat.torch_tensor_of(v).detach() for v in variables], device)
            for variable, copy in zip(variables, copies):
                scope.add_update((variable, copy.detach().requires_grad_(bool(variable.trainable))))
