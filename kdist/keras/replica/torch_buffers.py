"""Buffers of torch modules inside `TorchModuleWrapper` layers, kept per replica during a training step.

A torch module's buffers (`BatchNorm`'s `running_mean`, `running_var`,
`num_batches_tracked`, or any buffer a forward pass writes in place) are not
Keras variables, so a replica's `StatelessScope` does not see them: replicas
that share the module would each update them in turn, and a multi-worker
rank only from its own shards. Here they follow the rule `state_sync`
applies to Keras' own non-trainable state (`BatchNormalization`'s moving
statistics):

- every replica starts the step from the buffers' pre-step values: while a
  replica's forward pass runs, the module holds that replica's own copies
  (swapped in by forward hooks on the wrapped module, keyed on the replica
  that the running thread serves, so the merge mode's interleaved replica
  threads each see their own), and torch updates those copies as usual;
- after the step, each floating-point buffer becomes the sample-weighted
  mean of the replicas' post-step values (summed over processes in the
  engine's one state all-reduce); integer and boolean buffers
  (`num_batches_tracked`) take replica 0's value, which advanced once, as on
  one device.

With equal shards `running_mean` then equals one device's value on the
whole batch (the mean of the shards' means is the batch mean);
`running_var` averages the shards' variances (it is not `SyncBatchNorm`),
exactly as for Keras' `BatchNormalization`.

`evaluate` and `predict` leave the buffers alone (wrapped modules run in
eval mode there). A model without `TorchModuleWrapper` layers pays one walk
of its layers per `fit`/`evaluate`/`predict` call and nothing per step.
"""

import threading
import weakref

import torch

from kdist import faults
from kdist.errors import ReplicaSyncError
from kdist.keras._compat.layers import in_stateless_scope, torch_wrapped_modules

# The rule `state_sync.assign` hands back to a `TorchBuffer` plan entry.
RULE = "torch_buffer"

# The replica this thread runs now: `(TorchBuffers, local replica id)` or None.
_current = threading.local()
# Wrapped torch modules whose forward hooks are installed (once per module, for good).
_hooked = weakref.WeakKeyDictionary()


class TorchBuffer:
    """One canonical buffer of a wrapped torch module, as a `state_sync` plan entry.

    Args:
        name: `"<wrapper layer>/<module path>.<buffer>"`, for messages.
        tensor: the module's own buffer tensor (kept; written in place).
    """

    def __init__(self, name, tensor):
        self.name = name
        self.tensor = tensor

    @property
    def averaged(self):
        """Floating-point buffers are averaged; counters and flags take replica 0's value."""
        return self.tensor.is_floating_point() or self.tensor.is_complex()

    def assign(self, combined):
        """Writes the combined float64 value into the module's buffer, in place."""
        with torch.no_grad():
            self.tensor.copy_(combined.to(device=self.tensor.device, dtype=self.tensor.dtype))


