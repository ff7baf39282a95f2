"""What `optimizer.apply` does when replicas call it.

Every `apply` (and so `apply_gradients`) asks `route` first, which decides:

1. **Recorded** — inside a step of the replica engine's sequential mode
   (`recording`): the gradients are recorded and nothing is applied; the
   engine combines every replica's gradients after the step.
2. **Merged** — inside a replica function of a strategy with more than one
   replica in sync: the call becomes a `merge_call`, so every replica waits, the
   gradients are combined once and applied once (`iterations` advances by one).
   In a custom loop (`strategy.run`) the combination is TensorFlow's: the
   gradients are **summed** over every replica of every process, because the
   user scaled the loss by the global batch (`kdist.nn.compute_average_loss`).
   In the replica engine's merge mode (`combining`) the engine's own weighted
   rule combines them instead.
3. **Applied** — anywhere else (cross-replica context, one replica, no
   strategy): the optimizer's own `apply`.

The hook sits on `keras.optimizers.Optimizer.apply` and
`keras.optimizers.LossScaleOptimizer.apply` (`install`, so it reaches every
optimizer, including ones no model owns), and on the instance of a model's
optimizer (`wrap`, which the replica adapter's `attach` calls), outside any
wrapper a parameter-server strategy installs there. That wrapper
(`kdist.keras.parameter_server.worker_steps`, the push to the servers) asks
`route` itself before it pushes, so on a parameter-server worker a call that
`wrap` let through is routed a second time, with the same answer.
"""

import contextlib
import functools
import threading

import keras
import torch

from kdist import faults
from kdist.distribute import context
from kdist.distribute.values import PerReplica
from kdist.errors import ReplicaGradientError
from kdist.keras import _compat
from kdist.keras.replica import loss_denominators

_thread = threading.local()
_installed = False


class GradientRecorder:
    """Collects the `optimizer.apply` calls one replica makes during a sequential step.

    Args:
        single_call: raise `MergeModeNeeded` at a second call. A step that
            applies twice must see the first update before it computes the
            second gradients (the GAN pattern), which only the engine's merge
            mode can give.
    """

    def __init__(self, single_call=False):
        self.calls = []
        self._single_call = single_call

    def record(self, optimizer, gradients, variables, denominator=None):
        """Keeps one call: `(optimizer, gradients, variables, loss divisor since the last call)`."""
        if self._single_call and self.calls:
            raise MergeModeNeeded()
        self.calls.append((optimizer, list(gradients), list(variables), denominator))


class MergeModeNeeded(BaseException):
    """Unwinds a sequential replica step that applied gradients twice.

    A `BaseException`, so a `train_step` that catches `Exception` cannot swallow it.
    """


@contextlib.contextmanager
def recording(recorder):
    """While active (in this thread), `apply` calls are recorded by `recorder`."""
    previous = getattr(_thread, "recorder", None)
    _thread.recorder = recorder
    try:
        yield recorder
    finally:
        _thread.recorder = previous


@contextlib.contextmanager
def combining(combiner):
    """While active (in this replica's thread), merged `apply` calls go to `combiner`.

    `combiner(optimizer, gradient_lists, variables, denominators)` runs once
    per merged call, in the cross-replica context, with one gradient list and
    one loss divisor (`kdist.keras.replica.loss_denominators`) per replica.
    """
    previous = getattr(_thread, "combiner", None)
    _thread.combiner = combiner
    try:
        yield
    finally:
        _thread.combiner = previous


