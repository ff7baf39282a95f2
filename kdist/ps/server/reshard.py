"""Restoring the checkpoints of another number of parameter servers, re-split by this job's partitioning.

A server that checkpoints itself (`kdist.ps.server.autosaver`) and knows its place
in the job (`layout`: its index and the number of servers, given by
`kdist.distribute.Server` from the cluster spec) records that layout in every
checkpoint. Its own directory is `ROOT/ps-<index>` (`kdist launch
--ps-checkpoint-dir ROOT`), so the checkpoints of the whole job lie side by side.

At start (`prepare`), a server whose own checkpoint was written by a job with
another number of servers, or that has none while its siblings `ROOT/ps-<j>`
hold a consistent other layout, does not restore a directory: it reads the
manifests of every old server as one `Source` of logical variables. The
server keys of a `ParameterServerStrategy` are given by creation order
(`"v<index>"`, `"v<index>/part_<k>"`), the same in a new job building the
same model, so the parts `k` of one `v<index>` concatenated along axis 0 in
part order are the old whole variable. The `.npy` files are memory-mapped:
a server reads only the rows of the shards it is given, never a whole table.

Then `Resharder` hooks the requests: a Create whose key the source holds gets
the old rows its `ShardOrigin` names (the value sent is ignored) and the old
variable's version (the highest of its parts'), and the value is sent back to
the creator; a ConfigureOptimizer loads those rows of the old slots and the
old iterations (the highest of the parts the shard overlaps; they are equal
in dense training). The old checkpoint of a server is kept, hard-linked, in
`ROOT/ps-<index>/previous-layout` before its first save replaces it, so that
siblings starting later still find it. Every checkpoint written meanwhile
says which source it came from (`SOURCE_KEY`), so a restarted server restores
its own checkpoint and still fills the variables it was not given yet from
the source; the new layout wins for everything it holds. At the first push,
server 0 logs, in one line, the old variables this job created nowhere.
"""

import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

from kdist import atomic_files
from kdist.errors import InvalidArgumentError
from kdist.ps.server import checkpoint, reshard_source
from kdist.ps.server.optimizer_host import config_differences
from kdist.ps.wire.conventions import canonical_config
from kdist.rpc import dtypes
from kdist.ps.server.reshard_source import (  # noqa: F401  (CheckpointLayoutError: part of this module's API)
    CHECKPOINT_NAME,
    LAYOUT_KEY,
    PREVIOUS_NAME,
    SIBLING_PREFIX,
    CheckpointLayoutError,
)
from kdist.ps.server.variable_entry import locked
from kdist.ps.wire.status import FailedPreconditionError

logger = logging.getLogger(__name__)

SOURCE_KEY = "reshard_source"  # {"num_ps": K_old, "origins": {server key: row_start}}


def layout_extra(layout):
    """What a checkpoint records of `layout` (`(ps_index, num_ps)`)."""
    return {LAYOUT_KEY: {"ps_index": layout[0], "num_ps": layout[1]}}


def check_layout(layout):
    """Returns `layout` as `(ps_index, num_ps)` ints, or None.

    Raises:
        kdist.errors.InvalidArgumentError: anything but None or `0 <= ps_index < num_ps`.
    """
    if layout is None:
        return None
    try:
        index, count = (int(value) for value in layout)
        if 0 <= index < count and tuple(layout) == (index, count):
            return index, count
    except (TypeError, ValueError):
        pass
    raise InvalidArgumentError(
        f"layout must be (ps_index, num_ps) with 0 <= ps_index < num_ps. Received: {layout!r}."
    )


