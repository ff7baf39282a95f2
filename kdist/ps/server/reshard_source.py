"""The old job's side of `kdist.ps.server.reshard`: its checkpoints read as logical variables, memory-mapped.

`Source` reads the manifests of every server of an old job (`ROOT/ps-<j>`,
their `checkpoint`, else the `previous-layout` a new server kept) and joins the
parts `"v<index>/part_<k>"` of each variable, in part order along axis 0, into
an `OldVariable`. The `.npy` files are opened with `mmap_mode="r"`: rows are
copied only when a shard asks for them (`Source.rows`, `Source.slot_rows`).
Parts that do not fit together, or a server's checkpoint that is missing, are
refused with `CheckpointLayoutError`, which names the directory.
"""

import json
import re
import time
from pathlib import Path

import numpy as np

from kdist.errors import InvalidArgumentError
from kdist.ps.server import checkpoint
from kdist.ps.wire import codec
from kdist.rpc import dtypes

LAYOUT_KEY = "layout"  # in a checkpoint's extra: {"ps_index": i, "num_ps": K}
CHECKPOINT_NAME = "checkpoint"  # as kdist.ps.server.autosaver
PREVIOUS_NAME = "previous-layout"
SIBLING_PREFIX = "ps-"
_PART = re.compile(r"^(?P<key>.+)/part_(?P<part>\d+)$")


class CheckpointLayoutError(InvalidArgumentError):
    """The checkpoints of another number of parameter servers cannot be re-split (missing or inconsistent parts)."""


class _Part:
    """One old server's part of a variable: its record and memory-mapped arrays."""

    def __init__(self, directory, record):
        self.directory, self.record = directory, record
        dtype = codec.numpy_dtype(record["dtype"])
        self.value = _open(directory, record["file"], dtype.name)
        if self.value.dtype != dtype or list(self.value.shape) != list(record["shape"]):
            raise ValueError(f"{record['file']} holds {self.value.dtype}{list(self.value.shape)}, "
                             f"expected {dtype.name}{record['shape']}")
        optimizer = record["optimizer"]
        self.slots = [] if optimizer is None else [
            _open(directory, slot["file"]) for slot in optimizer["slots"]]

    @property
    def rows(self):
        return self.value.shape[0] if self.value.ndim else 0


class OldVariable:
    """A logical variable of the old job: its parts in order, concatenated along axis 0."""

    def __init__(self, key, parts, where):
        self.key = key
        first = parts[0]
        self.dtype, self.trainable = first.value.dtype, bool(first.record["trainable"])
        self.optimizer = first.record["optimizer"]
        for part in parts:
            if (part.value.dtype != self.dtype or part.value.shape[1:] != first.value.shape[1:]
                    or bool(part.record["trainable"]) != self.trainable
                    or (part.value.ndim == 0 and len(parts) > 1)
                    or _config(part.record) != _config(first.record)):
                raise CheckpointLayoutError(
                    f"The parts of {key!r} in the parameter-server checkpoints at {where!r} do not "
                    f"fit together: {part.record['name']!r} in {str(part.directory)!r} is "
                    f"{part.value.dtype}{list(part.value.shape)} (trainable={part.record['trainable']}, "
                    f"optimizer {_config(part.record)!r}), {first.record['name']!r} is "
                    f"{self.dtype}{list(first.value.shape)}. Restore every server's checkpoint of one job."
                )
        self.shape = ((sum(part.rows for part in parts),) + first.value.shape[1:]
                      if first.value.ndim else ())
        self.version = max(int(part.record["version"]) for part in parts)
        self.parts, start = [], 0
        for part in parts:
            self.parts.append((start, part))
            start += part.rows

    def overlapping(self, start, stop):
        """`[(row_start, part)]` of the parts holding rows `[start, stop)` (the only part of a scalar)."""
        if not self.shape:
            return self.parts
        return [(first, part) for first, part in self.parts
                if first < stop and start < first + part.rows] or self.parts[:1]


