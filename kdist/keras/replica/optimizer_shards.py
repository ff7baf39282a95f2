"""Optimizer-state sharding's arithmetic (ZeRO-1, issue 35): an optimizer applied to one rank's slice.

Each of N ranks owns a contiguous slice of the model's trainable elements, laid
out flat (`plan_shards`), keeps the optimizer's slots for that slice only, and
applies the optimizer to it (`OptimizerShard`); the ranks then exchange their
updated slices so that each holds the whole model. This module is the part
that needs no communication: which elements a rank owns, and one rank's update
of them. It is exact by construction where the optimizer's update is
element-wise, because every element then goes through the same float operations
whichever rank computes it:

- what reads whole gradients is done on the whole (reduced) gradients first,
  exactly as Keras' `apply` does it: the loss-scale division, then `clipnorm`,
  `global_clipnorm` or `clipvalue`; the slice's optimizer has them off;
- each rank's slice optimizer is the user's optimizer rebuilt from its config,
  with the same step count and learning rate before every update (a schedule
  reads the step; a callback may have set the rate), and the weight-decay
  exclusions of the variables its slices come from;
- variables Keras overwrites with their gradient (float8 scales) are assigned
  whole, not sliced, as Keras does; constraints read whole variables and are
  applied once the slices are put back (`apply_constraints`);
- slices start at multiples of `ALIGN` elements from their variable's start, so
  a vectorised kernel handles each element in the same lane and loop as on the
  whole tensor.

Refused with `UnsupportedError` (`check_shardable`): optimizers whose update
reads a whole tensor (Adafactor's factored moments, Muon's orthogonalisation),
whose update is not exactly rounded per element (Ftrl's `pow`, see `ELEMENT_WISE`),
or that wrap another (a `LossScaleOptimizer` is sharded through its inner
optimizer by `sharded_optimizer`, not here), and gradient accumulation together with clipping (Keras clips the accumulated
gradient, which no rank holds whole).
"""

import dataclasses
import math

import keras
import numpy as np

from kdist.errors import InvalidArgumentError, UnsupportedError
from kdist.keras import _compat

