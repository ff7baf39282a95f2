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
Keras' (s_k = n_k / N, the replica's share). Quantized with plain Keras' scale
it would clip at the float8 maximum. So each replica runs with that layer's
output-gradient scale and amax history divided by s_k (`prescale`): float8
rounding is then exactly plain Keras' up to that factor, and the replica's new
scale and history come out `1 / s_k` times plain Keras' values; they are
multiplied back by s_k before the maximum. (Where the loss weights differ from
the sample shares, masked losses, rounding matches only approximately.)

Stand-in replicas of a multi-worker job (no samples) take no part; across
processes the maximum is one more small all-reduce.
"""

import torch

from kdist.keras import _compat


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

    @property
    def active(self):
        """True when the model has float8 variables (their "gradients" combine by maximum)."""
        return bool(self.overwritten or self.output_gradient_variables)


def prescale(scope, layout, share, device):
    """Makes a replica with share `share` of the batch read output-gradient scales and histories / share.

    Called as the replica's `StatelessScope` opens; the replacements are leaf
    tensors, so the replica's "gradients" for them land on these tensors.
    """
    if not layout.output_gradient_variables or not share or share == 1.0:
        return
    for variable in layout.output_gradient_variables:
        value = _compat.torch_tensor_of(variable).detach().to(device) / share
        scope.add_update((variable, value.requires_grad_(True)))


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


def _local_maximum(variable, gradients, weights, layout, device):
    prescaled = id(variable) in layout.output_gradient
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
