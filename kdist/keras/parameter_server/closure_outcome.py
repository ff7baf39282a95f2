"""A closure's metric state, kept by the parameter servers with each of its pushes.

A coordinator re-runs a closure whose worker died. Its pushes carry update ids
(`VariableRouter.idempotent_updates`), so those the dead worker delivered are
not applied twice. But the re-run reads the servers' values, in which those
pushes are already applied: the loss and metrics it computes for those steps
would come from the wrong weights, and `fit`'s History would differ from an
uninterrupted run's.

So each push of a closure carries its model's metric state after that step (the
state is cumulative from the closure's `reset_metrics`), as the push's
`outcome`. A server keeps it with the id; a push it deduplicates gets it back,
and the worker puts that state in its metrics in place of what it computed. The
steps after the last delivered one then run on the values the first run left,
from the state it had reached: the closure returns what the first run would
have.

The encoding is the variables' raw bytes in `model.metrics` order (both runs
build the same model from the same closure, so the layout is the same on both
sides); a length that does not match is refused, not guessed.
"""

import logging

import numpy as np

from kdist.ps.wire.values import MAX_OUTCOME_BYTES

logger = logging.getLogger(__name__)
_warned = set()


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def send(router, model, dense, rows, assign):
    """`router.send_gradients(dense, rows, assign)`; in a closure, with `model`'s metric state.

    Inside an `idempotent_updates` block (a closure) the push carries the
    model's metric state, and a push the servers had already applied (the
    closure is a re-run) puts the first run's state back.
    """
    if model is None or not router.in_idempotent_block():
        router.send_gradients(dense, rows, assign)
        return
    metrics = metric_variables(model)
    outcome = encode(metrics)
    if len(outcome) > MAX_OUTCOME_BYTES:
        # Too large to keep: the push goes without it (a re-run would then say so, in `restore`).
        _warn_once(f"The metric state of {model.name!r} is {len(outcome)} bytes, more than a push "
                   f"carries ({MAX_OUTCOME_BYTES}): a closure re-run after its worker died reports "
                   "metrics computed from the weights its first run updated.")
        outcome = b""
    results = router.send_gradients(dense, rows, assign, outcome=outcome)
    replayed = [result for result in results if result.deduplicated]
    if replayed and metrics:
        restore(metrics, replayed[0].outcome)


def metric_variables(model):
    """The state variables of `model.metrics`, in order (loss trackers and compiled metrics)."""
    return [variable for metric in model.metrics for variable in metric.variables]


def encode(variables):
    """The variables' values as one bytes string (C order, each at its own dtype)."""
    return b"".join(np.ascontiguousarray(variable.numpy()).tobytes() for variable in variables)


def restore(variables, outcome, closure=""):
    """Assigns `outcome` (from `encode`) to `variables`; False (with a warning) if it cannot.

    An empty outcome (the first run sent none, or the server no longer holds
    it) or one of another length leaves the metrics as computed, and says so.
    """
    arrays, position = [], 0
    for variable in variables:
        value = np.asarray(variable.numpy())
        size = value.nbytes
        arrays.append(np.frombuffer(outcome[position:position + size], dtype=value.dtype)
                      .reshape(value.shape) if position + size <= len(outcome) else None)
        position += size
    if not outcome or position != len(outcome) or any(array is None for array in arrays):
        logger.warning(
            "A re-run closure%s found a push its first run had applied, but not that run's "
            "metric state (%d bytes kept, %d expected): its metrics for the steps already "
            "applied come from the updated weights.", f" ({closure})" if closure else "",
            len(outcome), position)
        return False
    for variable, array in zip(variables, arrays):
        variable.assign(array)
    return True