class TorchBuffers:
    """The buffers of a model's wrapped torch modules and each replica's copies of them in a step.

    A snapshot of the model's layout, taken with `state_sync.StateVariables`.
    Not thread-safe beyond the engine's use: replicas of one step may run in
    separate threads, one at a time (merge mode).

    Args:
        model: the Keras model.
    """

    def __init__(self, model):
        self.buffers = []
        # root module -> [(submodule, buffer attribute name, index into self.buffers)]
        self._slots = {}
        # local replica id -> that replica's copies, one per entry of self.buffers
        self._copies = {}
        indices = {}
        roots = _outermost(torch_wrapped_modules(model))
        for wrapper_name, root in roots:
            slots = []
            for path, submodule in root.named_modules():
                for attribute, tensor in submodule.named_buffers(recurse=False):
                    if id(tensor) not in indices:
                        indices[id(tensor)] = len(self.buffers)
                        where = f"{wrapper_name}/{path}" if path else wrapper_name
                        self.buffers.append(TorchBuffer(f"{where}.{attribute}", tensor))
                    slots.append((submodule, attribute, indices[id(tensor)]))
            if slots:
                self._slots[root] = slots
                _install_hooks(root)

    def start_replica(self, replica_id, training):
        """Called as a replica's step starts, in the thread that runs it: fresh copies of the buffers.

        A training replica gets copies of the pre-step values (a step run
        again in merge mode starts over); any other step makes the thread's
        forward passes use the module's own buffers.
        """
        if not self._slots:
            return
        if not training or faults.ACTIVE.unsynced_torch_buffers:
            _current.replica = None
            self._copies.clear()
            return
        if any(k >= replica_id for k in self._copies):
            # Replicas start in ascending order: this is a new step, or the
            # same batch run again (merge mode, or after a failed step).
            self._copies.clear()
        with torch.no_grad():
            self._copies[replica_id] = [buffer.tensor.clone() for buffer in self.buffers]
        _current.replica = (self, replica_id)

    def plan_contributions(self, shares, holds_first_replica):
        """Each buffer's plan entry and this process's float64 contribution to its new value.

        Args:
            shares: each replica's share of the global batch by samples, in
                the order the replicas ran (ascending local replica id).
            holds_first_replica: whether this process runs replica 0 of the job.

        Returns:
            `(plan, contributions)`: empty unless a training step ran
            replicas here. Every process of a job returns entries for the
            same buffers, in the same order.

        Raises:
            ReplicaSyncError: the replicas that ran are not the ones weighed.
        """
        if not self._copies:
            return [], []
        replica_ids = sorted(self._copies)
        if len(replica_ids) != len(shares):
            raise ReplicaSyncError(
                f"torch buffers: {len(replica_ids)} replicas ran a wrapped torch module's "
                f"step, but {len(shares)} replicas are weighed."
            )
        copies = [self._copies[k] for k in replica_ids]
        plan, contributions = [], []
        for index, buffer in enumerate(self.buffers):
            values = [replica_copies[index].double() for replica_copies in copies]
            if buffer.averaged:
                contribution = sum((value * w for value, w in zip(values, shares)), torch.zeros_like(values[0]))
            elif holds_first_replica:
                contribution = values[0]
            else:
                contribution = torch.zeros_like(values[0])
            plan.append((buffer, RULE))
            contributions.append(contribution)
        self._copies.clear()
        _current.replica = None
        return plan, contributions

    def swap_in(self, root):
        """Puts this thread's replica copies into `root`'s modules (forward pre-hook)."""
        copies = self._copies.get(_current.replica[1])
        if copies is None:
            return
        for submodule, attribute, index in self._slots.get(root, ()):
            setattr(submodule, attribute, copies[index])

    def swap_out(self, root):
        """Puts the module's own buffers back (forward hook, also after an exception)."""
        for submodule, attribute, index in self._slots.get(root, ()):
            setattr(submodule, attribute, self.buffers[index].tensor)


def _outermost(named_roots):
    """Drops wrapped modules that sit inside another wrapped module (its hooks cover them)."""
    inner = set()
    for _, root in named_roots:
        inner.update(id(m) for m in root.modules() if m is not root)
    seen, kept = set(), []
    for name, root in named_roots:
        if id(root) not in inner and id(root) not in seen:
            seen.add(id(root))
            kept.append((name, root))
    return kept


def _install_hooks(root):
    if root in _hooked:
        return
    _hooked[root] = (
        root.register_forward_pre_hook(_pre_forward),
        root.register_forward_hook(_post_forward, always_call=True),
    )


def _active():
    # Replicas run inside their `StatelessScope`; a call outside one (the user's
    # own `model(x, training=True)` after a step that raised) is plain torch.
    active = getattr(_current, "replica", None)
    return active if active is not None and in_stateless_scope() else None


def _pre_forward(module, args):
    active = _active()
    if active is not None:
        active[0].swap_in(module)


def _post_forward(module, args, output):
    active = _active()
    if active is not None:
        active[0].swap_out(module)
