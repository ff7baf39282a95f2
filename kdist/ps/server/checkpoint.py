"""Save and restore a server's variables on the server's own file system.

Layout of a checkpoint directory:

- `manifest.json`: format tag and, per variable, its name, dtype, shape,
  version, trainable flag and optimizer (config JSON, iterations, slots).
- one `.npy` file per value and per slot (`allow_pickle=False`), named by
  position, since variable names may contain "/". bfloat16 arrays are stored
  as their int16 bits (`.npy` has no bfloat16; `kdist.rpc.dtypes.storable`) and
  read back exactly as bfloat16: the manifest keeps the real dtype.

`save` writes into a temporary directory next to the target, fsyncs every
file and the directory, renames it into place and fsyncs the parent
(`kdist.atomic_files`), so a reader never sees a half-written checkpoint and
a failed save (a full disk) leaves the previous one as it was. `restore`
reads and checks everything before it changes anything (all-or-nothing); it
replaces the variables in the checkpoint and leaves others alone. Updates
that race with a restore may be lost: restore before training starts.
"""

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from kdist import atomic_files
from kdist.errors import InvalidArgumentError
from kdist.ps.server.optimizer_host import VariableOptimizer
from kdist.ps.server.variable_entry import VariableEntry, make_variable
from kdist.ps.wire import codec
from kdist.ps.wire.status import NotFoundError, ResourceExhaustedError
from kdist.rpc import dtypes
from kdist.validation import is_integer

MANIFEST_NAME = "manifest.json"
FORMAT = "kdist.ps.server.checkpoint/1"
# A write refused for lack of room (disk, quota, file size limit): RESOURCE_EXHAUSTED.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def save(store, directory, extra=None):
    """Writes every variable of `store` to `directory` atomically; returns how many.

    Each variable is copied under its own lock (a consistent value, version
    and optimizer state per variable; not one instant across variables).
    `extra`, a JSON-serialisable dict, is kept in the manifest (`read_extra`):
    `kdist.ps.server.autosaver` keeps its push count and update ids there.

    Raises:
        kdist.errors.InvalidArgumentError: an empty directory name, or one that
            cannot be written.
        kdist.ps.wire.status.ResourceExhaustedError: no room left to write it (a
            full disk or quota, a file size limit). The previous checkpoint at
            `directory`, if any, is unchanged.
    """
    target = _directory(directory)
    _check_replaceable(target)
    records, arrays = [], {}
    for index, entry in enumerate(store.all_entries()):
        with entry.lock:
            record = {"name": entry.name, "file": f"variable_{index}.npy",
                      "dtype": entry.dtype.name, "shape": list(entry.shape),
                      "version": entry.version, "trainable": entry.trainable,
                      "optimizer": None}
            arrays[record["file"]] = entry.array.copy()
            if entry.optimizer is not None:
                iterations, slots = entry.optimizer.state()
                record["optimizer"] = {
                    "config": entry.optimizer.config_json, "iterations": iterations,
                    "slots": [{"name": name, "file": f"slot_{index}_{position}.npy"}
                              for position, (name, _) in enumerate(slots)],
                }
                for slot, (_, value) in zip(record["optimizer"]["slots"], slots):
                    arrays[slot["file"]] = value
        records.append(record)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            for name, array in arrays.items():
                with open(temporary / name, "wb") as writer:
                    np.save(_Writes(writer), dtypes.storable(array), allow_pickle=False)
                    _flush_to_disk(writer)
            manifest = json.dumps({"format": FORMAT, "variables": records,
                                   **({"extra": extra} if extra else {})}, indent=1)
            with open(temporary / MANIFEST_NAME, "w", encoding="utf-8") as writer:
                writer.write(manifest)
                _flush_to_disk(writer)
            atomic_files.sync_directory(temporary)
            _replace_directory(temporary, target)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)
    except OSError as error:
        if error.errno in _DISK_FULL:
            raise ResourceExhaustedError(
                f"The server's disk has no room for the checkpoint. Received: "
                f"directory={str(directory)!r}: {error.strerror}. The previous checkpoint "
                "there, if any, is unchanged. Free space, or save to another directory."
            ) from None
        raise InvalidArgumentError(
            f"Cannot write the checkpoint. Received: directory={str(directory)!r}: {error}."
        ) from None
    except ValueError as error:
        raise InvalidArgumentError(
            f"Cannot write the checkpoint. Received: directory={str(directory)!r}: {error}."
        ) from None
    return len(records)


