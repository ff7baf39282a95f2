"""Combining the replicas' gradients of one `optimizer.apply` call.

The combined gradient is `Σ_k w_k g_k`, applied once to the canonical
variables. The weight `w_k` is replica k's share of the divisor its loss
actually used (`D_k / Σ D`: unmasked entries, non-ignored labels, sample-weight
sums; see `kdist.keras.replica.loss_denominators`), else its share of the samples
`n_k / N`. That is what makes the sum the gradient of the loss over the
whole global batch. A loss with `reduction="sum"` is a sum over samples, so
its gradients are added (`w_k = 1`). float8 scale and amax-history
"gradients" are combined by maximum instead (`kdist.keras.replica.float8_sync`).

Used by the replica engine's sequential mode (all calls after the step) and
its merge mode (each call as the replicas meet).
"""

from kdist.collectives.local import weighted_sum
from kdist.errors import ReplicaGradientError, UnsupportedError
from kdist.keras.replica import float8_sync, loss_denominators


def weights_for_call(engine, replicas, total, denominators):
    """Each active replica's weight for one call (a `loss_denominators.ReplicaWeights`).

    Args:
        engine: the `ReplicaEngine`.
        replicas: this process's `(replica id, shard, size)` that ran.
        total: the global batch size.
        denominators: each replica's loss divisor for this call (None: unknown).
    """
    if engine.faults.sample_count_weights:
        denominators = [None] * len(replicas)
    sum_over_processes = None if engine.processes is None else engine.processes.sum_over_ranks
    sizes = [n for _, _, n in replicas]
    return loss_denominators.replica_weights(denominators, sizes, total, sum_over_processes)


def combine_recorded(engine, replicas, total, recorders, reduce=True, extra=None):
    """Combines every recorded `apply` call of a sequential step.

    Args:
        reduce: in a multi-worker job, sum over processes (False: this
            process's replicas only, for an accumulation micro-step).
        extra: tensors added to the first call's combined gradients before
            they are reduced (the pending sums of `gradient_accumulation`).

    Returns:
        `(updates, pending, weights)`: `updates` lists `(optimizer, variables,
        gradients)` to apply; `pending` the all-reduces still running in a
        multi-worker job (their results land in those gradients); `weights`
        those of the step's last call (sample shares when nothing was applied),
        which the loss tracker follows.
    """
    calls_per_replica = [recorder.calls for recorder in recorders]
    num_calls = len(calls_per_replica[0])
    for replica_position, calls in enumerate(calls_per_replica):
        if len(calls) != num_calls:
            raise ReplicaGradientError(
                f"Replica {replicas[replica_position][0]} called optimizer.apply "
                f"{len(calls)} time(s) but replica {replicas[0][0]} called it "
                f"{num_calls} time(s). train_step must apply gradients the same "
                "number of times on every replica."
            )
    updates, pending, weights = [], [], None
    for call_index in range(num_calls):
        optimizer, _, variables, _ = calls_per_replica[0][call_index]
        weights = weights_for_call(engine, replicas, total, [calls[call_index][3] for calls in calls_per_replica])
        gradient_lists = [calls[call_index][1] for calls in calls_per_replica]
        gradients, works = combine_call(
            engine, call_index, replicas, variables, gradient_lists, weights, reduce, extra if call_index == 0 else None
        )
        updates.append((optimizer, variables, gradients))
        pending.extend(works)
    if weights is None:  # a step that applied nothing: the samples' shares
        weights = weights_for_call(engine, replicas, total, [None] * len(replicas))
    return updates, pending, weights


def combine_call(engine, call_index, replicas, variables, gradient_lists, weights, reduce=True, extra=None):
    """Combines one `apply` call's gradients, one list per replica: `(gradients, pending)`.

    `reduce` and `extra` as for `combine_recorded`.
    """
    faults = engine.faults
    processes = engine.processes
    device = engine.devices[0].torch_device
    if getattr(weights, "global_divisor", False) is not False:
        # Replicas whose float8 steps divided by the global count: their gradients add up.
        weights = float8_sync.gradient_weights(engine.state.float8, weights)
    if faults.unweighted_gradient_mean:
        num_global = engine.strategy.num_replicas_in_sync
        weights = [1.0 / num_global if w > 0 else 0.0 for w in weights]
    if engine.summed_loss:
        weights = [1.0 if w > 0 else 0.0 for w in weights]
    if faults.drop_replica_gradients:
        gradient_lists = gradient_lists[:1] + [[None] * len(g) for g in gradient_lists[1:]]
    if faults.ddp_averaged_gradients and processes is not None:
        gradient_lists = [processes.ddp_average(grads) for grads in gradient_lists]
    _check_gradients(replicas, variables, gradient_lists)
    present = [i for i, grad in enumerate(gradient_lists[0]) if grad is not None]
    lists = [[grads[i] for i in present] for grads in gradient_lists]
    if extra is not None:
        lists.append([extra[i] for i in present])
        weights = list(weights) + [1.0]
    pending = []
    if processes is None or not reduce:
        combined = weighted_sum(lists, weights, device)
    else:
        # Written straight into the communication buckets: no extra copy.
        buffers = processes.buffers(lists[0], key=("gradients", call_index), compressed=True)
        buffers.fill_weighted(lists, weights)
        combined = buffers.outputs
        pending = processes.start(buffers, name="gradients")
    full = [None] * len(variables)
    for position, grad in zip(present, combined):
        full[position] = grad
    if not faults.float8_mean:
        float8_sync.overwrite_with_maximum(
            engine.state.float8, full, variables, gradient_lists, weights, device, processes
        )
    return full, pending


def check_summed_loss_has_no_penalties(engine, state, scopes):
    """Refuses `reduction="sum"` losses combined with per-model penalties, before any update.

    Every replica adds the whole penalty (weight regularizers, `add_loss`) to
    its loss. With per-sample-mean losses the weighted gradient mean counts it
    once; with summed losses the gradients are added, so it would count once
    per replica.
    """
    if not engine.summed_loss:
        return
    if state.has_weight_regularizers or any(scope.losses for scope in scopes):
        raise UnsupportedError(
            "A loss with reduction='sum' cannot be combined with weight regularizers "
            "or add_loss() penalties under MirroredStrategy with several replicas: "
            "each replica adds the whole penalty, so summing the replicas' gradients "
            "would count it once per replica. Received: loss reduction 'sum' and "
            "model penalties. Use reduction='sum_over_batch_size' (the default), or "
            "scale the penalty into the summed loss yourself."
        )


def _check_gradients(replicas, variables, gradient_lists):
    for position, grads in enumerate(gradient_lists[1:], start=1):
        for variable, reference, grad in zip(variables, gradient_lists[0], grads):
            if reference is not None and grad is None:
                raise ReplicaGradientError(
                    f"Replica {replicas[position][0]} produced no gradient for "
                    f"variable '{variable.path}' but replica {replicas[0][0]} did; the "
                    "step would silently train on fewer replicas. Usual cause: a "
                    "tensor copied off the replica device (check device strings) or "
                    "a train_step whose control flow depends on the replica."
                )
