"""Replica weights from the divisor each replica's loss really used.

Plain Keras divides a `"sum_over_batch_size"` loss by the number of entries
that count: all elements, or only the unmasked ones (a mask from
`mask_zero=True` reaching a per-timestep loss, `ignore_class=...`), or for
`"mean_with_sample_weight"` the sum of the sample weights. On the global batch
its loss is `Σ_k S_k / Σ_k D_k` (S_k: replica k's weighted sum, D_k: its
divisor), so the replicas' gradients combine exactly as `Σ_k w_k g_k` with
`w_k = D_k / Σ_j D_j`, not `n_k / N`.

Per replica step the engine calls `begin()`, runs the step, `take()`s the
divisor and calls `end()`; `replica_weights` turns the divisors into weights.
The divisor is read from Keras' own reduction (`_compat` observes
`reduce_weighted_values`), so it is the one the loss divided by.

Fallback to `n_k / N`, which is exact where the divisor is the element count
(no mask, `"sum_over_batch_size"` with or without sample weights: Keras then
divides by the element count, which grows with n_k):

- the losses of the step divided by the element count only;
- a divisor that cannot be known: a reduction that divides by nothing
  (`"sum"`, `"none"`, a scalar loss), several losses in one step whose
  divisors differ (several outputs with different masks, say), or no loss at
  all (the engine's own `reduction="sum"` rule applies then).

float8 steps (`kdist.keras.replica.float8_sync`) may ask a replica to divide
its losses by the global batch's count instead (`use_global_divisor`): its
gradients are then exactly plain Keras' for its samples, the replicas'
gradients are added, and `take()` returns `GLOBAL` (or `INCONSISTENT` where
one of the step's reductions could not be rescaled, or penalties were added).

Thread-safe: the recording is per thread.
"""

import threading

import torch

from kdist.keras import _compat

_local = threading.local()

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


class _Marker:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"loss_denominators.{self.name}"


# What `take()` returns for a replica whose losses divided by the global count:
# every reduction did (GLOBAL), or only some did or penalties were added (INCONSISTENT).
GLOBAL = _Marker("GLOBAL")
INCONSISTENT = _Marker("INCONSISTENT")


class ReplicaWeights(list):
    """Each active replica's weight (floats summing to the process's share; 1 in one process).

    `sample_shares` holds each replica's share of the global batch by sample
    count (`n_k / N`); it differs from the weights only when the weights come
    from loss divisors. `state_sync` needs both to rebuild the loss tracker.
    `total` is the global batch size N.
    """

    global_divisor = False

    def __init__(self, weights, sample_shares, total):
        super().__init__(weights)
        self.sample_shares = list(sample_shares)
        self.total = total


def begin():
    """Starts recording the divisors of the losses computed in this thread (resets)."""
    _compat.install_loss_reduction_observer(_observe)
    _local.records = []
    _local.global_divisor = None


def end():
    """Stops recording in this thread."""
    _local.records = None
    _local.global_divisor = None


def use_global_divisor(scope, share):
    """Until `end()`, this thread's element-count losses divide by the global batch's count.

    Args:
        scope: the replica's `keras.StatelessScope` (penalties it collects
            make the step `INCONSISTENT`).
        share: the replica's share of the global batch's samples, `n_k / N`.
    """
    _compat.install_loss_reduction_observer(_observe)
    _compat.install_loss_reduction_divisor(_global_divisor_for)
    _local.global_divisor = (scope, share)


def take():
    """The divisor recorded in this thread since the last `begin()`/`take()`, then resets.

    Returns:
        A 0-d float64 tensor (still on its device: reading it is a host sync,
        which `replica_weights` does once for all replicas; it is NaN when the
        step's losses used different divisors), or None where the weights
        fall back to sample counts (see the module docstring).
    """
    records = getattr(_local, "records", None)
    if records is None:
        return None
    _local.records = []
    return _summarise(records)


def peek():
    """What `take()` would return now, without resetting (None outside recording or under `use_global_divisor`)."""
    records = getattr(_local, "records", None)
    if records is None or getattr(_local, "global_divisor", None) is not None:
        return None
    return _summarise(records)