def restore(store, directory):
    """Reads a checkpoint written by `save` into `store`; returns how many variables.

    Raises:
        NotFoundError: no checkpoint at `directory`.
        kdist.errors.InvalidArgumentError: a damaged checkpoint, or one whose
            variable conflicts (shape, dtype, trainable) with an existing one.
            Nothing changes then.
    """
    source = _directory(directory)
    manifest_path = source / MANIFEST_NAME
    if not manifest_path.is_file():
        raise NotFoundError(
            f"No checkpoint at {str(source)!r} on the server (no {MANIFEST_NAME}). "
            "Pass a directory written by save()."
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT!r}")
        new_entries = {}
        for record in manifest["variables"]:
            entry = _load_entry(source, record)
            new_entries[entry.name] = entry
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InvalidArgumentError(
            f"The checkpoint at {str(source)!r} is damaged: {type(error).__name__}: {error}. "
            "Nothing was restored."
        ) from None
    existing = {entry.name: entry for entry in store.all_entries()}
    for name, entry in new_entries.items():
        old = existing.get(name)
        if old is not None and (old.shape, old.dtype, old.trainable) != (
                entry.shape, entry.dtype, entry.trainable):
            raise InvalidArgumentError(
                f"Checkpoint variable {name!r} (shape {entry.shape}, dtype "
                f"{entry.dtype.name}, trainable={entry.trainable}) conflicts with the "
                f"server's {old.describe('variable')}. Nothing was restored."
            )
    store.replace_entries(new_entries)
    return len(new_entries)


def read_extra(directory):
    """Returns the `extra` dict `save` kept in the checkpoint at `directory` ({} if none).

    Raises:
        kdist.errors.InvalidArgumentError: a damaged manifest.
    """
    source = _directory(directory)
    try:
        extra = json.loads((source / MANIFEST_NAME).read_text(encoding="utf-8")).get("extra", {})
        if not isinstance(extra, dict):
            raise ValueError(f"extra is a {type(extra).__name__}")
    except (OSError, ValueError, AttributeError) as error:
        raise InvalidArgumentError(
            f"The checkpoint at {str(source)!r} is damaged: {type(error).__name__}: {error}."
        ) from None
    return extra


def _directory(directory):
    if not isinstance(directory, str) or not directory or "\x00" in directory:
        raise InvalidArgumentError(
            "A checkpoint directory must be a non-empty path without NUL characters. "
            f"Received: directory={directory!r}."
        )
    return Path(directory).absolute()


def _check_replaceable(target):
    # A save replaces its target: refuse anything that is not an earlier
    # checkpoint (or empty), so a mistyped path cannot move a directory aside.
    if not target.exists():
        return
    if target.is_dir() and ((target / MANIFEST_NAME).is_file() or not any(target.iterdir())):
        return
    raise InvalidArgumentError(
        "The checkpoint directory exists and is not a kdist checkpoint, so it is not "
        f"replaced. Received: directory={str(target)!r}. Expected a new path, an empty "
        f"directory, or an earlier checkpoint (a directory with {MANIFEST_NAME})."
    )


def _replace_directory(temporary, target):
    # os.replace cannot overwrite a non-empty directory: move the old one aside
    # first. A crash in between leaves the old checkpoint under `.name.old-*`.
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / "checkpoint")
        try:
            os.replace(temporary, target)
        except OSError:
            os.replace(old / "checkpoint", target)  # put the previous checkpoint back
            raise
        atomic_files.sync_directory(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(temporary, target)
        atomic_files.sync_directory(target.parent)


class _Writes:
    """Only the file's `write`: numpy then writes in chunks through it, and a
    failed write keeps its errno (`ndarray.tofile`, used for real files, drops it)."""

    def __init__(self, file):
        self.write = file.write


def _flush_to_disk(writer):
    writer.flush()
    os.fsync(writer.fileno())


def _load_array(source, file_name, dtype_name, shape=None):
    if Path(file_name).name != file_name:
        raise ValueError(f"file name {file_name!r} is not a plain name")
    dtype = codec.numpy_dtype(dtype_name)
    array = dtypes.from_storable(np.load(source / file_name, allow_pickle=False), dtype.name)
    if array.dtype != dtype or (shape is not None and list(array.shape) != list(shape)):
        raise ValueError(f"{file_name} holds {array.dtype}{list(array.shape)}, expected "
                         f"{dtype.name}{list(shape) if shape is not None else ''}")
    return _c_contiguous(array)


def _load_entry(source, record):
    name, trainable, version = record["name"], record["trainable"], record["version"]
    if not isinstance(name, str) or not isinstance(trainable, bool) or not is_integer(version, minimum=0):
        raise ValueError(f"bad variable record {record!r}")
    value = _load_array(source, record["file"], record["dtype"], record["shape"])
    entry = VariableEntry(name, make_variable(name, value, trainable), trainable, version)
    optimizer = record["optimizer"]
    if optimizer is not None:
        entry.optimizer = VariableOptimizer(optimizer["config"], entry.variable)
        slots = {}
        for slot, reference in zip(optimizer["slots"], entry.optimizer.slots):
            slots[slot["name"]] = _load_array(
                source, slot["file"], dtypes.to_numpy(reference.value).dtype.name)
        entry.optimizer.load_state(int(optimizer["iterations"]), slots)
    return entry


def _c_contiguous(array):
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    return array if array.flags.c_contiguous else array.copy(order="C")
