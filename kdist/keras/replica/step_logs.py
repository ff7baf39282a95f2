"""The logs of one step, merged from every replica's `train_step`/`test_step` logs.

Compiled metrics come from the canonical metric variables (already combined
by `state_sync`); any other value a step returns is the replicas' weighted
mean (summed over processes in a multi-worker job), as one device would have
computed it on the whole batch.
"""

import torch

from kdist.keras import _compat


def merge(engine, replica_logs, weights):
    """The step's logs.

    Args:
        engine: the `ReplicaEngine`.
        replica_logs: each active replica's logs, in replica order.
        weights: each replica's weight (`loss_denominators.ReplicaWeights`).
    """
    first = replica_logs[0]
    processes = engine.processes
    if not isinstance(first, dict) or (len(replica_logs) == 1 and processes is None):
        return first
    if not engine.faults.unflattened_logs and any(isinstance(value, dict) for value in first.values()):
        # Nested logs ({"compile_metrics": {...}}) merge key by key, flattened
        # as Keras flattens them before callbacks and History see them.
        replica_logs = [_compat.flatten_logs(logs) for logs in replica_logs]
        first = replica_logs[0]
    canonical = engine.model.get_metrics_result()
    merged = {}
    for key in first:
        if key in canonical:
            merged[key] = canonical[key]
        else:
            merged[key] = _weighted_mean([logs[key] for logs in replica_logs], weights)
    if processes is not None:
        merged = processes.merge_extra_logs(merged, canonical)
    return merged


def _weighted_mean(values, weights):
    try:
        return sum(torch.as_tensor(v).double().cpu() * w for v, w in zip(values, weights))
    except (TypeError, RuntimeError):
        return values[0]
