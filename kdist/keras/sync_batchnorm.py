"""SyncBatchNorm: `BatchNormalization` statistics over the global batch, on torch.

Keras 3 supports `BatchNormalization(synchronized=True)` only on TensorFlow. On
torch, kdist provides it:

- `keras.layers.BatchNormalization(synchronized=True)` is accepted while a
  kdist strategy's scope is open (also when a model is loaded from a config
  that says so inside the scope); outside any kdist scope Keras' own error is
  kept;
- `convert(model)` turns every `BatchNormalization` of an existing model into
  a synchronized one, in the spirit of torch's `convert_sync_batchnorm`.

A synchronized layer that trains (`training=True`, layer trainable) in a replica
context with more than one replica in sync computes, per channel, the float64
sums `Σx`, `Σx²` and the count of (unmasked) entries on each replica, adds them
over the replicas of this process and then over processes (one merge and, in a
multi-worker job, one all-reduce per layer and step), and derives the mean and
variance of the whole global batch from them. Its backward pass adds the
incoming gradients of those sums the same way, each weighted by the factor
with which the replica's gradients are combined (`annotate_replica`), so the
gradients equal one device's on the global batch. Anywhere else (one replica,
cross-replica context, inference) the layer computes what plain Keras computes.

The layer's `get_config()` says `synchronized=False`, so a saved `.keras` file
loads in plain Keras on torch, where it is ordinary BatchNormalization (at
inference the two are the same). Call `convert(model)` after loading to train
synchronized again.

Glossary: see `kdist.distribute.context` (replica, replica context).
"""

import dataclasses
import functools
import inspect
import math
import types

import keras
import torch

from kdist import faults
from kdist.distribute import context
from kdist.distribute.values import DistributedValues
from kdist.errors import InvalidArgumentError
from kdist.keras import _compat

_SYNCHRONIZED_MARK = "_kdist_synchronized_batchnorm"
_SHARE_ATTRIBUTE = "_kdist_batchnorm_share"
# The sums travel to the host for the in-process merge: replicas of one process
# may sit on different devices, and float64 keeps 2-3 replicas within float32
# rounding of one device.
_HOST = torch.device("cpu")
_installed = False



@dataclasses.dataclass(frozen=True)
class ReplicaShare:
    """What a replica contributes to the synchronized statistics and their gradients.

    Attributes:
        counts_samples: False for a replica that runs on a stand-in sample only
            to take part in the collectives (weight 0): it adds zero sums and a
            zero count.
        gradient_weight: a float, or a function of no arguments called during
            the backward pass, giving the factor the caller multiplies this
            replica's gradients by when it combines replicas (up to a factor
            common to every replica). TensorFlow's custom-loop rule (gradients
            summed over replicas) is 1.0 for every replica, the default.
    """

    counts_samples: bool = True
    gradient_weight: object = 1.0

    def weight(self):
        value = self.gradient_weight() if callable(self.gradient_weight) else self.gradient_weight
        return float(value)


_DEFAULT_SHARE = ReplicaShare()


def annotate_replica(replica_context, gradient_weight=1.0, counts_samples=True):
    """Tells the synchronized layers how a replica's gradients will be combined.

    For engines that run Keras steps per replica (the replica engine of
    `model.fit`): call it on each replica's `ReplicaContext` before the step.

    Args:
        replica_context: the replica's `kdist.distribute.context.ReplicaContext`.
        gradient_weight: see `ReplicaShare.gradient_weight`.
        counts_samples: see `ReplicaShare.counts_samples`.
    """
    share = ReplicaShare(counts_samples=counts_samples, gradient_weight=gradient_weight)
    object.__setattr__(replica_context, _SHARE_ATTRIBUTE, share)


# ----- which layers are synchronized -----------------------------------------------
def is_synchronized(layer):
    """True for a `BatchNormalization` whose training statistics kdist synchronizes."""
    return bool(getattr(layer, _SYNCHRONIZED_MARK, False))


