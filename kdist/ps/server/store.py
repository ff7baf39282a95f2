"""The variable store of one parameter server: values, versions, locks, counters.

Glossary:

- **version**: how many times a variable changed on this server (an applied
  gradient or an assignment adds one); a new variable has version 0.
- **staleness** of a gradient: the server's version before applying it minus
  the version the gradient was computed from.

Thread-safe. Each variable has its own lock; a gradient is applied, or a value
read, entirely under it. Calls that need several variables at once take their
locks in sorted name order, so they never deadlock. Requests are validated in
full before anything changes (see `UpdatePlan`). A push that carries an update
id is applied at most once (see `AppliedUpdateIds`).

A push reaches the store as stage 6 of its way (see
`kdist.distribute.parameter_server.router`): `plan_update` checks the
servicer's `GradientSpec`s and assignments, `apply_update` applies the decoded
arrays through each variable's `VariableOptimizer`.
"""

import collections
import dataclasses
import threading

import numpy as np

from kdist.errors import InvalidArgumentError
from kdist.ps.server.optimizer_host import VariableOptimizer, config_differences
from kdist.ps.wire.conventions import canonical_config
from kdist.ps.server.row_updates import check_row_ids
from kdist.ps.server.update_ids import AppliedPush, AppliedUpdateIds, MAX_REMEMBERED_UPDATES
from kdist.ps.server.variable_entry import VariableEntry, locked, make_variable
from kdist.ps.wire.status import FailedPreconditionError, NotFoundError, name_list
from kdist.ps.wire.values import ServerStats, StalenessStats, VariableStats
from kdist.rpc import dtypes

__all__ = ["MAX_REMEMBERED_UPDATES", "AppliedUpdateIds", "GradientSpec", "UpdatePlan",
           "VariableStore"]


@dataclasses.dataclass
class GradientSpec:
    """A gradient announced by a push header (validated by `VariableStore.plan_update`)."""

    name: str
    rows: bool  # True: a RowGradient
    dtype: np.dtype
    shape: tuple
    num_row_ids: int = 0
    version: int | None = None


@dataclasses.dataclass
class UpdatePlan:
    """A validated push: its entries and the payload layout the stream must match."""

    gradients: list  # [(GradientSpec, VariableEntry)]
    assignments: list  # [VariableEntry]
    layout: list  # [(dtype, shape)]


