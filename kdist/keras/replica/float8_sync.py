"""Combining the replicas' float8 scales and amax histories.

After `model.quantize("float8")`, each quantized layer keeps its scaling
factors and amax histories as trainable variables marked
`overwrite_with_gradient=True`: its custom gradient returns their new values,
and the optimizer assigns them instead of stepping. A weighted mean of those
"gradients" over replicas is wrong. Plain Keras on the global batch records
the largest |value| over the whole batch, which is the element-wise maximum of
the replicas' values (Keras' own rule when it accumulates them over
`gradient_accumulation_steps`).

Output gradients need one more step. Replica k's loss is a mean over its own
shard, so the gradient reaching a layer's output is `1 / s_k` times plain
Keras' (s_k = n_k / N, the replica's share); quantized with plain Keras' scale
it would clip at the float8 maximum. Where it can (`Float8Layout.global_divisor`),
each replica's losses divide by the global batch's count instead
(`loss_denominators.use_global_divisor`): its output gradients are then plain
Keras' values for its samples bit for bit, so their float8 rounding and amax
are too, and the replicas' gradients are added (`gradient_weights`), not
averaged. That needs every loss of the step to be a Keras loss that divides by
its element count, and no penalties (weight or activity regularizers,
`add_loss`), which would be counted once per replica. A step that turns out
otherwise runs again in merge mode with global division off for the model.

Otherwise (masked losses, sample-weight sums, penalties) each replica runs
with the output-gradient scale and amax history divided by s_k (`prescale`):
float8 rounding then matches plain Keras' up to the float32 rounding of that
division, and the replica's new scale and history, `1 / s_k` times plain
Keras' values, are multiplied back by s_k before the maximum. Float8 roundings
on an edge flip, so this matches only approximately.

Biases are not exact either way: Keras rounds a float8 layer's bias gradient
to bfloat16 (its bias passes through a bfloat16 cast), on each replica its
partial sum, on one device the whole batch's sum. The difference is at most
about one bfloat16 rounding (2^-8 relative) of the bias gradient per step.

Stand-in replicas of a multi-worker job (no samples) take no part; across
processes the maximum is one more small all-reduce.
"""

import torch

from kdist.keras import _compat
from kdist.keras.replica import gradient_merge, loss_denominators


class Float8Layout:
    """Which trainable variables are overwritten with their gradient. Snapshot per model layout."""

    def __init__(self, model):
        self.overwritten = {
            id(v) for v in model.trainable_variables if getattr(v, "overwrite_with_gradient", False)
        }
        self.output_gradient_variables = [
            v for pair in _compat.output_gradient_float8_state(model) for v in pair
        ]
        self.output_gradient = {id(v) for v in self.output_gradient_variables}
        # Penalties would be counted once per replica when the gradients add up.
        self.global_divisor = bool(self.output_gradient_variables) and not _has_penalties(model)

    @property
    def active(self):
        """True when the model has float8 variables (their "gradients" combine by maximum)."""
        return bool(self.overwritten or self.output_gradient_variables)


def prescale(scope, layout, share, device):
    """Prepares a replica with share `share` of the batch for float8 output gradients.

    With `layout.global_divisor`, its losses divide by the global batch's
    count. Otherwise it reads output-gradient scales and histories / share.
    Called as the replica's `StatelessScope` opens; the replacements are leaf
    tensors, so the replica's "gradients" for them land on these tensors.
    """
    if not layout.output_gradient_variables or not share:
        return
    if layout.global_divisor:
        loss_denominators.use_global_divisor(scope, share)
        return
    if share == 1.0:
        return
    for variable in layout.output_gradient_variables:
        value = _compat.torch_tensor_of(variable).detach().to(device) / share
        scope.add_update((variable, value.requires_grad_(True)))


def gradient_weights(layout, weights):
    """The weights that combine the replicas' gradients of one call (`weights` unless they add up).

    Raises:
        gradient_merge.MergeModeNeeded: some replica's losses could not all
            divide by the global count (`loss_denominators.INCONSISTENT`);
            global division is turned off for the model and the step must run
            again.
    """
    flag = getattr(weights, "global_divisor", False)
    if flag is None:
        layout.global_divisor = False
        raise gradient_merge.MergeModeNeeded()
    if flag:
        return [1.0 if share > 0 else 0.0 for share in weights.sample_shares]
    return weights


def overwrite_with_maximum(layout, full, variables, gradient_lists, weights, device, processes=None):
    """Replaces the combined "gradients" of overwritten variables in `full` by their maximum.

    Args:
        layout: a `Float8Layout` of the model.
        full: the combined gradients of one `optimizer.apply` call, aligned
            with `variables` (changed in place).
        gradient_lists: each active replica's gradients for that call.
        weights: each replica's gradient weight.
        device: where the result lives.
        processes: the engine's `ProcessSync` in a multi-worker job, else None.
    """
    if not layout.overwritten:
        return
    positions = [
        i for i, v in enumerate(variables) if id(v) in layout.overwritten and gradient_lists[0][i] is not None
    ]
    if not positions:
        return
    maxima = [_local_maximum(variables[i], [g[i] for g in gradient_lists], weights, layout, device) for i in positions]
    if processes is not None:
        maxima = processes.maximum_over_ranks(maxima)
    for position, value in zip(positions, maxima):
        full[position] = value.to(device=device, dtype=gradient_lists[0][position].dtype)


def _has_penalties(model):
    return any(getattr(v, "regularizer", None) is not None for v in model.trainable_variables) or any(
        getattr(layer, "activity_regularizer", None) is not None for layer in _compat.sublayers(model)
    )


def _local_maximum(variable, gradients, weights, layout, device):
    prescaled = id(variable) in layout.output_gradient and not getattr(weights, "global_divisor", False)
    # A replica whose loss counted no entry (weight 0) still saw its inputs.
    shares = getattr(weights, "sample_shares", weights)
    result = None
    for gradient, share in zip(gradients, shares):
        if share <= 0:
            continue
        value = gradient.detach().to(device=device, dtype=torch.float32)
        if prescaled and share != 1.0:
            value = value * share
        result = value if result is None else torch.maximum(result, value)
    if result is None:
        # Only a stand-in replica ran here: the neutral element of the maximum.
        result = torch.full(gradients[0].shape, float("-inf"), device=device)
    return result
