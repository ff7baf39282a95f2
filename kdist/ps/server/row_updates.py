"""Row gradients on a server: touched rows only where that is exact, or where asked.

A row gradient `(ids, rows)` is what a batch's embedding lookup produces: the
rows of a table it read. Keras' own update takes the dense gradient (zeros
except those rows, duplicate ids summed). Which of the two a server uses:

- **sparse-exact**: optimizers under which a zero gradient leaves a row and
  its slots unchanged (`SGD` with `momentum=0`, `Adagrad` with
  `initial_accumulator_value > 0` or `epsilon > 0`, neither with
  `weight_decay`, EMA or gradient accumulation). The server sums duplicate
  ids, gathers the touched rows of the variable and of each slot, runs the
  variable's own Keras optimizer on them (so the numbers are Keras'), and
  scatters them back. `iterations` advances once per push, as before.
- **dense**: every other optimizer under `sparse_updates="exact"` (Adam,
  AdamW, RMSprop, SGD with momentum, any weight decay, custom optimizers):
  Keras' dense update, run on a table-sized gradient buffer that is allocated
  once per variable and re-zeroed after each update at the rows written.
- **lazy** (`sparse_updates="lazy"`, opted into on
  `kdist.ParameterServerStrategy`): the sparse path for Adam, AdamW, RMSprop
  and SGD with momentum too (TensorFlow Addons' `LazyAdam` semantics): slots
  of untouched rows do not decay, weight decay reaches touched rows only, and
  bias correction uses the variable's global `iterations`. Different from
  one device, by choice.
"""

import numpy as np
import torch

from kdist import faults
from kdist.errors import InvalidArgumentError
from kdist.rpc import dtypes

# Keras optimizer classes whose update is elementwise per row, given their slots
# are shaped like the variable: the lazy mode may run them on gathered rows.
_ROW_LOCAL_CLASSES = ("SGD", "Adagrad", "Adam", "AdamW", "RMSprop")


def check_row_ids(entry, ids, what):
    """Raises unless every id of the int64 array `ids` indexes a row of `entry`.

    Raises:
        kdist.errors.InvalidArgumentError: naming the variable, the first bad
            id and the number of rows V.
    """
    num_rows = entry.shape[0]
    if ids.dtype != np.int64:
        raise InvalidArgumentError(
            f"{entry.describe(what)}: row ids must be int64. Received: ids of dtype "
            f"{ids.dtype.name}. Expected integer ids in [0, {num_rows}); nothing was applied."
        )
    if not ids.size:
        return
    bad = (ids < 0) | (ids >= num_rows)
    if bad.any():
        position = int(np.argmax(bad.ravel()))
        raise InvalidArgumentError(
            f"{entry.describe(what)}: row id {int(ids.ravel()[position])} is out of range for "
            f"V={num_rows} rows. Received: {int(bad.sum())} id(s) outside [0, {num_rows}), the "
            f"first at position {position}. Expected ids in [0, {num_rows}); nothing of this "
            "request was applied."
        )


def sparse_refusal(optimizer, variable, slots, mode):
    """Why row gradients cannot be applied to the touched rows only; None: they can.

    Args:
        optimizer: the variable's built Keras optimizer.
        variable: the server's `keras.Variable`.
        slots: the optimizer's slots of `variable`.
        mode: "exact" or "lazy".
    """
    name = type(optimizer).__name__
    builtin = type(optimizer).__module__.startswith("keras.") and name in _ROW_LOCAL_CLASSES
    if not builtin:
        return f"{name} is not one of Keras' {', '.join(_ROW_LOCAL_CLASSES)}"
    if optimizer.use_ema or optimizer.gradient_accumulation_steps or optimizer.global_clipnorm:
        return "use_ema, gradient_accumulation_steps and global_clipnorm need every row"
    if not variable.shape or any(tuple(slot.shape) != tuple(variable.shape) for slot in slots):
        return "a slot is not shaped like the variable"
    if mode == "lazy":
        return None
    if optimizer.weight_decay:
        return "weight decay moves every row"
    if name == "SGD" and optimizer.momentum == 0:
        return None
    if name == "Adagrad" and (optimizer.initial_accumulator_value > 0 or optimizer.epsilon > 0):
        # With both 0, Keras' dense update turns an untouched row into 0/0 = NaN.
        return None
    return f"{name} with this config moves rows whose gradient is zero"


class RowUpdates:
    """Applies row gradients through one `VariableOptimizer`. Not thread-safe (variable lock).

    Args:
        host: the `kdist.ps.server.optimizer_host.VariableOptimizer`.
        sparse: apply to the touched rows only (see `sparse_refusal`).
        builtin: the optimizer is Keras' own, known not to change its
            gradient in place, so a dense gradient buffer may be reused.
    """

    def __init__(self, host, sparse, builtin):
        self.host = host
        self.sparse = sparse
        self._reuse_buffer = builtin
        self._zeros = None  # the dense path's gradient buffer, zero between updates

    def apply(self, ids, rows):
        """Applies the row gradient; returns the number of distinct rows it updated."""
        index = torch.from_numpy(ids)
        values = dtypes.to_torch(rows)
        if self.sparse:
            return self._apply_sparse(index, values)
        return self._apply_dense(index, values)

    def _apply_dense(self, index, values):
        variable = self.host.variable.value
        if not self._reuse_buffer:
            dense = torch.zeros(variable.shape, dtype=variable.dtype)
            dense.index_add_(0, index, values)  # sums repeated ids, as ops.take's gradient does
            self.host.apply(dense)
            return int(torch.unique(index).numel())
        if self._zeros is None or self._zeros.shape != variable.shape:
            self._zeros = torch.zeros(variable.shape, dtype=variable.dtype)
        dense = self._zeros
        dense.index_add_(0, index, values)
        try:
            self.host.apply(dense)
        finally:
            dense.index_fill_(0, index, 0)  # zero again at the rows written, not the whole table
        return int(torch.unique(index).numel())

    def _apply_sparse(self, index, values):
        unique, inverse = torch.unique(index, return_inverse=True)
        summed = torch.zeros((unique.numel(),) + tuple(values.shape[1:]), dtype=values.dtype)
        summed.index_add_(0, inverse, values)
        unique, summed = _injected_faults(index, values, unique, summed)
        # The optimizer's own update runs on the gathered rows: the variable's
        # and its slots' tensors are swapped for those rows during the call
        # (Keras' torch updates read `variable.value` and never its shape).
        parameters = [self.host.variable.value] + [slot.value for slot in self.host.slots]
        tables = [parameter.data for parameter in parameters]
        gathered = [table.index_select(0, unique) for table in tables]
        try:
            for parameter, part in zip(parameters, gathered):
                parameter.data = part
            self.host.apply(summed)
        finally:
            for parameter, table in zip(parameters, tables):
                parameter.data = table
        for table, part in zip(tables, gathered):
            table.index_copy_(0, unique, part)
        return int(unique.numel())


def _injected_faults(index, values, unique, summed):
    if faults.ACTIVE.unsummed_duplicate_ids:
        # One occurrence per id (the last): duplicates not summed.
        summed = torch.zeros_like(summed)
        summed[torch.searchsorted(unique, index)] = values
    if faults.ACTIVE.dropped_row_gradient and unique.numel():
        unique, summed = unique[1:], summed[1:]
    if faults.ACTIVE.row_applied_twice and unique.numel():
        summed = summed.clone()
        summed[0] *= 2
    return unique, summed
