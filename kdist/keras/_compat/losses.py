"""Keras loss internals: observing every loss reduction and the divisor it uses."""

import keras
import numpy
from keras.src.losses import loss as _loss_module

PINNED = {
    "keras.src.losses.loss.reduce_weighted_values": lambda: _loss_module.reduce_weighted_values,
    "keras.src.losses.loss.squeeze_or_expand_to_same_rank": lambda: _loss_module.squeeze_or_expand_to_same_rank,
    "keras.src.losses.loss.standardize_reduction": lambda: _loss_module.standardize_reduction,
}

# The divisor of a "sum_over_batch_size" loss.
# Every `keras.losses.Loss.__call__` ends in `reduce_weighted_values`, looked up in
# its module at call time; it folds the mask into the sample weights and divides
# the weighted sum by the element count (or the weight sum). Wrapped once.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def install_loss_reduction_observer(observer):
    """Calls `observer(values, sample_weight, mask, reduction, dtype)` at every Keras loss reduction.

    Installed once per process (later calls with the same observer do nothing);
    the observer itself must return at once when it has nothing to record.
    """
    current = _loss_module.reduce_weighted_values
    if getattr(current, "_kdist_observer", None) is observer:
        return
    original = getattr(current, "_kdist_original", current)

    def reduce_weighted_values(
        values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None
    ):
        observer(values, sample_weight, mask, reduction, dtype)
        return original(values, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype)

    reduce_weighted_values._kdist_observer = observer
    reduce_weighted_values._kdist_original = original
    _loss_module.reduce_weighted_values = reduce_weighted_values


def loss_reduction_denominator(values, sample_weight, mask, reduction, dtype):
    """What a Keras loss reduction divides the weighted sum by, mirroring `reduce_weighted_values`.

    Returns:
        `(denominator, counts_elements)`: `denominator` is a 0-d float64 tensor
        (still on its device: no host sync), or, where `counts_elements` says
        it is the plain element count (no mask, no sample-weight sum, which
        grows with the batch size), that count as a Python float (it is known
        from the shape; no tensor is made). `(None, False)` when the reduction
        divides by nothing (`"sum"`, `"none"`, a scalar or empty value).
    """
    reduction = _loss_module.standardize_reduction(reduction)
    if reduction not in _MEAN_REDUCTIONS + ("mean_with_sample_weight",):
        return None, False
    if sample_weight is None and mask is None and hasattr(values, "shape"):
        # Every step of an unweighted, unmasked loss comes here: the shape alone answers.
        return _element_count(tuple(values.shape))
    values = keras.ops.convert_to_tensor(values, dtype=dtype)
    weights = None
    if sample_weight is not None:
        weights = keras.ops.cast(keras.ops.convert_to_tensor(sample_weight, dtype=dtype), values.dtype)
    if mask is not None and (weights is not None or reduction == "mean_with_sample_weight"):
        # As `apply_mask` for this reduction: the mask multiplies the weights.
        mask_weight = keras.ops.cast(mask, values.dtype)
        if weights is None:
            weights = mask_weight
        else:
            mask_weight, weights = _loss_module.squeeze_or_expand_to_same_rank(mask_weight, weights)
            weights = weights * mask_weight
    shape = tuple(values.shape)
    if weights is not None:
        values, weights = _loss_module.squeeze_or_expand_to_same_rank(values, weights)
        shape = tuple(numpy.broadcast_shapes(tuple(values.shape), tuple(weights.shape)))
    if shape in ((), (0,)):
        return None, False
    count = 1
    for dim in shape:
        count *= int(dim)
    if reduction == "mean_with_sample_weight" and weights is not None:
        return keras.ops.cast(keras.ops.sum(weights), "float64"), False
    if mask is not None and reduction in _MEAN_REDUCTIONS:
        # `apply_mask` scales valid entries by total/valid: the divisor is the valid count.
        valid = keras.ops.sum(keras.ops.cast(keras.ops.cast(mask, "bool"), "float64"))
        total = 1
        for dim in mask.shape:
            total *= int(dim)
        return valid * (count / total), False
    return _element_count(shape)


def _element_count(shape):
    if shape in ((), (0,)):
        return None, False
    count = 1
    for dim in shape:
        count *= int(dim)
    return float(count), True


# ----- loss reductions dividing by the global batch's count (float8 under replicas) ----
def install_loss_reduction_divisor(divisor_for):
    """Makes Keras loss reductions divide by `divisor_for(values, sample_weight, mask, reduction)` where it returns one.

    Where it returns a number, the reduction's value stays what Keras
    computes, but its gradient is that of `sum(weighted values) / divisor`,
    computed with Keras' own operations (`reduce_weighted_values` with
    `"sum"`, then `divide_no_nan`), so it is bit for bit the gradient of a
    loss whose divisor is that number. `None`: Keras' reduction unchanged.
    Installed once per process, over `install_loss_reduction_observer`'s
    wrapper (install that first: it keeps this wrapper when it finds it).
    """
    current = _loss_module.reduce_weighted_values
    if getattr(current, "_kdist_divisor", None) is divisor_for:
        return
    original = getattr(current, "_kdist_original", current)

    def reduce_weighted_values(
        values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None
    ):
        result = current(values, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype)
        divisor = divisor_for(values, sample_weight, mask, reduction)
        if divisor is None:
            return result
        total = original(values, sample_weight=sample_weight, mask=mask, reduction="sum", dtype=dtype)
        exact = keras.ops.divide_no_nan(total, keras.ops.cast(divisor, total.dtype))
        # The value the replica reports is its own mean; only the gradient is the global one.
        return exact + keras.ops.stop_gradient(result - exact)

    reduce_weighted_values._kdist_divisor = divisor_for
    # The observer's installer finds itself through these and leaves this wrapper on.
    reduce_weighted_values._kdist_observer = getattr(current, "_kdist_observer", None)
    reduce_weighted_values._kdist_original = original
    _loss_module.reduce_weighted_values = reduce_weighted_values