class VariableStore:
    """The variables of one server. Thread-safe.

    Args:
        max_staleness: reject gradients staler than this; None: apply all.
        max_remembered_updates: how many update ids of applied pushes to
            remember for deduplication (`MAX_REMEMBERED_UPDATES`).
        allow_non_finite_gradients: apply gradients holding NaN or infinity;
            False: refuse the whole push (`InvalidArgumentError`), except for
            variables whose optimizer is a `LossScaleOptimizer` (it skips
            such steps itself).

    Example:

    >>> store = VariableStore()  # doctest: +SKIP
    >>> store.create([("w", np.zeros(3, "float32"), True)])  # doctest: +SKIP
    """

    def __init__(self, max_staleness=None, max_remembered_updates=MAX_REMEMBERED_UPDATES,
                 allow_non_finite_gradients=False):
        self.max_staleness = max_staleness
        self.allow_non_finite_gradients = allow_non_finite_gradients
        self.update_ids = AppliedUpdateIds(max_remembered_updates)
        self._lock = threading.Lock()  # guards _entries and the counters below
        self._entries = {}
        self._requests = collections.Counter()
        self._staleness = collections.Counter()
        self._bytes_received = 0
        self._bytes_sent = 0
        self._applied_pushes = 0

    # -- Lookup -----------------------------------------------------------------

    def __len__(self):
        with self._lock:
            return len(self._entries)

    def names(self):
        with self._lock:
            return list(self._entries)

    def entries(self, names, what="variable"):
        """Returns the entries of `names` (in order) or raises NotFoundError."""
        with self._lock:
            found = [self._entries.get(name) for name in names]
        missing = [name for name, entry in zip(names, found) if entry is None]
        if missing:
            raise NotFoundError(
                f"Unknown {what}(s) {name_list(missing)}. Create them first; this server holds "
                f"{len(self)} variable(s)."
            )
        return found

    def all_entries(self):
        with self._lock:
            return [self._entries[name] for name in sorted(self._entries)]

    def replace_entries(self, new_entries):
        """Installs `new_entries` (name -> VariableEntry), replacing same-named ones."""
        with self._lock:
            self._entries.update(new_entries)

    # -- Creation ---------------------------------------------------------------

    def create(self, items):
        """Creates the variables that do not exist; the first creator's value wins.

        Args:
            items: `[(name, array, trainable)]`; the arrays become the
                variables' memory.

        Returns:
            `[(entry, created)]` in order; `created` is False for a variable
            that already existed (its value is the existing one).

        Raises:
            kdist.errors.InvalidArgumentError: an existing variable with another
                shape, dtype or trainable flag, or a trainable variable whose
                dtype is not floating point. The whole request is checked, and
                every new variable built, before any is added: a refused
                request creates nothing.
        """
        with self._lock:
            for name, array, trainable in items:
                entry = self._entries.get(name)
                if entry is not None and (entry.shape, entry.dtype, entry.trainable) != (
                        array.shape, array.dtype, trainable):
                    raise InvalidArgumentError(
                        f"Variable {name!r} already exists with shape {entry.shape}, dtype "
                        f"{entry.dtype.name}, trainable={entry.trainable}. Received: shape="
                        f"{array.shape}, dtype={array.dtype.name}, trainable={trainable}."
                    )
                if entry is None and trainable and not dtypes.is_floating(array.dtype):
                    raise InvalidArgumentError(
                        f"A trainable variable must have a floating-point dtype. Received: "
                        f"variable {name!r} with dtype {array.dtype.name}, trainable=True. "
                        "Create it with trainable=False, or with a float dtype."
                    )
            built = {name: VariableEntry(name, make_variable(name, array, trainable), trainable)
                     for name, array, trainable in items if name not in self._entries}
            self._entries.update(built)
            return [(self._entries[name], name in built) for name, _, _ in items]

    # -- Optimizers -------------------------------------------------------------

    def configure_optimizer(self, config, names):
        """Gives each named trainable variable its own optimizer built from `config`.

        Raises:
            NotFoundError: an unknown name.
            kdist.errors.InvalidArgumentError: a bad config or a non-trainable
                variable.
            FailedPreconditionError: a variable already has a different config.
        """
        config_json = canonical_config(config)
        entries = self.entries(list(dict.fromkeys(names)))
        # Under every lock: two callers racing with different configs cannot
        # both succeed, and a failed check leaves no variable configured.
        with locked(entries):
            for entry in entries:
                if not entry.trainable:
                    raise InvalidArgumentError(
                        f"{entry.describe('Variable')} is not trainable; only trainable "
                        "variables get an optimizer."
                    )
                current = entry.optimizer
                if current is not None and current.config_json != config_json:
                    differences = config_differences(current.config_json, config_json)
                    raise FailedPreconditionError(
                        f"{entry.describe('Variable')} already has an optimizer with another "
                        f"config. Received (current, new): {differences}. Every worker must "
                        "send the same optimizer config."
                    )
            built = {entry.name: VariableOptimizer(config_json, entry.variable)
                     for entry in entries if entry.optimizer is None}
            for entry in entries:
                entry.optimizer = built.get(entry.name, entry.optimizer)

    # -- Push ---------------------------------------------------------------------

    def plan_update(self, gradients, assignment_layouts):
        """Validates a push header; returns its `UpdatePlan`. Changes nothing.

        Args:
            gradients: `[GradientSpec]`.
            assignment_layouts: `[(name, dtype, shape)]`.
        """
        names = [spec.name for spec in gradients] + [name for name, _, _ in assignment_layouts]
        duplicates = sorted(name for name, count in collections.Counter(names).items()
                            if count > 1)
        if duplicates:
            raise InvalidArgumentError(
                f"A push may update each variable once. Received: {name_list(duplicates)} more than "
                "once. Sum the gradients first, or push twice."
            )
        gradient_entries = self.entries([spec.name for spec in gradients])
        assignment_entries = self.entries([name for name, _, _ in assignment_layouts])
        layout = []
        for spec, entry in zip(gradients, gradient_entries):
            what = entry.describe("the gradient of")
            if not entry.trainable:
                raise InvalidArgumentError(f"{what}: the variable is not trainable; assign it.")
            if entry.optimizer is None:
                raise FailedPreconditionError(
                    f"{what}: no optimizer is configured for it. Call "
                    "configure_optimizer(config, names) first."
                )
            expected = entry.shape[1:] if spec.rows else entry.shape
            shape = spec.shape[1:] if spec.rows else spec.shape
            if spec.rows and (not entry.shape or len(spec.shape) < 1
                              or spec.shape[0] != spec.num_row_ids):
                raise InvalidArgumentError(
                    f"{what}: a row gradient needs a variable with rows and len(row_ids) "
                    f"rows. Received: {spec.num_row_ids} ids, rows of shape {spec.shape}."
                )
            _check_layout(what, entry, spec.dtype, shape, expected)
            if spec.version is not None and spec.version > entry.version:
                raise InvalidArgumentError(
                    f"{what}: the gradient's version is newer than the server's. Received: "
                    f"version={spec.version}. Expected at most {entry.version}; pull again "
                    "(was the server restored from an older checkpoint?)."
                )
            if spec.rows:
                layout.append((np.dtype(np.int64), (spec.num_row_ids,)))
            layout.append((spec.dtype, spec.shape))
        for (name, dtype, shape), entry in zip(assignment_layouts, assignment_entries):
            _check_layout(entry.describe("the assignment to"), entry, dtype, shape, entry.shape)
            layout.append((dtype, shape))
        return UpdatePlan(list(zip(gradients, gradient_entries)), assignment_entries, layout)

    def apply_update(self, plan, arrays, count_push=True, update_id="", outcome=b""):
        """Applies a planned push's payload `arrays` (in layout order), at most once per id.

        Args:
            plan: the push's `UpdatePlan`.
            arrays: its payload.
            count_push: count it in `applied_pushes` when it applies a gradient.
            update_id: the push's idempotency key; "": none. A push whose id
                was applied (among the last `max_remembered_updates`) applies
                nothing and returns the first one's result; of concurrent
                pushes with one new id, one applies and the others then find
                it applied. A push that fails does not use up its id.
            outcome: the pusher's bytes, kept with `update_id` for a repeat.

        Returns:
            An `AppliedPush` (the fields of `PushResult`).

        Raises:
            kdist.errors.InvalidArgumentError: a row id out of range, or a
                NaN or infinite gradient value unless
                `allow_non_finite_gradients` (checked for every gradient
                before any is applied).
            FailedPreconditionError: see `AppliedUpdateIds.claim`.
        """
        if not update_id:
            return AppliedPush(*self._apply_update(plan, arrays, count_push))
        applied, result = self.update_ids.claim(update_id)
        if applied:
            return AppliedPush(*result, deduplicated=True, outcome=self.update_ids.outcome_of(update_id))
        try:
            result = self._apply_update(plan, arrays, count_push)
        except BaseException:
            # _apply_update checks the whole push before it changes anything, so
            # one that raised applied nothing: its id stays free for a retry.
            self.update_ids.release(update_id)
            raise
        self.update_ids.record(update_id, result, outcome)
        return AppliedPush(*result)

    def _apply_update(self, plan, arrays, count_push):
        arrays = iter(arrays)
        dense = []
        for spec, entry in plan.gradients:
            if spec.rows:
                ids, rows = next(arrays), next(arrays)
                check_row_ids(entry, ids, "the row gradient of")
                dense.append((spec, entry, (ids, rows)))
            else:
                dense.append((spec, entry, next(arrays)))
        for spec, entry, gradient in dense:
            if not (self.allow_non_finite_gradients
                    or entry.optimizer.handles_non_finite_gradients):
                _check_finite(entry, gradient[1] if spec.rows else gradient)
        versions, rejected, staleness, applied = {}, [], {}, 0
        for spec, entry, gradient in dense:
            with entry.lock:
                if spec.version is not None:
                    staleness[spec.name] = entry.version - spec.version
                if (self.max_staleness is not None and spec.version is not None
                        and staleness[spec.name] > self.max_staleness):
                    entry.rejected_updates += 1
                    rejected.append(spec.name)
                else:
                    entry.apply_gradient(gradient, spec.rows)
                    applied += 1
                versions[spec.name] = entry.version
        for entry in plan.assignments:
            value = next(arrays)
            with entry.lock:
                entry.replace_value(value)  # the received array: no copy
                entry.version += 1
                versions[entry.name] = entry.version
        with self._lock:
            self._staleness.update(staleness.values())
            self._applied_pushes += bool(applied and count_push)
        return versions, tuple(rejected), staleness

    # -- Counters -----------------------------------------------------------------

    def count_request(self, method):
        with self._lock:
            self._requests[method] += 1

    def count_bytes(self, received=0, sent=0):
        with self._lock:
            self._bytes_received += received
            self._bytes_sent += sent

    def update_counts(self):
        """Returns `{name: {"sparse_applies", "dense_applies", "rows_updated"}}` per trainable variable.

        `sparse_applies` counts row gradients applied to their touched rows
        only, `dense_applies` gradients applied as Keras' dense update (see
        `kdist.ps.server.row_updates`), `rows_updated` the distinct rows of the row
        gradients applied.
        """
        counts = {}
        for entry in self.all_entries():
            with entry.lock:
                if entry.trainable:
                    counts[entry.name] = {"sparse_applies": entry.sparse_applies,
                                          "dense_applies": entry.dense_applies,
                                          "rows_updated": entry.rows_updated}
        return counts

    def stats(self):
        """Returns a `ServerStats` snapshot."""
        variables = {}
        for entry in self.all_entries():
            with entry.lock:
                variables[entry.name] = VariableStats(
                    entry.version, entry.applied_updates, entry.rejected_updates,
                    entry.shape, entry.dtype.name, entry.array.nbytes,
                    entry.sparse_applies, entry.dense_applies, entry.rows_updated)
        deduplicated = self.update_ids.num_deduplicated
        with self._lock:
            return ServerStats(
                variables=variables,
                requests=dict(self._requests),
                bytes_received=self._bytes_received,
                bytes_sent=self._bytes_sent,
                applied_pushes=self._applied_pushes,
                deduplicated_updates=deduplicated,
                staleness=StalenessStats.from_histogram(self._staleness),
            )


def _check_layout(what, entry, dtype, shape, expected_shape):
    if dtype != entry.dtype or tuple(shape) != tuple(expected_shape):
        raise InvalidArgumentError(
            f"{what}: wrong shape or dtype. Received: shape={tuple(shape)}, "
            f"dtype={dtype.name}. Expected: shape={tuple(expected_shape)}, "
            f"dtype={entry.dtype.name}."
        )


def _check_finite(entry, values):
    # One vectorized pass per gradient (~0.3 ms per million float32 values).
    if dtypes.is_floating(values.dtype) and not np.isfinite(values).all():
        num_bad = int(values.size - np.count_nonzero(np.isfinite(values)))
        raise InvalidArgumentError(
            f"{entry.describe('The gradient of')} holds non-finite values. Received: "
            f"{num_bad} NaN or infinite value(s) of {values.size}. Expected finite values; "
            "nothing of this push was applied. Find where the loss diverges, or serve "
            "with ServiceOptions(allow_non_finite_gradients=True) to apply them."
        )