def convert(model):
    """Makes every `BatchNormalization` in `model` compute global batch statistics.

    The torch counterpart of `torch.nn.SyncBatchNorm.convert_sync_batchnorm`,
    done in place: layers keep their weights, names and class. Useful for a
    model built or loaded outside a strategy's scope.

    Args:
        model: a Keras layer or model.

    Returns:
        `model` itself.

    Raises:
        kdist.errors.InvalidArgumentError: `model` is not a Keras layer.

    Example:

    ```python
    model = keras.saving.load_model("resnet.keras")
    kdist.keras.sync_batchnorm.convert(model)
    with strategy.scope():
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=256)
    ```
    """
    if not isinstance(model, keras.layers.Layer):
        raise InvalidArgumentError(
            "convert() takes a Keras layer or model. Received: "
            f"model={model!r} of type {type(model).__name__}."
        )
    layers = [model] + list(_compat.sublayers(model))
    for layer in layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            _synchronize(layer)
    return model


def needs_merge_mode(model):
    """True when `model` has a synchronized BatchNormalization.

    Its replicas must then be able to meet inside a step (`merge_call`), so the
    replica engine runs each replica's step in its own thread.
    """
    return any(is_synchronized(layer) for layer in _compat.sublayers(model))


def _synchronize(layer):
    if is_synchronized(layer):
        return
    # The attribute Keras' own code reads stays honest; Keras only reads it in
    # `_moments` and `get_config`, both replaced on this instance.
    layer.synchronized = True
    object.__setattr__(layer, _SYNCHRONIZED_MARK, True)
    _compat.set_batchnorm_moments(layer, types.MethodType(_moments, layer))
    object.__setattr__(layer, "get_config", types.MethodType(_get_config, layer))


def _get_config(layer):
    config = type(layer).get_config(layer)
    # Keras on torch and JAX refuses synchronized=True at construction.
    config["synchronized"] = False
    return config


def install():
    """Lets `BatchNormalization(synchronized=True)` be built inside a kdist scope on torch. Idempotent."""
    global _installed
    if _installed or keras.backend.backend() != "torch":
        return
    batchnorm = keras.layers.BatchNormalization
    original_init = batchnorm.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        synchronized = kwargs.get("synchronized", False)
        if not synchronized or not context.has_strategy():
            return original_init(self, *args, **kwargs)
        kwargs["synchronized"] = False
        original_init(self, *args, **kwargs)
        _synchronize(self)

    # Keras reads the constructor's signature to record its arguments
    # (`Operation.__new__`): show it the original one, not `*args, **kwargs`.
    del __init__.__wrapped__
    __init__.__signature__ = inspect.signature(original_init)
    batchnorm.__init__ = __init__
    _installed = True


# ----- the statistics ------------------------------------------------------------------
def _moments(layer, inputs, mask):
    replica_context = context.get_replica_context()
    if (
        faults.ACTIVE.local_statistics
        or replica_context is None
        or replica_context.num_replicas_in_sync <= 1
    ):
        return _compat.batchnorm_local_moments(layer, inputs, mask)
    axes = list(_compat.batchnorm_reduction_axes(layer))
    share = getattr(replica_context, _SHARE_ATTRIBUTE, _DEFAULT_SHARE)
    if _compat.in_stateless_scope():
        # The replica engine: each replica writes its moving statistics into its own scope.
        return global_moments(inputs, mask, axes, replica_context, share)
    # A custom loop (`strategy.run`): replicas share the layer's variables and
    # take turns. Until the merge no replica has updated this layer's moving
    # statistics; each replica puts the pre-step values back before Keras
    # updates them from the global statistics, so every replica writes the same
    # value once instead of compounding the update once per replica.
    state = [_compat.torch_tensor_of(variable) for variable in layer.non_trainable_variables]
    before = [tensor.detach().clone() for tensor in state]
    moments = global_moments(inputs, mask, axes, replica_context, share)
    with torch.no_grad():
        for tensor, value in zip(state, before):
            tensor.copy_(value)
    return moments