def current_records():
    """This thread's record list since the last `begin()`/`take()` (None outside recording).

    For readers in other threads (autograd hooks run on device threads):
    pass it to `summarise`. `take()` starts a new list, so this one stops
    growing at the next `take()`.
    """
    return getattr(_local, "records", None)


def summarise(records):
    """What `take()` returns for a list from `current_records()`."""
    return _summarise(records)


def _summarise(records):
    global_divisor = getattr(_local, "global_divisor", None)
    if global_divisor is not None:
        # No Keras loss at all (a train_step reducing by itself) is inconsistent too.
        rescaled = [record[2] for record in records]
        if rescaled and all(rescaled) and not global_divisor[0].losses:
            return GLOBAL
        return INCONSISTENT
    records = [record[:2] for record in records]
    if not records or any(denominator is None for denominator, _ in records):
        return None
    if all(counts_elements for _, counts_elements in records):
        return None
    first = records[0][0]
    if len(records) == 1:
        return first
    if any(counts_elements for _, counts_elements in records):
        # An element count is a Python float; another record holds a tensor on the loss's device.
        device = next(d.device for d, counts_elements in records if not counts_elements)
        return torch.tensor(float("nan"), dtype=torch.float64, device=device)
    stacked = torch.stack([denominator.to(first.device) for denominator, _ in records])
    return torch.where((stacked == first).all(), first, torch.full_like(first, float("nan")))


def replica_weights(denominators, sizes, total=None, sum_over_processes=None):
    """Each active replica's gradient weight.

    Args:
        denominators: `take()` of each active replica, in replica order.
        sizes: each replica's sample count n_k (0 for a stand-in replica that
            only takes part in a multi-worker job's collectives).
        total: the global batch size N (default: `sum(sizes)`).
        sum_over_processes: in a multi-worker job, a function that sums a
            list of floats over all processes (every process calls it in the
            same steps: whether it is needed depends only on the model).

    Returns:
        A `ReplicaWeights`: `D_k / Σ D` when every replica's divisor is known
        and `Σ D > 0` (over all processes), else `n_k / N`. Its
        `global_divisor` is True where every active replica's losses divided
        by the global count (`GLOBAL`: their gradients add up, and the weights
        are `n_k / N`, those of element counts), None where some replica's
        could not (`INCONSISTENT`), else False.
    """
    total = sum(sizes) if total is None else total
    shares = [n / total for n in sizes]
    fallback = ReplicaWeights(shares, shares, total)
    markers = [d for d, n in zip(denominators, sizes) if n > 0 and d in (GLOBAL, INCONSISTENT)]
    if markers:
        fallback.global_divisor = True if all(d is GLOBAL for d in markers) else None
        return fallback
    if all(d is None for d in denominators):
        return fallback
    local = [0.0 if n == 0 else _host_value(d) for d, n in zip(denominators, sizes)]
    local_sum = sum(local)
    if sum_over_processes is not None:
        local_sum = sum_over_processes([local_sum])[0]
    # NaN (unknown on some replica of some process) fails this test too.
    if not local_sum > 0:
        return fallback
    return ReplicaWeights([d / local_sum for d in local], shares, total)


def _host_value(denominator):
    if denominator is None:
        return float("nan")
    return float(denominator)


def _observe(values, sample_weight, mask, reduction, dtype):
    records = getattr(_local, "records", None)
    if records is None:
        return
    denominator, counts_elements = _compat.loss_reduction_denominator(values, sample_weight, mask, reduction, dtype)
    records.append((denominator, counts_elements, False))


def _global_divisor_for(values, sample_weight, mask, reduction):
    """The global batch's element count for an element-count mean of this thread's replica (else None).

    Runs right after `_observe` saw the same reduction, and marks its record.
    """
    global_divisor = getattr(_local, "global_divisor", None)
    records = getattr(_local, "records", None)
    if global_divisor is None or not records:
        return None
    count, counts_elements, _ = records[-1]
    # An element-count record holds the count itself (a float; never for a 0-d value).
    if not counts_elements or reduction not in _MEAN_REDUCTIONS or int(values.shape[0]) == 0:
        return None
    # count = n_k * (entries per sample): the global batch has N / n_k times as many.
    records[-1] = (count, counts_elements, True)
    return float(round(count / global_divisor[1]))
