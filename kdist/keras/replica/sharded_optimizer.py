"""Optimizer state sharded across the processes of a job (ZeRO-1): `shard_optimizer_state=True`.

`kdist.MultiWorkerMirroredStrategy(shard_optimizer_state=True)` gives each of
the N processes the optimizer slots (moments, accumulators, averages) of its
1/N of the model's trainable elements only (`optimizer_shards.plan_shards`).
A step reduces the gradients as before, so every rank holds the whole reduced
gradient; each rank applies the optimizer to its slice
(`optimizer_shards.OptimizerShard`), then one all-gather per dtype hands every
rank the others' updated slices, so every rank ends the step with the whole,
identical model. The update of every element is the arithmetic of the
unsharded optimizer, so the weights are bitwise those of the unsharded strategy.

The user's optimizer object stays the one Keras knows: its config, step count
and learning rate are its own; it is marked built without slots
(`optimizer.variables` lists its step count and learning rate only). What
reads or writes the whole state goes through this module:

- `save_own_variables` (every Keras save: `model.save`, `save_weights`,
  `ModelCheckpoint`, `BackupAndRestore`) writes the whole optimizer's variables
  in Keras' order, gathered from every rank: the file is the one an unsharded
  job writes, which plain Keras loads. kdist's collective saves gather on every
  rank before the chief writes (`gathered_for_saving`); a save every rank
  makes itself (`keras.saving.save_model`) gathers inside it.
- `load_own_variables` cuts each whole slot to this rank's slice, so a
  checkpoint resumes on any number of processes, and an unsharded job's
  checkpoint loads here.
- `finalize_variable_values` (the end of `fit`): with `use_ema`, each rank
  writes its slices' averages and the ranks gather them.

Gradient accumulation keeps its one reduction per applied update
(`gradient_accumulation`): pending sums folded in before a save are added to
each rank's slices of the accumulators (`add_to_accumulators`). Optimizers that cannot be split are refused when the model is
compiled (`optimizer_shards.check_shardable`).
"""

import contextlib
import functools
import warnings

import keras
import numpy as np
import torch

from kdist import faults
from kdist.errors import InvalidArgumentError, UnsupportedError
from kdist.keras import _compat, adapters
from kdist.keras.replica import optimizer_shards

_STATE = "_kdist_sharded_state"  # on the optimizer whose slots are sharded
_SAVED_BY = "_kdist_sharded_saving"  # on the model's optimizer, which saves them


def state_of(optimizer):
    """The `ShardedOptimizerState` of `optimizer` if its own slots are sharded (not a wrapper's), else None."""
    return getattr(optimizer, _STATE, None)


def sharded_target(optimizer):
    """The optimizer whose slots are sharded when `optimizer` is the model's: its inner one for a `LossScaleOptimizer`.

    The loss-scale wrapper keeps its own logic (the finite check over the
    whole gradient, which every rank holds, and its scale): every rank takes
    the same branch and its inner optimizer updates the rank's slices.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def install(optimizer, strategy):
    """Shards the state of the model's `optimizer` over `strategy`'s processes (at attach). Idempotent.

    Raises:
        kdist.errors.UnsupportedError: the optimizer's update is not element-wise
            (`optimizer_shards.check_shardable`), or it already belongs to
            another strategy's sharding.
        kdist.errors.InvalidArgumentError: the optimizer was built (and holds
            its whole state) before the model was compiled in the scope.
    """
    if optimizer is None:
        return None
    collectives = strategy.extended.collectives
    target = sharded_target(optimizer)
    state = state_of(target)
    if state is not None:
        if state.collectives is not collectives:
            raise UnsupportedError(
                f"optimizer: {optimizer.name!r} already shards its state across another strategy's "
                "processes. Received: the same optimizer compiled under a second "
                "MultiWorkerMirroredStrategy(shard_optimizer_state=True). Expected: a new optimizer.")
        return state
    check(optimizer)
    state = ShardedOptimizerState(target, collectives, saved_by=optimizer)
    object.__setattr__(target, _STATE, state)
    object.__setattr__(optimizer, _SAVED_BY, state)
    for name in ("build", "finalize_variable_values"):
        object.__setattr__(target, name, getattr(state, name))
    if target is not optimizer:
        # The wrapper calls its inner optimizer's `apply` itself, with the unscaled gradients.
        object.__setattr__(target, "apply", state.apply)
    else:
        # Routed as before (replicas record, merge mode merges); the final `apply` is the shard's.
        adapters.apply_through(optimizer, state.apply)
    # Keras saves a LossScaleOptimizer's variables (its own and its inner one's), then the inner one's again.
    for owner in {id(optimizer): optimizer, id(target): target}.values():
        for name in ("save_own_variables", "load_own_variables"):
            object.__setattr__(owner, name, functools.partial(getattr(state, name), owner=owner))
    if target.built:  # built with no slots (SGD without momentum): shard what it knows
        state.build(_compat.optimizer_trainable_variables(target))
    return state


def check(optimizer):
    """Raises when the state of the model's `optimizer` cannot be sharded (see `install`); changes nothing."""
    target = sharded_target(optimizer)
    if state_of(target) is not None:
        return
    optimizer_shards.check_shardable(target)
    own = optimizer_shards.own_variables(target)
    if target.built and len(target.variables) > len(own):
        raise InvalidArgumentError(
            f"optimizer: {optimizer.name!r} was already built and holds its whole state "
            f"({len(target.variables) - len(own)} slot variables), so it cannot be sharded. Received: "
            "a built optimizer with shard_optimizer_state=True. Expected: an optimizer not yet used, "
            "e.g. compile(optimizer='adam') or a new keras.optimizers instance, inside the scope.")