def prepare(store, directory, layout, name):
    """Decides what a starting server restores; returns `(restore_own, resharder or None)`.

    `restore_own`: restore the own checkpoint as it is (same layout, no
    layout recorded, or no layout given). A `Resharder` is returned when an
    old job's checkpoints are the source of the variables not restored.

    Raises:
        CheckpointLayoutError: the old checkpoints are missing a server or
            inconsistent; nothing is served then.
    """
    if layout is None:
        return True, None
    directory = Path(directory)
    for partial in directory.glob(f".{PREVIOUS_NAME}.*"):
        shutil.rmtree(partial, ignore_errors=True)  # a copy killed half-way
    own_path = directory / CHECKPOINT_NAME
    own = reshard_source.read_manifest(own_path)
    own_count = reshard_source.layout_count(own)
    root = directory.parent if directory.name == f"{SIBLING_PREFIX}{layout[0]}" else None
    if own is not None and own_count in (None, layout[1]):
        marker = own.get("extra", {}).get(SOURCE_KEY)
        if marker is None:
            return True, None
        source = reshard_source.Source.find(root, int(marker["num_ps"]), layout[1], directory)
        return True, Resharder(store, source, layout, name, marker.get("origins", {}))
    if own is not None:
        old_count = own_count
    else:
        counts = {reshard_source.layout_count(found[1]) for found in
                  (reshard_source.candidate(sibling, layout[1]) for sibling in _siblings(root)) if found}
        if not counts:
            return True, None  # a new job: nothing to restore
        if len(counts) > 1:
            raise CheckpointLayoutError(
                f"The parameter-server checkpoints under {str(root)!r} were written by jobs of "
                f"different numbers of servers ({sorted(counts)}), so {name} cannot tell which to "
                "restore. Keep the checkpoints of one job there, or start from an empty directory."
            )
        old_count = counts.pop()
    source = reshard_source.Source.find(root, old_count, layout[1], directory)
    if own is not None:
        _preserve(directory, own_path)
    logger.warning("%s re-splits the checkpoints of %d parameter servers at %s (%d variables) by "
                   "this job's partitioning over %d servers.", name, old_count, source.root,
                   len(source.variables), layout[1])
    return False, Resharder(store, source, layout, name, {})


