"""Gradient accumulation with one all-reduce per applied update (DDP's `no_sync`).

With `optimizer(gradient_accumulation_steps=k)` Keras applies an update once
every k steps: on the k-1 steps in between (micro-steps) it only adds the
gradients to its accumulators. Reducing every micro-step's gradients between
processes would send k times the bytes for the same update. Sums commute, so
a multi-worker job defers them instead:

- micro-step: each process adds its own weighted gradients (`Σ_k w_k g_k` of
  its replicas, with the global weights) to a pending buffer of its own, and
  hands Keras zeros, so Keras counts the step and its accumulators stay
  identical on every rank;
- update step: the step's gradients and the pending buffer travel in one
  bucketed all-reduce; Keras adds its accumulators and applies
  `(g + acc) / k` exactly as on one device.

The pending part is folded into Keras' accumulators (one all-reduce) before
every save (`model.save`, `save_weights`, `ModelCheckpoint`,
`BackupAndRestore`) and when `fit` returns, so a checkpoint taken between
micro-steps holds the job's whole accumulated gradient and resumes exactly.
Between those points a callback reading the accumulators sees only the part
already folded in.

Steps where deferral does not apply reduce every step as before (correct,
just more bytes): a `LossScaleOptimizer` (it must see the combined gradient to
decide whether the step is finite), float8 layers, several `apply` calls per
step, an optimizer other than the model's, and the negative-control faults.
With sharded optimizer state (`shard_optimizer_state`) each rank's
accumulators are slices: a flush adds each rank's slice of the sums.

Not thread-safe: used by the training thread of one replica engine.
"""

import keras
import torch

from kdist.keras import _compat
from kdist.keras.replica import gradient_combine, sharded_optimizer
from kdist.keras.replica.gradient_overlap import may_overlap_or_defer

MICRO_STEP = "micro-step"
UPDATE_STEP = "update step"


class DeferredAccumulation:
    """The pending gradients of one replica engine's model (multi-worker only).

    Args:
        engine: the `ReplicaEngine`.
    """

    def __init__(self, engine):
        self._engine = engine
        self._processes = engine.processes
        # (optimizer, variables, pending sums, zeros), or None.
        self._pending = None
        self._dirty = False

    def step_kind(self, state):
        """`MICRO_STEP`, `UPDATE_STEP`, or None when the step reduces as usual. Decided before the step."""
        optimizer = getattr(self._engine.model, "optimizer", None)
        if self._processes is None or not _defers(optimizer):
            return None
        if not may_overlap_or_defer(self._engine, state):
            return None
        steps = optimizer.gradient_accumulation_steps
        return UPDATE_STEP if (_compat.optimizer_step_count(optimizer) + 1) % steps == 0 else MICRO_STEP

    def combine(self, replicas, total, recorders, kind):
        """`gradient_combine.combine_recorded`, deferring the reduction on micro-steps."""
        engine = self._engine
        calls = [recorder.calls for recorder in recorders]
        fits = kind is not None and all(len(c) == 1 and c[0][0] is engine.model.optimizer for c in calls)
        if not fits:
            self.flush()
            return gradient_combine.combine_recorded(engine, replicas, total, recorders)
        variables = calls[0][0][2]
        if self._pending is not None and [id(v) for v in self._pending[1]] != [id(v) for v in variables]:
            self.flush()
        if kind == UPDATE_STEP:
            extra = self._pending[2] if self._dirty and not engine.faults.dropped_pending_gradients else None
            result = gradient_combine.combine_recorded(engine, replicas, total, recorders, extra=extra)
            # Already copied into the communication buckets.
            self._clear()
            return result
        updates, pending, weights = gradient_combine.combine_recorded(engine, replicas, total, recorders, reduce=False)
        ((optimizer, variables, gradients),) = updates
        if self._pending is None:
            tensors = [_compat.torch_tensor_of(v) for v in variables]
            sums = [torch.zeros_like(t) for t in tensors]
            self._pending = (optimizer, variables, sums, [torch.zeros_like(t) for t in tensors])
        _, _, sums, zeros = self._pending
        with torch.no_grad():
            for total_so_far, gradient in zip(sums, gradients):
                if gradient is not None:
                    total_so_far.add_(gradient.to(total_so_far.device))
        self._dirty = True
        return [(optimizer, variables, [None if g is None else z for g, z in zip(gradients, zeros)])], pending, weights

    def flush(self):
        """Folds the pending sums of every process into the optimizer's accumulators.

        A collective: every rank calls it at the same point (every rank has
        pending sums after the same steps).
        """
        if not self._dirty:
            return
        optimizer, variables, sums, _ = self._pending
        summed = self._processes.sum_tensors(sums, name="accumulated_gradients")
        sharded = sharded_optimizer.state_of(optimizer)
        if sharded is not None:
            sharded.add_to_accumulators(variables, summed)
            self._clear()
            return
        with torch.no_grad():
            for accumulator, total in zip(_compat.gradient_accumulators(optimizer, variables), summed):
                accumulator.assign(accumulator.value + total.to(accumulator.value.device))
        self._clear()

    def _clear(self):
        if self._pending is not None:
            torch._foreach_zero_(self._pending[2])
        self._dirty = False


def _defers(optimizer):
    return (
        optimizer is not None
        and bool(getattr(optimizer, "gradient_accumulation_steps", None))
        and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    )


def flush(model):
    """Folds `model`'s pending accumulated gradients in, where it has any (a collective; see `flush`)."""
    engine = getattr(model, "_kdist_engine", None)
    if engine is not None:
        engine.accumulation.flush()