def global_moments(inputs, mask, axes, replica_context, share=_DEFAULT_SHARE):
    """Mean and variance over `axes` of every replica's `inputs` (differentiable).

    Every replica in sync must call this with the same layout, in the same order.

    Args:
        inputs: this replica's torch tensor.
        mask: None, or a mask with one dimension less than `inputs`
            (Keras' rule: it masks every channel of an entry).
        axes: the axes reduced over (all but the channel axis).
        replica_context: the calling replica's context; the backward pass uses
            this same object (autograd may run it in another thread).
        share: this replica's `ReplicaShare`.

    Returns:
        `(mean, variance)`, each of shape (channels,), in `inputs`' dtype.
    """
    if mask is None:
        count = math.prod(inputs.shape[axis] for axis in axes)
        sums = torch.sum(inputs, dim=axes, dtype=torch.float64)
        squares = torch.sum(inputs * inputs, dim=axes, dtype=torch.float64)
        counts = torch.full_like(sums, float(count))
    else:
        entries = keras.ops.convert_to_tensor(mask).to(inputs.device).bool().unsqueeze(-1).expand(inputs.shape)
        masked = torch.where(entries, inputs, torch.zeros_like(inputs))
        sums = torch.sum(masked, dim=axes, dtype=torch.float64)
        squares = torch.sum(masked * masked, dim=axes, dtype=torch.float64)
        counts = torch.sum(entries, dim=axes, dtype=torch.float64)
    if not share.counts_samples:
        sums, squares, counts = sums * 0.0, squares * 0.0, torch.zeros_like(counts)
    channels = sums.shape[0]
    local = torch.cat([sums, squares, counts])
    total = _AllReduceSums.apply(local, replica_context, share)
    sums, squares, counts = total[:channels], total[channels : 2 * channels], total[2 * channels :]
    if mask is None:
        mean = sums / counts
        variance = squares / counts - mean * mean
    else:
        # Keras' masked statistics divide by the count plus epsilon.
        denominator = counts + keras.config.epsilon()
        mean = sums / denominator
        variance = (squares - 2.0 * mean * sums + mean * mean * counts) / denominator
    return mean.to(inputs.dtype), variance.to(inputs.dtype)


class _AllReduceSums(torch.autograd.Function):
    """Sums a float64 vector over every replica in sync; the backward pass sums the gradients.

    Replica j's gradient of its local sums is `Σ_k w_k g_k / w_j`, where `g_k` is
    the gradient of replica k's loss with respect to the global sums and `w_k`
    the weight its gradients get when replicas are combined: scaled by `w_j`,
    that is exactly the global objective's gradient through replica j's inputs.
    """

    @staticmethod
    def forward(ctx, local, replica_context, share):
        ctx.replica_context = replica_context
        ctx.share = share
        return _sum_over_replicas(replica_context, local.detach()).to(local.device)

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.share.weight()
        contribution = grad.double() * weight if weight else torch.zeros_like(grad, dtype=torch.float64)
        total = _sum_over_replicas(ctx.replica_context, contribution).to(grad.device)
        if not weight:
            return torch.zeros_like(grad), None, None
        return (total / weight).to(grad.dtype), None, None


def _sum_over_replicas(replica_context, local):
    return replica_context.merge_call(_merge_sums, args=(local.to(_HOST),))


def _merge_sums(strategy, per_replica):
    """Adds this process's replicas' vectors in replica order, then adds the processes'."""
    components = per_replica.values if isinstance(per_replica, DistributedValues) else (per_replica,)
    total = components[0].clone()
    for component in components[1:]:
        total += component
    collectives = strategy.extended.collectives
    if collectives is not None:
        (total,) = collectives.all_reduce_sum([total], name="sync_batchnorm")
        total = total.to(_HOST)
    return total


__all__ = [
    "ReplicaShare",
    "annotate_replica",
    "convert",
    "global_moments",
    "install",
    "is_synchronized",
    "needs_merge_mode",
]
