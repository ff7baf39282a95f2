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
- the compiled loss tracker's total: Σ_k (value_k − pre) · g_k / share_k,
  with share_k = n_k / N and g_k replica k's gradient weight. Each replica
  adds `loss_k · n_k`, plain Keras adds `N · loss` with `loss = Σ_k g_k loss_k`:
  g_k = n_k / N for per-sample means (a plain sum of deltas), D_k / Σ D for
  losses divided by their unmasked entries (`loss_denominators`), and 1 when
  every compiled loss uses `reduction="sum"`.
- float8 scales and amax histories are trainable variables that the
  optimizer overwrites with their "gradient": see `float8_sync`.
- other non-trainable model state (BatchNorm moving statistics, counters):
  "sum" sums the deltas, "only_first_replica" takes replica 0, anything else
  takes the batch-size-weighted mean. For BatchNorm this averages each
  replica's update (local batch statistics); it is not SyncBatchNorm.
- buffers of torch modules inside `TorchModuleWrapper` layers (torch
  BatchNorm's running statistics): the same rule, floating-point buffers by
  batch-size-weighted mean, counters from replica 0 (see `torch_buffers`).
"""

import torch

from kdist.keras import _compat
from kdist.keras.replica import float8_sync, torch_buffers

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
        self.loss_total = tracker.total if tracker is not None else None
        self.loss_is_summed = loss_is_summed
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
        self.float8 = float8_sync.Float8Layout(model)
        self.has_weight_regularizers = any(
            getattr(v, "regularizer", None) is not None for v in self.trainable
        )
        self.torch_buffers = torch_buffers.TorchBuffers(model)
        # Each state variable's rule, metric variables first (aggregations are fixed once a variable exists).
        self.plan = [
            (v, _SCALED_SUM if v is self.loss_total else _metric_rule(v.aggregation)) for v in self.metric_variables
        ]
        self.plan.extend((v, _model_state_rule(v.aggregation)) for v in self.model_state)
        self.plan.extend((v, _FIRST) for v in self.seed_states)
        # Keras' own torch train_step clears the gradients before its backward;
        # the engine clears them before any other train_step runs.
        self.train_step_zeroes_gradients = _compat.train_step_zeroes_gradients(model)
        # Keras' conversion of `canonical_mapping` per Keras device (`_compat.stateless_scope`).
        self.converted_canonical = {}
        # A model built lazily by its first predict batch gains variables after
        # this snapshot; an unbuilt snapshot is taken again at the next step.
        self.complete = model.built


def seed_offset(state_value, replica_id):
    offset = torch.zeros_like(state_value)
    offset[0] = replica_id * SEED_REPLICA_STRIDE
    return state_value + offset


def reconcile(state, scopes, weights):
    """Assigns the combined post-step value of every state variable (one process).

    The metric variables combined from deltas (`"sum"`, the loss tracker's
    total) are computed together, one flat float64 vector per rule, dtype
    and device: the same element-wise operations as one variable at a time
    (`_contribution`, `assign`), in a dozen torch calls instead of a dozen
    per variable, written straight into their tensors. The others go one by one.

    Args:
        state: a `StateVariables`.
        scopes: the `StatelessScope` of each replica that ran, in replica order.
        weights: each replica's gradient weight (sums to 1); a
            `loss_denominators.ReplicaWeights` also carries the replicas'
            shares of the global batch by sample count.
    """
    scales = loss_total_scales(weights, state.loss_is_summed)
    shares = getattr(weights, "sample_shares", weights)
    plan, contributions, groups = [], [], {}
    for position, (variable, rule) in enumerate(state.plan):
        before = _compat.torch_tensor_of(variable)
        values, changed, same_dtype = [], False, True
        for scope in scopes:
            value = scope.get_current_value(variable)
            if value is None:
                value = before
            else:
                changed = True
                value = value.to(before.device)
                same_dtype = same_dtype and value.dtype == before.dtype
            values.append(value)
        if not changed:
            continue
        if rule == _SCALED_SUM and scales is None:
            rule = _SUM
        # Metric state only: it lives in this process, whatever strategy holds the model.
        if rule in (_SUM, _SCALED_SUM) and same_dtype and position < len(state.metric_variables):
            key = (rule, before.dtype, before.device, before.dim() == 0)
            groups.setdefault(key, []).append((variable, before, values))
            continue
        rule_weights = scales if rule == _SCALED_SUM else shares
        plan.append((variable, rule))
        contributions.append(_contribution(before, values, rule_weights, rule, True))
    for (rule, _, _, scalars), members in groups.items():
        _assign_summed_deltas(members, scales if rule == _SCALED_SUM else shares, rule == _SCALED_SUM, scalars)
    buffer_plan, buffer_contributions = state.torch_buffers.plan_contributions(list(shares), True)
    assign(plan + buffer_plan, contributions + buffer_contributions)


def _assign_summed_deltas(members, weights, scaled, scalars):
    """`before + Σ_k (value_k − before) [· w_k]` in float64 for variables of one dtype and device, assigned.

    Args:
        members: `(variable, before, values)` with one value per replica (the
            pre-step tensor where a replica left it unchanged).
        weights: each replica's weight; replicas with weight 0 are left out.
        scaled: multiply each replica's delta by its weight (else add it).
        scalars: every variable is 0-d (metric state mostly is): stacked and
            unbound as they are, instead of flattened and split.
    """
    befores = [before for _, before, _ in members]
    base = (torch.stack(befores) if scalars else torch.cat([t.reshape(-1) for t in befores])).double()
    total = torch.zeros_like(base)
    for k, weight in enumerate(weights):
        if weight > 0:
            values = [replica_values[k] for _, _, replica_values in members]
            flat = torch.stack(values) if scalars else torch.cat([t.reshape(-1) for t in values])
            delta = flat.double() - base
            total = total + (delta * weight if scaled else delta)
    combined = (base + total).to(dtype=befores[0].dtype)
    if scalars:
        parts = combined.unbind()
    else:
        parts = [part.view(t.shape) for part, t in zip(combined.split([t.numel() for t in befores]), befores)]
    _compat.write_values(list(zip([variable for variable, _, _ in members], parts)))


def plan_contributions(state, scopes, weights, holds_first_replica=True, for_all_reduce=False):
    """Each state variable's rule and this process's float64 contribution to its new value.

    Args:
        state, scopes, weights: as for `reconcile`. A replica with sample
            share 0 ran on a stand-in sample only to take part in the
            collectives; its updates are ignored.
        holds_first_replica: whether this process runs replica 0 of the job,
            whose seed-generator state every process adopts.
        for_all_reduce: the contributions will be summed over processes, so
            every variable gets one, even where no local replica changed it
            (every process must send the same list).

    Returns:
        `(plan, contributions)`: `plan` is a list of `(variable, rule)`;
        `contributions[i]` is None when no replica changed variable i (one process only).
    """
    plan = state.plan
    scales = loss_total_scales(weights, state.loss_is_summed)
    # Everything but the loss tracker follows the samples: a replica whose loss
    # counted no entry (weight 0) still updated its metrics and statistics.
    shares = getattr(weights, "sample_shares", weights)
    contributions = []
    for variable, rule in plan:
        before = _compat.torch_tensor_of(variable)
        values = [scope.get_current_value(variable) for scope in scopes]
        values = [None if value is None else value.to(before.device) for value in values]
        if rule == _SCALED_SUM and scales is None:
            rule = _SUM
        rule_weights = scales if rule == _SCALED_SUM else shares
        contribution = _contribution(before, values, rule_weights, rule, holds_first_replica)
        if contribution is None and for_all_reduce:
            contribution = _unchanged(before, rule, shares, holds_first_replica)
        contributions.append(contribution)
    buffer_plan, buffer_contributions = state.torch_buffers.plan_contributions(list(shares), holds_first_replica)
    return plan + buffer_plan, contributions + buffer_contributions


def loss_total_scales(weights, loss_is_summed):
    """What each replica's loss-tracker delta is multiplied by: g_k / share_k (None: all 1).

    A replica with weight 0 (a stand-in in a multi-worker job) gets 0.
    """
    shares = getattr(weights, "sample_shares", weights)
    gradient_weights = [1.0 if w > 0 else 0.0 for w in weights] if loss_is_summed else list(weights)
    if not loss_is_summed and list(shares) == gradient_weights:
        return None
    return [g / s if s > 0 else 0.0 for g, s in zip(gradient_weights, shares)]


def assign(plan, combined_values):
    """Assigns each variable its combined contribution (None: left unchanged)."""
    for (variable, rule), combined in zip(plan, combined_values):
        if combined is None:
            continue
        if rule == torch_buffers.RULE:
            variable.assign(combined)
            continue
        before = _compat.torch_tensor_of(variable)
        if rule in (_SUM, _SCALED_SUM):
            combined = before.double() + combined.to(before.device)
        variable.assign(combined.to(device=before.device, dtype=before.dtype))


def _contribution(before, values, weights, rule, holds_first_replica):
    """This process's float64 share of a variable's new value (None: no replica changed it).

    `_SUM` and `_SCALED_SUM` contribute deltas (the caller adds the old value);
    `_MEAN` and `_FIRST` contribute parts of the new value itself.
    """
    if all(value is None for value in values):
        return None
    base = before.double()
    values = [base if value is None else value.double() for value in values]
    if rule == _FIRST:
        return values[0] if holds_first_replica else torch.zeros_like(base)
    if rule == _SUM:
        return sum((value - base for value, w in zip(values, weights) if w > 0), torch.zeros_like(base))
    if rule == _SCALED_SUM:
        return sum(((value - base) * w for value, w in zip(values, weights) if w > 0), torch.zeros_like(base))
    return sum(value * w for value, w in zip(values, weights))


def _unchanged(before, rule, weights, holds_first_replica):
    """The contribution of a process whose replicas left the variable as it was."""
    base = before.double()
    if rule in (_SUM, _SCALED_SUM):
        return torch.zeros_like(base)
    if rule == _FIRST:
        return base if holds_first_replica else torch.zeros_like(base)
    return base * sum(weights)


def _metric_rule(aggregation):
    return {_MEAN: _MEAN, _FIRST: _FIRST}.get(aggregation, _SUM)


def _model_state_rule(aggregation):
    return {_SUM: _SUM, _FIRST: _FIRST}.get(aggregation, _MEAN)