class Source:
    """The variables of an old job's checkpoints, by logical key (`"v3"`).

    Attributes:
        root: the directory holding `ps-0`, `ps-1`, ...
        num_ps: the old number of servers.
        directories: the checkpoint read for each old server.
        variables: `{key: OldVariable}`.
    """

    def __init__(self, root, num_ps, directories, manifests):
        self.root, self.num_ps, self.directories = root, num_ps, directories
        grouped = {}
        try:
            for directory, manifest in zip(directories, manifests):
                for record in manifest["variables"]:
                    key, part = split(record["name"])
                    grouped.setdefault(key, {})[part] = _Part(directory, record)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CheckpointLayoutError(
                f"The parameter-server checkpoints at {str(root)!r} are damaged: "
                f"{type(error).__name__}: {error}."
            ) from None
        self.variables = {}
        for key, parts in grouped.items():
            numbers = sorted(parts, key=lambda part: -1 if part is None else part)
            if numbers != [None] and numbers != list(range(len(numbers))):
                raise CheckpointLayoutError(
                    f"The parameter-server checkpoints at {str(root)!r} hold parts "
                    f"{['whole' if n is None else n for n in numbers]} of {key!r}; expected parts "
                    f"0 to {len(numbers) - 1}. A part is missing: restore every server's checkpoint "
                    "of one job."
                )
            self.variables[key] = OldVariable(key, [parts[n] for n in numbers], str(root))

    @classmethod
    def find(cls, root, num_ps, new_num_ps, own_directory):
        """The source of the `num_ps` servers under `root` (retried once if a sibling replaced a file meanwhile).

        Raises:
            CheckpointLayoutError: no sibling directories, a server's checkpoint missing, or damaged parts.
        """
        if root is None:
            raise CheckpointLayoutError(
                f"The checkpoint in {str(own_directory)!r} was written by a job of {num_ps} "
                f"parameter servers, not {new_num_ps}; re-splitting it needs every old server's "
                f"directory next to it, named {SIBLING_PREFIX}<index> (kdist launch "
                "--ps-checkpoint-dir does that). Rename the directories, or start from an empty one."
            )
        for attempt in range(2):
            try:
                found = [candidate(root / f"{SIBLING_PREFIX}{index}", new_num_ps, num_ps, index)
                         for index in range(num_ps)]
                missing = [str(root / f"{SIBLING_PREFIX}{index}")
                           for index, item in enumerate(found) if item is None]
                if missing:
                    raise CheckpointLayoutError(
                        f"Re-splitting the checkpoints of {num_ps} parameter servers at {str(root)!r} "
                        f"needs each server's checkpoint; none of that job is in {missing}. Restore "
                        "them, or start from an empty checkpoint directory."
                    )
                return cls(root, num_ps, [path for path, _ in found], [m for _, m in found])
            except CheckpointLayoutError as error:
                if attempt or not isinstance(error.__context__, FileNotFoundError):
                    raise
                time.sleep(0.2)  # a sibling moved its old checkpoint aside meanwhile
        raise AssertionError("unreachable")

    def rows(self, old, start, stop, like):
        """Rows `[start, stop)` of `old`'s value as a new array (of a scalar: the value)."""
        return self._gather(old, start, stop, lambda part: part.value, like.dtype, like.shape)

    def slot_rows(self, old, position, dtype_name, start, stop, entry):
        """Rows `[start, stop)` of `old`'s slot at `position`, read back as `dtype_name`."""
        def slot(part):
            value = dtypes.from_storable(part.slots[position], dtype_name)
            if value.shape != part.value.shape and not (len(old.parts) == 1 and entry.shape == old.shape):
                raise InvalidArgumentError(
                    f"Slot {position} of {old.key!r} in {str(part.directory)!r} has shape "
                    f"{value.shape}, not its variable's {part.value.shape}, so it cannot be re-split "
                    f"into {entry.describe('variable')}. Use the old number of parameter servers."
                )
            return value
        parts = old.overlapping(start, stop)
        if len(parts) == 1 and old.shape and slot(parts[0][1]).shape != parts[0][1].value.shape:
            return np.array(slot(parts[0][1]))  # a whole variable's slot of its own shape
        return self._gather(old, start, stop, slot, None, None)

    @staticmethod
    def _gather(old, start, stop, array_of, dtype, shape):
        if not old.shape:
            return np.array(array_of(old.parts[0][1]))
        pieces = [array_of(part)[max(start, first) - first: min(stop, first + part.rows) - first]
                  for first, part in old.overlapping(start, stop)]
        joined = np.concatenate(pieces) if len(pieces) > 1 else np.array(pieces[0])
        return joined if dtype is None else joined.astype(dtype, copy=False).reshape(shape)


def split(name):
    """`(logical key, part number or None)` of a server key: `"v3/part_1"` -> `("v3", 1)`."""
    match = _PART.match(name)
    return (name, None) if match is None else (match["key"], int(match["part"]))


def _config(record):
    return None if record["optimizer"] is None else record["optimizer"]["config"]


def _open(directory, file_name, dtype_name=None):
    if Path(file_name).name != file_name:
        raise ValueError(f"file name {file_name!r} is not a plain name")
    array = np.load(directory / file_name, mmap_mode="r", allow_pickle=False)
    return array if dtype_name is None else dtypes.from_storable(array, dtype_name)


def read_manifest(path):
    """The manifest of the checkpoint at `path` as a dict, or None (absent, unreadable, foreign)."""
    try:
        manifest = json.loads((Path(path) / checkpoint.MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == checkpoint.FORMAT else None


def layout_count(manifest):
    """The number of servers a manifest's layout records, or None."""
    layout = (manifest or {}).get("extra", {}).get(LAYOUT_KEY)
    return None if not isinstance(layout, dict) else layout.get("num_ps")


def candidate(sibling, new_num_ps, num_ps=None, index=None):
    """`(path, manifest)` of `sibling`'s checkpoint of a layout other than `new_num_ps`, else of its kept previous one, or None.

    With `num_ps` and `index`: only one written by server `index` of `num_ps`.
    """
    for name in (CHECKPOINT_NAME, PREVIOUS_NAME):
        manifest = read_manifest(sibling / name)
        count = layout_count(manifest)
        layout = (manifest or {}).get("extra", {}).get(LAYOUT_KEY, {})
        if count is not None and count != new_num_ps and (
                num_ps is None or (count == num_ps and layout.get("ps_index") == index)):
            return sibling / name, manifest
    return None