class Resharder:
    """The request hooks of a server whose variables come from an old job's `Source`. Thread-safe.

    Args:
        store: the server's `kdist.ps.server.store.VariableStore`.
        source: the old job's `Source`.
        layout: this server's `(ps_index, num_ps)`.
        name: how log lines name the server.
        origins: `{server key: row_start}` of the variables already filled (from a checkpoint).
    """

    def __init__(self, store, source, layout, name, origins):
        self.store, self.source, self.layout, self.name = store, source, layout, name
        self.origins = {str(key): int(start) for key, start in origins.items()}
        self._lock = threading.Lock()
        self._reported = False

    def extra(self):
        """What a checkpoint records: the source's layout and the filled variables' origins."""
        with self._lock:
            return {SOURCE_KEY: {"num_ps": self.source.num_ps, "origins": dict(self.origins)}}

    def fill(self, items, values):
        """Replaces the values of the Create `items` the source holds; returns `(values, {name: (version, row_start)})`.

        Raises:
            kdist.errors.InvalidArgumentError: a shard that does not fit its old
                variable (shape, dtype, trainable flag), or a part without a row offset.
        """
        existing = set(self.store.names())
        filled, resharded = list(values), {}
        for position, (item, value) in enumerate(zip(items, values)):
            key, part = reshard_source.split(item.name)
            old = self.source.variables.get(key)
            if old is None or item.name in existing:
                continue
            row_start = self._row_start(item, part, value, old)
            rows = value.shape[0] if value.ndim else 0
            filled[position] = self.source.rows(old, row_start, row_start + rows, value)
            resharded[item.name] = (old.version, row_start)
        return filled, resharded

    def created(self, results, resharded):
        """After the store created them: the filled variables take their old version."""
        for entry, was_created in results:
            if was_created and entry.name in resharded:
                version, row_start = resharded[entry.name]
                with entry.lock:
                    entry.version = version
                with self._lock:
                    self.origins[entry.name] = row_start

    def configure(self, config, names):
        """`VariableStore.configure_optimizer`, then the old slots and iterations of the filled variables.

        All or nothing: a state that does not fit leaves those variables without an optimizer.
        """
        with self._lock:
            entries = self.store.entries(list(dict.fromkeys(names)))
            fresh = [entry for entry in entries
                     if entry.optimizer is None and entry.name in self.origins]
            config_json = canonical_config(config)
            for entry in fresh:  # checked before anything changes
                self._check_config(entry, config_json)
            self.store.configure_optimizer(config, names)
            try:
                with locked(fresh):
                    states = [(entry, self._optimizer_state(entry)) for entry in fresh]
                    states = [(entry, state) for entry, state in states if state is not None]
                    for entry, state in states:
                        entry.optimizer.check_state(*state)
                    for entry, state in states:
                        entry.optimizer.load_state(*state)
            except Exception:
                for entry in fresh:
                    entry.optimizer = None
                raise

    def first_push(self):
        """Server 0, once: logs the old variables that this job created on no server."""
        if self._reported or self.layout[0] != 0:
            return
        self._reported = True
        created = set()
        for index in range(self.layout[1]):
            manifest = reshard_source.read_manifest(self.source.root / f"{SIBLING_PREFIX}{index}" / CHECKPOINT_NAME)
            if reshard_source.layout_count(manifest) == self.layout[1]:
                created.update(reshard_source.split(record["name"])[0] for record in manifest["variables"])
        unused = sorted(set(self.source.variables) - created)
        if unused:
            shown = ", ".join(unused[:20]) + (f" and {len(unused) - 20} more" if len(unused) > 20 else "")
            logger.warning("%s: %d variables of the checkpoints of %d servers at %s were created by "
                           "no server of this job, so they are not restored: %s.", self.name,
                           len(unused), self.source.num_ps, self.source.root, shown)

    def _row_start(self, item, part, value, old):
        if item.HasField("shard"):
            full_shape, row_start = tuple(item.shard.full_shape), int(item.shard.row_start)
        elif part is None:
            full_shape, row_start = tuple(value.shape), 0
        else:
            raise InvalidArgumentError(
                f"Variable {item.name!r} is a part of {old.key!r} in the old checkpoints at "
                f"{str(self.source.root)!r}, but its create request carries no row offset "
                "(CreateItem.shard). Create it through ParameterServerStrategy, or send a ShardOrigin."
            )
        rows = value.shape[0] if value.ndim else 0
        expected_part = (rows,) + old.shape[1:] if old.shape else ()
        if (full_shape != old.shape or value.dtype != old.dtype or item.trainable != old.trainable
                or tuple(value.shape) != expected_part or row_start < 0
                or (old.shape and row_start + rows > old.shape[0])):
            raise InvalidArgumentError(
                f"Variable {item.name!r} does not fit {old.key!r} of the old checkpoints at "
                f"{str(self.source.root)!r}: shape {old.shape}, dtype {old.dtype.name}, trainable="
                f"{old.trainable}. Received: rows from {row_start} of a whole shape {full_shape}, "
                f"shard shape {tuple(value.shape)}, dtype {value.dtype.name}, trainable="
                f"{item.trainable}. Build the same model as the old job, or start from an empty "
                "checkpoint directory."
            )
        return row_start

    def _check_config(self, entry, config_json):
        old = self.source.variables[reshard_source.split(entry.name)[0]]
        if old.optimizer is not None and old.optimizer["config"] != config_json:
            raise FailedPreconditionError(
                f"{entry.describe('Variable')} had another optimizer in the old checkpoints at "
                f"{str(self.source.root)!r}. Received (old, new): "
                f"{config_differences(old.optimizer['config'], config_json)}. Configure the old "
                "optimizer, or start from an empty checkpoint directory."
            )

    def _optimizer_state(self, entry):
        old = self.source.variables[reshard_source.split(entry.name)[0]]
        if old.optimizer is None:
            return None  # the old job never configured one: fresh slots, as it had
        start = self.origins[entry.name]
        stop = start + (entry.shape[0] if entry.shape else 0)
        parts = old.overlapping(start, stop)
        iterations = max(int(part.record["optimizer"]["iterations"]) for _, part in parts)
        slots = {}
        for position, (slot_name, reference) in enumerate(
                zip(entry.optimizer.slot_names, entry.optimizer.slots)):
            dtype_name = dtypes.to_numpy(reference.value).dtype.name
            slots[slot_name] = self.source.slot_rows(old, position, dtype_name, start, stop, entry)
        return iterations, slots


def _siblings(root):
    if root is None or not root.is_dir():
        return []
    return [path for path in root.iterdir()
            if path.is_dir() and re.fullmatch(rf"{SIBLING_PREFIX}\d+", path.name)]


def _preserve(directory, own_path):
    # Hard links (a copy where the file system has none): siblings starting
    # later still find this server's old checkpoint after its first save.
    previous = directory / PREVIOUS_NAME
    manifest = own_path / checkpoint.MANIFEST_NAME
    if (previous / checkpoint.MANIFEST_NAME).is_file() and (
            (previous / checkpoint.MANIFEST_NAME).read_bytes() == manifest.read_bytes()):
        return
    temporary = Path(tempfile.mkdtemp(prefix=f".{PREVIOUS_NAME}.tmp-", dir=directory))
    for path in own_path.iterdir():
        try:
            os.link(path, temporary / path.name)
        except OSError:
            shutil.copy2(path, temporary / path.name)
    atomic_files.sync_directory(temporary)
    if previous.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{PREVIOUS_NAME}.old-", dir=directory))
        os.replace(previous, old / PREVIOUS_NAME)
        os.replace(temporary, previous)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(temporary, previous)
    atomic_files.sync_directory(directory)
