"""Reducing gradients between processes while backward still runs (DDP's overlap).

In a multi-worker job with one replica per process, every trainable
variable's torch tensor carries a post-accumulate-grad hook. During a step's
backward pass each hook writes `c · g` (the replica's weight `c` times its
gradient) into a communication bucket; when a bucket holds all of its
gradients it is all-reduced at once, while backward goes on computing the
earlier layers' gradients. Buckets follow the reverse creation order of the
variables (the order backward produces their gradients), the first one small
(`CommunicationOptions.first_bucket_bytes`), the rest up to `bucket_bytes`,
and they are started strictly in bucket order, so every rank makes the same
calls in the same order whatever order its hooks fire in.

The weight keeps kdist's exact rule (`kdist.keras.replica.gradient_combine`):

- a loss divided by the sample count (or with no known divisor): `c = n / N`,
  the sums need no further division, exactly the arithmetic of the
  post-backward path;
- a loss divided by its own count `D` (masks, ignored labels, sample-weight
  sums): `c = D / N`, and after the reduction every rank divides by `Σ c`
  (summed in float64 beside the gradients), which gives `Σ D_k g_k / Σ D_k`;
- `reduction="sum"` losses: `c = 1`, sums as they are.

After the step's `optimizer.apply`, a small float64 control vector carries
whether any rank saw something overlap cannot handle, which variables had
gradients, and (divisor case) the weights' sum. It rides in the state
all-reduce the step makes anyway; only the divisor case reduces it on its own
first. Every rank then takes the same decision. The step
falls back to the post-backward path (its already reduced buckets are
discarded) when a gradient arrived twice (two backward passes), when the
gradients handed to `apply` are not the ones the hooks saw (a `train_step`
that scales, clips or replaces them before applying), or when losses were
computed between backward and `apply`; overlap then stays off for the model.
A `train_step` that applies twice never gets here: it runs in merge mode.
A variable with a gradient on some ranks but not others raises
`ReplicaGradientError` (the ranks would otherwise apply different updates).

Not thread-safe: one step is armed at a time; the hooks may run on autograd
device threads while the training thread waits in `backward()`.
"""

import functools
import logging

import torch

from kdist.errors import ReplicaGradientError
from kdist.keras import _compat
from kdist.keras.replica import loss_denominators

_logger = logging.getLogger("kdist")

# Gradient faults switch the step to the post-backward path, where the
# negative controls inject their bugs.
GRADIENT_FAULTS = (
    "unweighted_gradient_mean",
    "drop_replica_gradients",
    "ddp_averaged_gradients",
    "sample_count_weights",
    "float8_mean",
    "no_merge_mode",
)


def may_overlap_or_defer(engine, state):
    """Whether a step may reduce during backward or defer its reduction.

    Not with a negative-control gradient fault on (those bugs live in the
    post-backward path), nor with float8 layers (their scales combine by
    maximum, not by a weighted sum).
    """
    faults = engine.faults
    return not any(getattr(faults, name) for name in GRADIENT_FAULTS) and not state.float8.active


