"""Folding the replicas' updates of non-trainable state back into the model.

During a step every replica writes into its own `keras.StatelessScope`, so the
model's variables still hold the pre-step values afterwards. These rules turn
the replicas' values into the one value plain Keras would hold after the same
global batch:

- metric variables (`aggregation` "sum", or "none"): pre + Σ_k (value_k − pre),
  summed in float64. Totals and counts then equal one pass over the global batch.
- metric variables with "mean": batch-size-weighted mean; "only_first_replica":
  replica 0's value.
- seed-generator state: replica 0's value. Other replicas run with an offset
  seed so their dropout masks differ; replica 0 advances exactly as plain Keras.
- the compiled loss tracker's total, when every compiled loss uses
  `reduction="sum"`: Σ_k (value_k − pre) / share_k. Each replica adds
  `loss_k · n_k` but plain Keras adds `N · Σ_k loss_k`, because a summed loss
  is not a per-sample mean.
- other non-trainable model state (BatchNorm moving statistics, counters):
  "sum" sums the deltas, "only_first_replica" takes replica 0, anything else
  takes the batch-size-weighted mean. For BatchNorm this averages each
  replica's update (local batch statistics); it is not SyncBatchNorm.
"""

import torch

from kdist.keras import _compat

# Replica k runs with its seed-generator state shifted by k * this amount in the
# seed component, far beyond the per-step counter increments.
SEED_REPLICA_STRIDE = 1_000_003

_SUM = "sum"
_MEAN = "mean"
_FIRST = "only_first_replica"
_SCALED_SUM = "scaled_sum"


class StateVariables:
    """The non-trainable variables a step may update, grouped by reconciliation rule.

    A snapshot of the model's layout, taken once per `fit`/`evaluate`/`predict`
    call (see `ReplicaEngine.forget_layout`) instead of walking the layers every step.
    """

    def __init__(self, model, loss_is_summed=False):
        tracker = _compat.loss_tracker(model)
        self.summed_loss_total = tracker.total if (loss_is_summed and tracker is not None) else None
        self.seed_states = _compat.seed_generator_states(model)
        seed_ids = {id(v) for v in self.seed_states}
        self.metric_variables = list(model.metrics_variables)
        metric_ids = {id(v) for v in self.metric_variables}
        self.model_state = [
            v
            for v in model.non_trainable_variables
            if id(v) not in seed_ids and id(v) not in metric_ids
        ]
        self.trainable = list(model.trainable_variables)
        # What replicas on the canonical device read: the canonical Parameters
        # themselves (updates happen in place, so the tensors never change).
        self.canonical_mapping = [(v, _compat.torch_tensor_of(v)) for v in self.trainable]
        self.has_weight_regularizers = any(
            getattr(v, "regularizer", None) is not None for v in self.trainable
        )
        # A model built lazily by its first predict batch gains variables after
        # this snapshot; an unbuilt snapshot is taken again at the next step.
        self.complete = model.built


def seed_offset(state_value, replica_id):
    offset = torch.zeros_like(state_value)
    offset[0] = replica_id * SEED_REPLICA_STRIDE
    return state_value + offset


def reconcile(state, scopes, weights):
    """Assigns the combined post-step value of every state variable.

    Args:
        state: a `StateVariables`.
        scopes: the `StatelessScope` of each replica that ran, in replica order.
        weights: each replica's share of the global batch (sums to 1).
    """
    for variable in state.metric_variables:
        if variable is state.summed_loss_total:
            _assign(variable, scopes, weights, _SCALED_SUM)
        else:
            _assign(variable, scopes, weights, _metric_rule(variable.aggregation))
    for variable in state.model_state:
        _assign(variable, scopes, weights, _model_state_rule(variable.aggregation))
    for variable in state.seed_states:
        _assign(variable, scopes, weights, _FIRST)


def _metric_rule(aggregation):
    return {_MEAN: _MEAN, _FIRST: _FIRST}.get(aggregation, _SUM)


def _model_state_rule(aggregation):
    return {_SUM: _SUM, _FIRST: _FIRST}.get(aggregation, _MEAN)


def _assign(variable, scopes, weights, rule):
    values = [scope.get_current_value(variable) for scope in scopes]
    if all(value is None for value in values):
        return
    before = _compat.torch_tensor_of(variable)
    values = [before if value is None else value.to(before.device) for value in values]
    if rule == _FIRST:
        combined = values[0]
    elif rule == _SUM:
        base = before.double()
        combined = base + sum(value.double() - base for value in values)
    elif rule == _SCALED_SUM:
        base = before.double()
        combined = base + sum((value.double() - base) / weight for value, weight in zip(values, weights))
    else:
        combined = sum(value.double() * weight for value, weight in zip(values, weights))
    variable.assign(combined.to(before.dtype))
