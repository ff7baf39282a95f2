"""What `optimizer.apply` does when replicas call it.

The replica adapter's `optimizer_step` (`kdist.keras.adapters`, where `apply`
is intercepted) asks `route` first, which decides:

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
   strategy): the adapter's `apply_gradients` (Keras' own `apply`, or a push
   to the parameter servers).

Combined gradients reach the real update through `adapters.apply_update`,
never through `optimizer.apply` again, so each call is routed once.
"""

import contextlib
import threading

import torch

from kdist import faults
from kdist.collectives.local import weighted_sum
from kdist.distribute import context
from kdist.distribute.values import PerReplica
from kdist.errors import ReplicaGradientError
from kdist.keras import _compat, adapters
from kdist.keras.replica import loss_denominators, process_sync

_thread = threading.local()


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
    # One local sum per device the variables live on, then one sum over processes.
    by_device = {}
    for position in present:
        by_device.setdefault(_compat.torch_tensor_of(variables[position]).device, []).append(position)
    full = [None] * len(variables)
    with torch.no_grad():
        for device, positions in by_device.items():
            sums = weighted_sum([[grads[p] for p in positions] for grads in lists], [1.0] * len(lists), device)
            for position, total in zip(positions, sums):
                full[position] = total
        processes = process_sync.for_strategy(strategy)
        if processes is not None and present:
            # Custom loops' gradients are compressed like the engine's.
            summed = processes.sum_tensors([full[p] for p in present], name="sum_tensors", compressed=True)
            for position, total in zip(present, summed):
                full[position] = total.to(full[position].device)
        adapters.apply_update(optimizer, full, variables)