@contextlib.contextmanager
def gathered_for_saving(model, writes=True):
    """While active, `model`'s sharded optimizer saves the whole state gathered on entry.

    A collective: every rank enters it at the same point, before the chief
    writes (the other ranks wait for it and so cannot take part in a gather
    made inside the write). `writes`: whether this rank writes a file; a rank
    that does not takes part in the gather without keeping the whole state.
    Nothing happens for an optimizer with whole state.
    """
    state = getattr(getattr(model, "optimizer", None), _SAVED_BY, None)
    if state is None or state.shard is None:
        yield
        return
    slots = state.whole_slots(keep=writes)
    state.saving_values = slots if writes else None
    try:
        yield
    finally:
        state.saving_values = None


class ShardedOptimizerState:
    """The sharded state of one optimizer in one process (see module doc).

    Its `build` and `finalize_variable_values` replace those of the sharded
    optimizer on the instance, and `save_own_variables`/`load_own_variables`
    those of the model's optimizer (`saved_by`: the same one, or the
    `LossScaleOptimizer` around it). `apply` is what the optimizer's routed
    `apply` finally runs (`adapters.apply_through`), or what the wrapper's own
    `apply` calls.

    Args:
        optimizer: the optimizer whose slots are sharded.
        collectives: the job's `kdist.collectives.process.ProcessCollectives`.
        saved_by: the model's optimizer, whose saved variables are its own
            followed by the sharded optimizer's slots (Keras' order).
    """

    def __init__(self, optimizer, collectives, saved_by=None):
        self.optimizer = optimizer
        self.saved_by = saved_by if saved_by is not None else optimizer
        self.collectives = collectives
        self.shard = None  # optimizer_shards.OptimizerShard, once built
        self.plan = None
        self._ranges = None  # per rank: {variable index: (start, stop)} of the elements it owns
        self.saving_values = None
        self._index = {}

    # ----- Keras' optimizer methods, on the instance ---------------------------
    def build(self, variables):
        """Plans the shards of `variables` and builds this rank's slice optimizer; Keras' state stays empty."""
        if self.shard is not None:
            return
        variables = list(variables)
        sizes = [int(np.prod(variable.shape)) for variable in variables]
        self.plan = optimizer_shards.plan_shards(sizes, self.collectives.world_size)
        self.shard = optimizer_shards.OptimizerShard(self.optimizer, variables, self.plan[self.collectives.rank])
        self._index = {id(variable): index for index, variable in enumerate(variables)}
        self._ranges = [{piece.index: (piece.start, piece.stop) for piece in pieces} for pieces in self.plan]
        _compat.mark_optimizer_built(self.optimizer, variables)

    def save_own_variables(self, store, owner=None):
        """`owner.save_own_variables`: its whole variables in Keras' order (a collective unless gathered already).

        `owner`: the model's optimizer (default) or, under a `LossScaleOptimizer`,
        the inner one, which Keras saves again on its own.
        """
        owner = self.saved_by if owner is None else owner
        if self.shard is None:
            type(owner).save_own_variables(owner, store)
            return
        for index, value in enumerate(self.whole_values(owner)):
            store[str(index)] = value

    def load_own_variables(self, store, owner=None):
        """`owner.load_own_variables`: reads whole variables and keeps this rank's slices of the slots."""
        owner = self.saved_by if owner is None else owner
        if self.shard is None:
            type(owner).load_own_variables(owner, store)
            return
        # What `owner` lists (its own, the sharded one's step count and rate), then the slots.
        own = list(owner.variables)
        slots = self.shard.slot_variables
        expected = len(own) + len(slots)
        if len(store.keys()) != expected:
            warnings.warn(
                f"Skipping variable loading for optimizer '{owner.name}', because it has {expected} "
                f"variables whereas the saved optimizer has {len(store.keys())} variables. ", stacklevel=2)
            return
        values = [np.asarray(store[str(index)]) for index in range(expected)]
        cut = []
        for slot, value in zip(slots, values[len(own):]):
            index = self.shard.whole_variable_index(slot)
            if index is None:
                cut.append(value)
                continue
            variable = self.shard.variables[index]
            if value.size != int(np.prod(variable.shape)):
                raise InvalidArgumentError(
                    f"store: the saved optimizer's slot {slot.name!r} of variable {variable.path!r} holds "
                    f"{value.size} elements. Expected: {int(np.prod(variable.shape))} (shape "
                    f"{tuple(variable.shape)}). Nothing was loaded.")
            start, stop = self.shard.ranges[index]
            cut.append(value.reshape(-1)[start:stop])
        for variable, value in zip(own + slots, values[: len(own)] + cut):
            variable.assign(value)

    def finalize_variable_values(self, var_list):
        """With `use_ema`: every rank writes its slices' averages, then the ranks gather them (a collective)."""
        if not self.optimizer.use_ema or self.shard is None:
            return
        shard = self.shard
        shard.refresh()
        shard.inner.finalize_variable_values(shard.slices)
        self._gather_into_variables()

    def add_to_accumulators(self, variables, totals):
        """Adds this rank's slices of `totals` (whole gradient sums of `variables`) to its accumulators."""
        shard = self.shard
        inner_slices = [shard.slices[self._index[id(variable)]] for variable in variables]
        accumulators = _compat.gradient_accumulators(shard.inner, inner_slices)
        with torch.no_grad():
            for accumulator, variable, total in zip(accumulators, variables, totals):
                start, stop = shard.ranges[self._index[id(variable)]]
                part = total.reshape(-1)[start:stop].to(_compat.torch_tensor_of(accumulator).device)
                accumulator.assign(accumulator.value + part)

    # ----- the update ----------------------------------------------------------
    def apply(self, grads, trainable_variables=None):
        """Keras' `apply`, each rank updating its slices, then an all-gather."""
        gradients, variables = list(grads), trainable_variables
        if not gradients:
            return
        if variables is None:
            if self.shard is None:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer must already be built on a "
                    "list of variables. Call `optimizer.build(trainable_variables)` first. ")
            variables = self.shard.variables
        variables = list(variables)
        self.build(variables)
        whole = [None] * len(self.shard.variables)
        for gradient, variable in zip(gradients, variables):
            index = self._index.get(id(variable))
            if index is None:
                raise ValueError(
                    f"Unknown variable: {variable}. This optimizer can only be called for the variables "
                    "it was originally built with.")
            whole[index] = gradient
        applied = [variable for gradient, variable in zip(whole, self.shard.variables)
                   if gradient is not None and not getattr(variable, "overwrite_with_gradient", False)]
        with adapters.unrouted():  # the slice optimizer's `apply` is Keras' own
            self.shard.apply(whole)
            if faults.ACTIVE.optimizer_slice_applied_twice and self.collectives.rank == 0:
                self.shard.apply(whole)
        if applied:
            self._gather_into_variables(skip_last_rank=faults.ACTIVE.optimizer_slice_missed)
            optimizer_shards.apply_constraints(applied)

    # ----- gathers ---------------------------------------------------------------
    def whole_values(self, owner=None):
        """The whole variables of `owner` (default: the model's optimizer) as NumPy arrays, in Keras' order.

        A collective unless `gathered_for_saving` is active: the slots are
        gathered from every rank.
        """
        owner = self.saved_by if owner is None else owner
        own = [np.asarray(variable.numpy()) for variable in owner.variables]
        return own + (self.saving_values if self.saving_values is not None else self.whole_slots())

    def whole_slots(self, keep=True):
        """The whole values of the slots, in `slot_variables`' order (NumPy; a collective).

        With `keep=False` this rank only sends its slices (it holds one chunk
        at a time, not the whole state) and None is returned.
        """
        shard = self.shard
        slots = [(slot, shard.whole_variable_index(slot)) for slot in shard.slot_variables]
        parts, wholes = [], []
        for slot, index in slots:
            if index is not None:  # a slice's slot; the others (scalars) are alike on every rank
                tensor = _compat.torch_tensor_of(slot)
                parts.append((tensor, index))
                size = int(np.prod(shard.variables[index].shape))
                wholes.append(torch.empty(size, dtype=tensor.dtype) if keep else None)
        self._gather(parts, wholes, "optimizer_state")
        if not keep:
            return None
        gathered = iter(wholes)
        return [np.asarray(slot.numpy()) if index is None
                else next(gathered).reshape(tuple(shard.variables[index].shape)).numpy()
                for slot, index in slots]

    def _gather_into_variables(self, skip_last_rank=False):
        """The other ranks' updated slices into the whole variables (this rank's are views, updated in place).

        `skip_last_rank` is the negative control's bug (`faults.optimizer_slice_missed`).
        """
        shard = self.shard
        parts = [(_compat.torch_tensor_of(slice_), index) for index, slice_ in enumerate(shard.slices)]
        targets = [_compat.torch_tensor_of(variable).view(-1) for variable in shard.variables]
        skip = self.collectives.world_size - 1 if skip_last_rank else None
        self._gather(parts, targets, "optimizer_shards", skip_own=True, skip_rank=skip)

    def _gather(self, parts, wholes, name, skip_own=False, skip_rank=None):
        """Every rank's slices into whole flat tensors, in chunks of `bucket_bytes` per rank.

        `parts`: `[(this rank's 1-D slice, variable index)]`, in the same order
        on every rank; each is copied into `wholes[i]` (a flat tensor of the
        variable's size, or None to keep nothing) at every rank's piece. Per dtype, each rank sends its
        slices end to end (padded to the longest rank's length), one chunk per
        all-gather, and each piece is copied from the chunk straight into its
        whole: the temporary memory is `world_size` chunks. `skip_own`: this
        rank's pieces are already in place; `skip_rank`: a rank left out.
        """
        collectives = self.collectives
        here = collectives.rank
        by_dtype = {}
        for position, (tensor, _) in enumerate(parts):
            by_dtype.setdefault(tensor.dtype, []).append(position)
        with torch.no_grad():
            for dtype, positions in by_dtype.items():
                placements, length = _placements(parts, positions, self._ranges)
                itemsize = torch.empty((), dtype=dtype).element_size()
                chunk = max(optimizer_shards.ALIGN, min(length, collectives.options.bucket_bytes // itemsize))
                local = torch.empty(chunk, dtype=dtype, device=collectives.device)
                gathered = torch.empty(collectives.world_size * chunk, dtype=dtype, device=collectives.device)
                for low in range(0, length, chunk):
                    size = min(chunk, length - low)
                    sending = local[:size]
                    sending.zero_()
                    for position, start, stop, offset in placements[here]:
                        a, b = _overlap(low, low + size, offset, stop - start)
                        if a < b:
                            own = parts[position][0].detach()
                            sending[a - low:b - low] = own[a - offset:b - offset].to(collectives.device)
                    received = collectives.all_gather_flat(sending, name=name, out=gathered[: collectives.world_size * size])
                    for rank, pieces in enumerate(placements):
                        if (skip_own and rank == here) or rank == skip_rank:
                            continue
                        for position, start, stop, offset in pieces:
                            a, b = _overlap(low, low + size, offset, stop - start)
                            if a < b and wholes[position] is not None:  # None: not kept here
                                target = wholes[position]
                                source = received[rank * size + a - low:rank * size + b - low]
                                target[start + a - offset:start + b - offset].copy_(source.to(target.device))


def _placements(parts, positions, ranges):
    """Per rank, `[(position, start, stop, offset)]` of its pieces of `parts` laid end to end; the longest length."""
    placements = []
    for owned in ranges:
        placed, offset = [], 0
        for position in positions:
            start, stop = owned.get(parts[position][1], (0, 0))
            if stop > start:
                placed.append((position, start, stop, offset))
                offset += stop - start
        placements.append(placed)
    length = max((p[-1][3] + p[-1][2] - p[-1][1]) if p else 0 for p in placements)
    return placements, length


def _overlap(low, high, offset, length):
    """`[a, b)`: the part of `[offset, offset + length)` inside `[low, high)` (empty when a >= b)."""
    return max(low, offset), min(high, offset + length)
