"""`Autosaver`: a parameter server that checkpoints itself, and comes back from its checkpoint.

A server with `ServiceOptions(checkpoint_dir=D, checkpoint_every=E)` keeps, in
its own directory `D`:

- `checkpoint/`: its last checkpoint (`kdist.ps.server.checkpoint`, written
  atomically), which also holds the number of pushes applied before it and
  the update ids of the most recent of them (so that a push retried after a
  restore, with its update id, is applied once in all);
- `applied-pushes.count`: a memory-mapped counter of the pushes applied so
  far. Written into the page cache at every push, it outlives a process killed
  with SIGKILL, so a restarted server knows how many pushes its checkpoint
  misses ("lost"), and logs it.

Every N steps (`E.steps`) is every N applied pushes of this server: the push
that reaches the count saves before it is answered, so with N = 1 every
acknowledged push is in the checkpoint. Every T seconds (`E.seconds`): a
background thread saves when pushes were applied since the last save. A
Create, ConfigureOptimizer, Assign or Restore saves before it is answered
either way: a restarted server could not rebuild what they did. Pushes apply
in parallel with each other but never during a save (a shared/exclusive lock),
so a checkpoint holds exactly the pushes its count and update ids say.

Versions: restored as checkpointed. When pushes were lost, a client may hold a
version the restored server has not reached yet, and would later take the
server's new value for the one it cached; so each variable's version then
jumps past every version that could have been handed out (lost + 1: a push
raises a variable's version by at most one). When the count is unknown (no
counter file, a torn one), the jump is `UNKNOWN_LOSS_VERSION_JUMP`.
"""

import base64
import contextlib
import logging
import mmap
import os
import shutil
import struct
import threading
from pathlib import Path

from kdist.ps.server import checkpoint, reshard
from kdist.ps.server.update_ids import AppliedUpdateIds

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint"
COUNTER_NAME = "applied-pushes.count"
# The update ids kept in a checkpoint: a push is retried within seconds of its
# server's death, and at most one push per client thread is then in flight.
IDS_IN_CHECKPOINT = 4096
UNKNOWN_LOSS_VERSION_JUMP = 1 << 20
# The counter holds the count and its complement: a torn or foreign file does
# not pass for a count.
_COUNTER = struct.Struct("<QQ")
_MASK = (1 << 64) - 1