# Elements: a slice starts at a multiple of this from its variable's start (the
# widest CPU vector of float32 is 16 lanes; 64 leaves room for unrolled loops).
ALIGN = 64
# Optimizers whose update of an element reads only that element's gradient, slots and value.
# Ftrl is element-wise too, but raises each element to a power: torch's vectorised and
# scalar `pow` differ in the last bit, and which elements take which path depends on
# where a tensor starts and how it is split across threads, so a slice would not equal
# the whole bit for bit (seen on 90,300 elements). Only exactly rounded operations
# (+, -, *, /, sqrt, sign, max) are in the updates of these:
ELEMENT_WISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Nadam", "Lion")
_CLIPPING = ("clipnorm", "global_clipnorm", "clipvalue")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements `[start, stop)` of trainable variable `index`, flattened in C order."""

    index: int
    start: int
    stop: int


def plan_shards(sizes, num_ranks, align=ALIGN):
    """Which elements each of `num_ranks` ranks owns: a list of `Piece`s per rank.

    The variables (`sizes`: their element counts, in order) are laid end to end,
    each starting at a multiple of `align`, and the padded length is cut into
    `num_ranks` runs of equal length (a multiple of `align`): balanced by
    elements to within `align` per variable, every element owned once.

    Example:

    >>> plan_shards([200, 10], 2, align=64)
    [[Piece(index=0, start=0, stop=192)], [Piece(index=0, start=192, stop=200), Piece(index=1, start=0, stop=10)]]
    """
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise InvalidArgumentError(f"num_ranks must be an integer >= 1. Received: num_ranks={num_ranks!r}.")
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += math.ceil(size / align) * align
    run = math.ceil(total / align / num_ranks) * align
    plan = []
    for rank in range(num_ranks):
        low, high = rank * run, min(total, (rank + 1) * run)
        pieces = []
        for index, (offset, size) in enumerate(zip(offsets, sizes)):
            start, stop = max(low, offset) - offset, min(high, offset + size) - offset
            if stop > start:
                pieces.append(Piece(index, start, stop))
        plan.append(pieces)
    return plan


def check_shardable(optimizer):
    """Raises UnsupportedError for an optimizer whose update cannot be split by elements (see module doc)."""
    name = type(optimizer).__name__
    if name not in ELEMENT_WISE or not isinstance(optimizer, getattr(keras.optimizers, name)):
        raise UnsupportedError(
            f"Optimizer state can be sharded for optimizers whose update is element-wise: "
            f"{', '.join(ELEMENT_WISE)}. Received: {name}, whose update reads whole tensors or wraps "
            "another optimizer. Train it with shard_optimizer_state=False.")
    clipping = [key for key in _CLIPPING if getattr(optimizer, key, None)]
    if optimizer.gradient_accumulation_steps and clipping:
        raise UnsupportedError(
            "With gradient_accumulation_steps, Keras clips the accumulated gradient, which no rank holds "
            f"whole when optimizer state is sharded. Received: gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps} with {clipping[0]}={getattr(optimizer, clipping[0])}.")


class OptimizerShard:
    """One rank's optimizer over its `pieces` of `variables` (see module doc).

    The slice optimizer (`inner`) is built on one flat slice per variable, in
    the variables' order: this rank's piece of it, or an empty slice where the
    rank owns none of it. Its variables then line up one for one with those a
    whole optimizer built on `variables` would have (`whole_variable_index`),
    which is what lets the ranks' slots be gathered into an ordinary checkpoint
    and a checkpoint be cut into slots again.

    Args:
        optimizer: the user's optimizer (it keeps its config, step count and
            learning rate; it is given no slots).
        variables: the model's trainable variables, in the plan's order.
        pieces: this rank's `Piece`s (`plan_shards(...)[rank]`).
    """

    def __init__(self, optimizer, variables, pieces):
        check_shardable(optimizer)
        self.optimizer = optimizer
        self.variables = list(variables)
        self.pieces = list(pieces)
        owned = {piece.index: piece for piece in self.pieces}
        if len(owned) != len(self.pieces):
            raise InvalidArgumentError(
                f"pieces: a rank owns at most one contiguous piece of each variable. Received: {self.pieces!r}.")
        # (start, stop) of this rank's elements of each variable; (0, 0) where it owns none.
        self.ranges = [(owned[i].start, owned[i].stop) if i in owned else (0, 0)
                       for i in range(len(self.variables))]
        config = optimizer.get_config()
        config.update({key: None for key in _CLIPPING}, loss_scale_factor=None)
        self.inner = type(optimizer).from_config(config)
        self.slices = [
            keras.Variable(np.zeros(stop - start, keras.backend.standardize_dtype(variable.dtype)),
                           name=variable.name)
            for variable, (start, stop) in zip(self.variables, self.ranges)
        ]
        self.refresh()
        excluded = [slice_ for slice_, variable in zip(self.slices, self.variables)
                    if not _compat.uses_weight_decay(optimizer, variable)]
        if excluded:
            self.inner.exclude_from_weight_decay(var_list=excluded)
        # id(slot) -> index of the variable whose slice it was made from.
        self.references = _build_recording_references(self.inner, self.slices)

    @property
    def slot_variables(self):
        """The slots this rank holds (its slices' moments, accumulators, EMA...)."""
        own = own_variables(self.inner)
        return [variable for variable in self.inner.variables if not any(variable is o for o in own)]

    def apply(self, gradients):
        """Updates this rank's pieces from the whole, reduced `gradients` (one per variable, or None).

        Returns the updated values of the pieces, flat, in order. The slices
        are views of the variables (`refresh`), so this rank's elements of the
        variables are updated in place; the other ranks' elements are not
        touched, except where Keras overwrites a variable with its gradient.
        Call once per step on every rank, with the same gradients.
        """
        optimizer = self.optimizer
        pairs = [(gradient, variable) for gradient, variable in zip(gradients, self.variables)
                 if gradient is not None]
        for gradient, variable in pairs:
            if getattr(variable, "overwrite_with_gradient", False):
                variable.assign(gradient)
        whole = {id(variable): gradient for gradient, variable in pairs
                 if not getattr(variable, "overwrite_with_gradient", False)}
        self.refresh()
        if whole:
            scale = optimizer.loss_scale_factor
            if scale is not None:
                whole = {key: gradient / scale for key, gradient in whole.items()}
            if not optimizer.gradient_accumulation_steps:
                keys = list(whole)
                whole = dict(zip(keys, _compat.clip_gradients(optimizer, [whole[key] for key in keys])))
            self._sync_hyperparameters()
            slice_gradients, slices = [], []
            # Empty slices too: every rank applies to the same variables, so
            # per-apply state (Nadam's momentum product) advances alike everywhere.
            for (start, stop), slice_, variable in zip(self.ranges, self.slices, self.variables):
                gradient = whole.get(id(variable))
                if gradient is not None:
                    slice_gradients.append(keras.ops.reshape(gradient, (-1,))[start:stop])
                    slices.append(slice_)
            self.inner.apply(slice_gradients, slices)
        _compat.iterations_variable(optimizer).assign_add(1)
        return [self.slices[piece.index].value for piece in self.pieces]

    def refresh(self):
        """Makes every slice this rank's elements of its variable: a view of the variable's own storage.

        The slice optimizer then updates the model's elements in place, with
        no copy either way and no second copy held. A variable whose storage
        was replaced since (Keras' `assign` writes in place, so this is rare)
        is viewed again.
        """
        for (start, stop), slice_, variable in zip(self.ranges, self.slices, self.variables):
            if stop > start:
                whole = _compat.torch_tensor_of(variable)
                if not whole.is_contiguous():
                    raise UnsupportedError(
                        f"Optimizer state can be sharded for variables stored contiguously. Received: "
                        f"{variable.path!r}, whose torch tensor has strides {whole.stride()} for shape "
                        f"{tuple(whole.shape)}. Train it with shard_optimizer_state=False.")
                part = _compat.torch_tensor_of(slice_)
                if part.data_ptr() != whole.data_ptr() + start * whole.element_size():
                    part.data = whole.detach().view(-1)[start:stop]

    def whole_variable_index(self, variable):
        """Index of `variable` (one of `inner.variables`) among the model's variables, or None if not a slice's slot."""
        return self.references.get(id(variable))

    def _sync_hyperparameters(self):
        optimizer, inner = self.optimizer, self.inner
        _compat.iterations_variable(inner).assign(_compat.iterations_variable(optimizer))
        rate = _compat.learning_rate_variable(optimizer)
        if rate is not None:
            _compat.learning_rate_variable(inner).assign(rate)
        for key, value in vars(optimizer).items():
            # Plain numbers a user or callback may change between steps (beta_1, weight_decay, ...).
            if not key.startswith("_") and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and key not in _CLIPPING and key != "loss_scale_factor" and hasattr(inner, key):
                setattr(inner, key, value)


def _build_recording_references(inner, slices):
    """Builds `inner` on `slices`; returns {id(slot): index of the slice it was made from}."""
    positions = {id(slice_): index for index, slice_ in enumerate(slices)}
    references = {}
    original = inner.add_variable_from_reference

    def recording(reference_variable, *args, **kwargs):
        slot = original(reference_variable, *args, **kwargs)
        index = positions.get(id(reference_variable))
        if index is not None:
            references[id(slot)] = index
        return slot

    object.__setattr__(inner, "add_variable_from_reference", recording)
    try:
        inner.build(slices)
    finally:
        object.__delattr__(inner, "add_variable_from_reference")
    return references


def own_variables(optimizer):
    """An optimizer's variables that are not slots: its step count and learning rate (when a variable)."""
    return [v for v in (_compat.iterations_variable(optimizer), _compat.learning_rate_variable(optimizer))
            if v is not None]


def apply_constraints(variables):
    """Keras' constraints, on the whole variables once every piece is back (as `apply` ends)."""
    for variable in variables:
        if variable.constraint is not None:
            variable.assign(variable.constraint(variable))