class GradientOverlap:
    """The hooks of one replica engine and the step they are armed for.

    Args:
        engine: the `ReplicaEngine` (multi-worker, one replica per process).
    """

    def __init__(self, engine):
        self._engine = engine
        self._processes = engine.processes
        self._hooked = []
        self._handles = []
        self._buffers = None
        self._step = None
        # Why overlap was turned off for good (a fallback), for the log and tests.
        self.disabled_reason = None

    def begin(self, state, replicas, total):
        """Arms the hooks for one training step; returns the `OverlappedStep`, or None to reduce after backward."""
        if not self._eligible(state, replicas):
            return None
        variables = list(self._engine.model.trainable_variables)
        tensors = [_compat.torch_tensor_of(v) for v in variables]
        if not variables or not all(t.is_leaf and t.requires_grad for t in tensors):
            return None
        self._hook(variables, tensors)
        ((_, _, size),) = replicas
        self._step = OverlappedStep(self, variables, size, total, self._engine.summed_loss)
        return self._step

    def _eligible(self, state, replicas):
        processes = self._processes
        if processes is None or self.disabled_reason is not None:
            return False
        if not processes.options.overlap_with_backward or len(replicas) != 1 or self._engine.num_replicas != 1:
            return False
        return may_overlap_or_defer(self._engine, state)

    def _hook(self, variables, tensors):
        # By identity, not id(): a rebuilt layer's new tensor may reuse an old address.
        if len(tensors) == len(self._hooked) and all(a is b for a, b in zip(tensors, self._hooked)):
            return
        self.remove_hooks()
        # Backward produces the last layers' gradients first.
        order = list(reversed(range(len(tensors))))
        self._buffers = self._processes.buffers(tensors, key="overlap", compressed=True, order=order)
        self._handles = [
            tensor.register_post_accumulate_grad_hook(functools.partial(self._on_gradient, position))
            for position, tensor in enumerate(tensors)
        ]
        self._hooked = tensors

    def remove_hooks(self):
        """Takes the hooks off the variables' tensors (a recompile builds a new engine)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._hooked = [], []

    def _on_gradient(self, position, tensor):
        step = self._step
        if step is not None:
            step.on_gradient(position, tensor.grad)

    def disarm(self):
        self._step = None

    def disable(self, reason):
        if self.disabled_reason is None:
            self.disabled_reason = reason
            _logger.info(
                "kdist: gradients are reduced after backward from now on for this model "
                "(no overlap with backward): %s.", reason,
            )


class OverlappedStep:
    """The state of one armed training step: what the hooks saw and which buckets are on their way."""

    def __init__(self, overlap, variables, size, total, summed_loss):
        self._overlap = overlap
        self._processes = overlap._processes
        self._buffers = overlap._buffers
        self._variables = variables
        self._size = size
        self._total = total
        self._summed_loss = summed_loss
        self._positions = {id(v): p for p, v in enumerate(variables)}
        self._remaining = [len(positions) for positions in self._buffers.bucket_positions]
        self._next_bucket = 0
        self._works = []
        self._seen = {}
        self._spoiled = None
        # Set by the engine in the replica's thread, after loss divisors start recording.
        self._records = None
        self._records_at_first = None
        self._weight = None
        self._divides = False
        self._call = None
        self._fell_back = False
        # Set by `finish` for the engine: the control vector, the buckets still
        # travelling, and the replica weights of this step.
        self.tensor = self.pending = self.weights = None
        # The sum of every rank's weight c, once the control vector has arrived.
        self.weight_total = None

    def capture_denominators(self):
        """Called in the training thread as the replica's step starts."""
        self._records = loss_denominators.current_records()

    # ----- during backward (hooks) ----------------------------------------------
    def on_gradient(self, position, grad):
        if position in self._seen or grad is None:
            self._spoil("a gradient arrived twice in one step (two backward passes)")
            return
        if self._weight is None:
            self._weight = self._first_weight()
        view = self._buffers.views[position]
        with torch.no_grad():
            torch.mul(grad.detach(), self._weight, out=view)
        self._seen[position] = (grad, grad._version)
        bucket = self._buffers.bucket_of[position]
        self._remaining[bucket] -= 1
        self._start_ready_buckets()

    def _first_weight(self):
        records = self._records
        self._records_at_first = None if records is None else len(records)
        if self._summed_loss:
            return 1.0 if self._size else 0.0
        denominator = None if records is None else loss_denominators.summarise(records)
        if denominator is None:
            return self._size / self._total
        # D / N, divided by its sum over ranks after the reduction. Whether a
        # divisor is known depends on the model only, so every rank divides
        # alike, a stand-in replica (no samples, weight 0) included.
        self._divides = True
        if not self._size:
            return torch.zeros((), dtype=torch.float64, device=denominator.device)
        return denominator.to(torch.float64) / self._total

    def _start_ready_buckets(self, everything=False):
        flats = self._buffers.flats
        while self._next_bucket < len(flats) and (everything or self._remaining[self._next_bucket] == 0):
            if self._remaining[self._next_bucket]:
                # Variables without a gradient this step travel as zeros.
                for position in self._buffers.bucket_positions[self._next_bucket]:
                    if position not in self._seen:
                        self._buffers.views[position].zero_()
            self._works += self._processes.start_bucket(flats[self._next_bucket], "gradients")
            self._next_bucket += 1

    def _spoil(self, reason):
        if self._spoiled is None:
            self._spoiled = reason

    # ----- after the step -----------------------------------------------------------
    def finish(self, recorders):
        """Completes the step after the replica ran; every rank decides alike.

        Where the gradients need no division (the usual case), the control
        vector travels in the state all-reduce the engine makes anyway (one
        round trip, as without overlap): this returns `(None, self)`, and the
        engine passes `self` to `reconcile`, which calls `arrive` with the
        reduced vector before assigning anything; then `updates()`.
        Otherwise the control is reduced here: `(combined, None)`, combined
        being `(updates, pending, weights)` as `gradient_combine.combine_recorded`
        returns them, or None when the step must be combined after backward.

        Raises:
            ReplicaGradientError: a variable has a gradient on some ranks only.
        """
        calls = recorders[0].calls
        if len(calls) != 1:
            self._spoil(f"train_step called optimizer.apply {len(calls)} times")
        else:
            self._call = calls[0]
            if not self._overlap._engine.faults.overlap_ignores_changed_gradients:
                self._check_call(self._call)
        if self._records is not None and self._records_at_first is not None and len(self._records) != self._records_at_first:
            self._spoil("a loss was computed after backward started, before optimizer.apply")
        self._start_ready_buckets(everything=True)
        self.tensor = self._control_vector()
        shares = [self._size / self._total]
        if not self._divides:
            self.pending, self._works = self._works, []
            self.weights = loss_denominators.ReplicaWeights(shares, shares, self._total)
            return None, self
        works, self._works = self._works + self._processes.start_bucket(self.tensor, "overlap_control"), []
        self._processes.wait(works)
        self.arrive(self.tensor)
        weight_total = self.weight_total
        if self._fell_back or not weight_total > 0:
            # Unknown divisors on some rank: the post-backward path falls back to sample counts.
            return None, None
        updates = self.updates()
        ((_, variables, full),) = updates
        torch._foreach_div_([g for g in full if g is not None], weight_total)
        local = float(self._weight) if self._size else 0.0
        weights = loss_denominators.ReplicaWeights([local / weight_total], shares, self._total)
        return (updates, [], weights), None

    def arrive(self, control):
        """Reads the reduced control vector; raises before the engine assigns anything.

        Raises:
            ReplicaGradientError: a variable has a gradient on some ranks only.
        """
        values = control.cpu().tolist()  # one host copy; indexing a tensor per variable costs microseconds each
        world_size = self._processes.world_size
        for position, count in enumerate(values[2:]):
            if 0 < count < world_size:
                raise ReplicaGradientError(
                    f"Variable '{self._variables[position].path}' has a gradient on {count:g} of "
                    f"{world_size} processes. Every process must compute gradients for the same "
                    "variables; usual cause: a train_step whose control flow depends on the data."
                )
        self._fell_back = values[1] > 0
        if self._fell_back:
            self._overlap.disable(self._spoiled or "another process could not overlap this step")
        self.weight_total = values[0]

    def updates(self):
        """`[(optimizer, variables, reduced gradients)]` once arrived, or None: combine after backward."""
        if self._fell_back:
            return None
        optimizer, gradients, variables, _ = self._call
        positions = [self._positions[id(v)] for v in variables]
        self._buffers.decompress([p for p, g in zip(positions, gradients) if g is not None])
        outputs = self._buffers.outputs
        return [(optimizer, variables, [None if g is None else outputs[p] for p, g in zip(positions, gradients)])]

    def _check_call(self, call):
        _, gradients, variables, _ = call
        for variable, grad in zip(variables, gradients):
            position = self._positions.get(id(variable))
            seen = self._seen.get(position)
            if position is None and grad is not None:
                self._spoil(f"optimizer.apply received variable '{variable.path}', which is not trainable")
            elif grad is None:
                if seen is not None:
                    self._spoil(f"train_step dropped the gradient of '{variable.path}'")
            elif seen is None or seen[0] is not grad or grad._version != seen[1]:
                self._spoil(
                    f"the gradient of '{variable.path}' handed to optimizer.apply is not the one "
                    "backward produced (train_step changed or replaced it)"
                )

    def _control_vector(self):
        """`[c, 1 if this rank cannot overlap, per variable: 1 if it has a gradient]` (float64, to be summed)."""
        values = [0.0, 0.0 if self._spoiled is None else 1.0] + [0.0] * len(self._variables)
        for position in self._seen:
            values[2 + position] = 1.0
        control = torch.tensor(values, dtype=torch.float64, device=self._processes.device)
        if self._divides and self._weight is not None:
            control[0] = self._weight  # a 0-d tensor: no host sync
        return control

    def drain(self):
        """Waits for the step's buckets (a step that ends early in merge mode, alike on every rank).

        Every bucket is started, so every rank has made the same calls
        whichever hooks fired.
        """
        self._start_ready_buckets(everything=True)
        works, self._works = self._works, []
        self._processes.wait(works)