class _SharedExclusive:
    """Many pushes at once (shared), or one save (exclusive); a waiting save goes first."""

    def __init__(self):
        self._condition = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextlib.contextmanager
    def shared(self):
        with self._condition:
            self._condition.wait_for(lambda: not self._exclusive and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            with self._condition:
                self._shared -= 1
                self._condition.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._condition:
            self._waiting += 1
            self._condition.wait_for(lambda: not self._exclusive and not self._shared)
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._condition:
                self._exclusive = False
                self._condition.notify_all()


class RememberedUpdateIds(AppliedUpdateIds):
    """`AppliedUpdateIds` that a checkpoint can hold, and that tells a duplicate apart."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self._local = threading.local()

    def claim(self, update_id, *args, **kwargs):
        applied, result = super().claim(update_id, *args, **kwargs)
        self._local.duplicate = applied
        return applied, result

    def take_duplicate(self):
        """True when this thread's last claim found its id applied; resets it."""
        duplicate = getattr(self._local, "duplicate", False)
        self._local.duplicate = False
        return duplicate

    def snapshot(self, limit):
        """The most recent `limit` ids and results, as JSON-ready lists, oldest first."""
        with self._condition:
            items = list(self._results.items())[-limit:]
            outcomes = [self._outcomes.get(update_id, b"") for update_id, _ in items]
        return [[update_id, dict(versions), list(rejected), dict(staleness),
                 base64.b64encode(outcome).decode("ascii")]
                for (update_id, (versions, rejected, staleness)), outcome in zip(items, outcomes)]

    def load(self, items):
        """Remembers ids from `snapshot` (after a restore)."""
        for update_id, versions, rejected, staleness, *outcome in items:
            # Checkpoints written before outcomes were kept have four fields.
            self.record(str(update_id), (
                {str(k): int(v) for k, v in versions.items()}, tuple(map(str, rejected)),
                {str(k): int(v) for k, v in staleness.items()}),
                base64.b64decode(outcome[0]) if outcome else b"")


class _Counter:
    """A count kept in a memory-mapped file (the page cache outlives `kill -9`)."""

    def __init__(self, path):
        existed = path.is_file() and path.stat().st_size == _COUNTER.size
        self._file = open(path, "r+b" if existed else "w+b")  # noqa: SIM115 — kept open
        if not existed:
            self._file.truncate(_COUNTER.size)
        self._map = mmap.mmap(self._file.fileno(), _COUNTER.size)
        count, check = _COUNTER.unpack(self._map[:])
        self.previous = count if existed and check == count ^ _MASK else None

    def write(self, count):
        self._map[:] = _COUNTER.pack(count, count ^ _MASK)

    def close(self):
        self._map.close()
        self._file.close()


class Autosaver:
    """Checkpoints one server's store as its `CheckpointEvery` says; restores it at start.

    Args:
        store: the server's `kdist.ps.server.store.VariableStore` (its update-id
            memory is replaced by a `RememberedUpdateIds`).
        directory: this server's own directory.
        every: a `kdist.ps.autosave.CheckpointEvery`.
        name: how the log line names the server (e.g. `"ps-1"`).
        layout: `(ps_index, num_ps)` of this server in its job, or None.
            With it, every checkpoint records the layout, and a checkpoint of
            another number of servers is re-split at start (`kdist.ps.server.reshard`).
    """

    def __init__(self, store, directory, every, name="parameter server", layout=None):
        self.store = store
        self.every = every
        self.name = name
        self.directory = Path(directory).absolute()
        self.path = str(self.directory / CHECKPOINT_NAME)
        store.update_ids = RememberedUpdateIds(store.update_ids.capacity)
        self._lock = _SharedExclusive()
        self._count_lock = threading.Lock()
        self._applied = 0
        self._saved = 0
        self._counter = None
        self._stopped = threading.Event()
        self._thread = None
        self.num_saves = 0
        self.restored = None  # the line `restore_at_start` logged
        self.layout = reshard.check_layout(layout)
        # A `kdist.ps.server.reshard.Resharder` while variables come from the
        # checkpoints of another number of servers, else None.
        self.reshard = None

    # -- Start and stop ------------------------------------------------------------

    def restore_at_start(self):
        """Restores the checkpoint in the directory, if any, and logs one line; returns the line or None.

        Raises:
            kdist.errors.InvalidArgumentError: a damaged checkpoint (the server
                does not start: serving without its variables would be silently
                different), or a directory that cannot be written.
            kdist.ps.server.reshard.CheckpointLayoutError: a checkpoint of another
                number of servers that cannot be re-split.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        _recover_interrupted_save(self.directory)
        restore_own, self.reshard = reshard.prepare(self.store, self.directory, self.layout, self.name)
        self._counter = _Counter(self.directory / COUNTER_NAME)
        line = None
        has_own = Path(self.path, checkpoint.MANIFEST_NAME).is_file()
        if restore_own and has_own:
            num_variables = checkpoint.restore(self.store, self.path)
            extra = checkpoint.read_extra(self.path)
            saved = int(extra.get("applied_pushes", 0))
            self.store.update_ids.load(extra.get("update_ids", []))
            previous = self._counter.previous
            lost = None if previous is None else max(previous - saved, 0)
            jump = UNKNOWN_LOSS_VERSION_JUMP if lost is None else (lost + 1 if lost else 0)
            versions = []
            for entry in self.store.all_entries():
                with entry.lock:
                    entry.version += jump
                    versions.append(entry.version)
            self._applied = self._saved = saved
            lost_text = ("an unknown number of pushes applied after it may be lost (no push "
                         "counter)" if lost is None else f"{lost} pushes applied after it are lost")
            line = (f"{self.name} restored its checkpoint of push {saved} ({num_variables} "
                    f"variables, versions {min(versions, default=0)}-{max(versions, default=0)}"
                    f"{f', moved on by {jump}' if jump else ''}) from {self.path}; {lost_text}.")
            logger.warning("%s", line)
        self._counter.write(self._applied)
        if self.layout is not None and not (restore_own and has_own):
            # At once: the layout is on disk (a sibling then knows this server
            # exists) and a re-split server's old checkpoint is replaced.
            self.save()
        self.restored = line
        return line

    def start(self):
        """Starts the background saves of a seconds interval (nothing for a steps interval)."""
        if self.every.seconds is not None and self._thread is None:
            self._thread = threading.Thread(target=self._save_periodically, daemon=True,
                                            name="kdist-ps-autosave")
            self._thread.start()

    def close(self):
        """Stops the background saves, saves what the last checkpoint misses, closes the counter."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        if self._counter is None:
            return
        try:
            if self._applied != self._saved:
                self.save()
        except Exception:  # noqa: BLE001 — a stopping server logs, never raises
            logger.exception("%s: the checkpoint at stop failed", self.name)
        self._counter.close()
        self._counter = None

    # -- Around requests -----------------------------------------------------------

    @contextlib.contextmanager
    def applying(self):
        """Wraps a request that changes the store: never during a save."""
        self.store.update_ids.take_duplicate()  # a failed earlier claim left no mark
        with self._lock.shared():
            yield

    def count_applied(self):
        """Inside `applying`, after a push applied: counts it unless it was a duplicate.

        Returns:
            True when it was counted (it changed the store).
        """
        if self.store.update_ids.take_duplicate():
            return False
        with self._count_lock:
            self._applied += 1
            if self._counter is not None:
                self._counter.write(self._applied)
        return True

    def after_push(self):
        """After `applying`, before the answer: saves when the steps interval is due."""
        if self.reshard is not None:
            self.reshard.first_push()
        steps = self.every.steps
        if steps is not None and self._applied - self._saved >= steps:
            self.save(only_if_due=True)

    def after_change(self):
        """After a Create, ConfigureOptimizer, Assign or Restore, before the answer: saves."""
        self.save()

    def save(self, only_if_due=False):
        """Writes the checkpoint now (atomically), with the push count and recent update ids."""
        with self._lock.exclusive():
            with self._count_lock:
                applied = self._applied
            if only_if_due and applied - self._saved < (self.every.steps or 1):
                return  # a concurrent push saved it meanwhile
            extra = {"applied_pushes": applied,
                     "update_ids": self.store.update_ids.snapshot(IDS_IN_CHECKPOINT)}
            if self.layout is not None:
                extra.update(reshard.layout_extra(self.layout))
            if self.reshard is not None:
                extra.update(self.reshard.extra())
            checkpoint.save(self.store, self.path, extra)
            self._saved = applied
            self.num_saves += 1

    def _save_periodically(self):
        while not self._stopped.wait(self.every.seconds):
            if self._applied == self._saved:
                continue
            try:
                self.save()
            except Exception:  # noqa: BLE001 — a full disk: keep serving, try again later
                logger.exception("%s: a periodic checkpoint failed; the previous one stays",
                                 self.name)


def _recover_interrupted_save(directory):
    # `checkpoint.save` moves the previous checkpoint aside before renaming the
    # new one into place; a kill in between leaves it under `.checkpoint.old-*`.
    target = directory / CHECKPOINT_NAME
    for partial in directory.glob(f".{CHECKPOINT_NAME}.tmp-*"):
        shutil.rmtree(partial, ignore_errors=True)  # a save killed half-way
    if target.exists():
        return
    for old in sorted(directory.glob(f".{CHECKPOINT_NAME}.old-*")):
        previous = old / CHECKPOINT_NAME
        if (previous / checkpoint.MANIFEST_NAME).is_file():
            os.replace(previous, target)
            logger.warning("Recovered the checkpoint %s that an interrupted save had moved aside.",
                           target)
            return