def route(optimizer, gradients, variables):
    """Records or merges an `apply` call made on a replica; returns False when the caller should apply it.

    Args:
        optimizer: the optimizer whose `apply` was called.
        gradients: the gradients passed to it.
        variables: the variables passed to it (None: the optimizer's own).
    """
    recorder = getattr(_thread, "recorder", None)
    if recorder is not None:
        recorder.record(optimizer, gradients, _variables(optimizer, variables), loss_denominators.take())
        return True
    if not context.has_strategy():
        return False
    replica_context = context.get_replica_context()
    if replica_context is None:
        return False
    combiner = getattr(_thread, "combiner", None)
    if combiner is not None:
        arguments = (combiner, optimizer, list(gradients), _variables(optimizer, variables), loss_denominators.take())
        replica_context.merge_call(_combine_and_apply, args=arguments)
        return True
    if replica_context.num_replicas_in_sync <= 1 or faults.ACTIVE.unmerged_replica_apply:
        return False
    replica_context.merge_call(_sum_and_apply, args=(optimizer, list(gradients), _variables(optimizer, variables)))
    return True



def _variables(optimizer, variables):
    if variables is None:
        return list(_compat.optimizer_trainable_variables(optimizer))
    return list(variables)


def per_replica_lists(gradients):
    """Splits a merged list of gradients (leaves `PerReplica` or shared) into one list per replica."""
    num_replicas = max((len(g.values) for g in gradients if isinstance(g, PerReplica)), default=1)
    return [
        [g.values[k] if isinstance(g, PerReplica) else g for g in gradients] for k in range(num_replicas)
    ]


def _combine_and_apply(strategy, combiner, optimizer, gradients, variables, denominators):
    del strategy
    lists = per_replica_lists(gradients)
    if isinstance(denominators, PerReplica):
        denominators = list(denominators.values)
    else:
        denominators = [denominators] * len(lists)
    combiner(optimizer, lists, variables, denominators)


def _sum_and_apply(strategy, optimizer, gradients, variables):
    """TensorFlow's merge for `apply_gradients` in replica context: sum over every replica, apply once."""
    lists = per_replica_lists(gradients)
    if not any(isinstance(g, PerReplica) for g in gradients):
        # Every replica passed the very same tensors: each still counts once.
        lists = lists * len(strategy.extended.replica_devices)
    present = []
    for position, variable in enumerate(variables):
        missing = [k for k, grads in enumerate(lists) if grads[position] is None]
        if len(missing) == len(lists):
            continue
        if missing:
            raise ReplicaGradientError(
                f"Replica {missing[0]} passed no gradient for variable '{variable.path}' but "
                "another replica did. Every replica must compute gradients for the same "
                "variables."
            )
        present.append(position)
    summed = []
    with torch.no_grad():
        for position in present:
            device = _compat.torch_tensor_of(variables[position]).device
            total = lists[0][position].to(device).clone()
            for grads in lists[1:]:
                total.add_(grads[position].to(device))
            summed.append(total)
        summed = strategy.extended._sum_tensors_over_processes(summed)
        full = [None] * len(variables)
        for position, total in zip(present, summed):
            full[position] = total
        optimizer.apply(full, variables)


def wrap(optimizer):
    """Routes `optimizer.apply` on this instance before any wrapper already on it. Idempotent.

    `optimizer._kdist_original_apply` is what the instance did before: the
    replica engine calls it to apply combined gradients.
    """
    if optimizer is None or getattr(optimizer, "_kdist_original_apply", None) is not None:
        return
    original_apply = optimizer.apply

    def apply(grads, trainable_variables=None):
        if route(optimizer, grads, trainable_variables):
            return None
        return original_apply(grads, trainable_variables)

    object.__setattr__(optimizer, "_kdist_original_apply", original_apply)
    object.__setattr__(optimizer, "apply", apply)


def install():
    """Routes `apply` for every optimizer class Keras ships. Idempotent."""
    global _installed
    if _installed:
        return
    for cls in (keras.optimizers.Optimizer, keras.optimizers.LossScaleOptimizer):
        _route_class(cls)
    _installed = True


def _route_class(cls):
    original_apply = cls.apply

    @functools.wraps(original_apply)
    def apply(self, grads, trainable_variables=None):
        if route(self, grads, trainable_variables):
            return None
        return original_apply(self, grads, trainable_variables)

    cls.apply = apply
