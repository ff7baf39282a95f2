"""Durable, atomic file writes: a reader sees the old file or the new one, never a torn one.

Every save kdist performs or routes (the chief's `model.save`/`save_weights`
under each strategy, `ModelCheckpoint`, `BackupAndRestore`, the parameter
servers' own checkpoints) goes through this module:

1. write to a temporary file in the target's directory (so the rename below
   stays on one file system), named `.kdist-tmp-<pid>-<random>-<name>`: hidden,
   and ending with the target's name, since Keras picks the format from it;
2. flush it and `os.fsync` it, so its bytes are on disk before its name is;
3. `os.replace` it onto the target (atomic on POSIX and Windows);
4. `os.fsync` the directory, so the rename itself survives a power loss.

A write that fails partway (full disk, file size limit, an exception in the
writer) removes the temporary file and leaves the previous target untouched.
A process killed mid-write leaves at most a stray hidden temporary file.

Remote paths (`scheme://...`, e.g. `gs://`) have no rename or fsync here:
they are written directly, by the writer.

Stdlib only (layer 0): the parameter servers use it as well as the Keras layer.
Thread-safe: each call uses its own temporary name.
"""

import errno
import os
import secrets
import shutil

TEMPORARY_PREFIX = ".kdist-tmp-"

# File systems that cannot sync a directory say so with one of these; there
# is nothing more to make durable then.
_DIRECTORY_SYNC_UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP, errno.EBADF)


def is_remote(path):
    """True for `scheme://...` paths, which are written directly, not atomically."""
    return "://" in os.fspath(path)


def temporary_path(path):
    """A fresh temporary name beside `path` that keeps `path`'s name (and so its suffix) last."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    return os.path.join(directory, f"{TEMPORARY_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{name}")


def write_via(path, write_to):
    """Calls `write_to(temporary_path)`, then makes the written file `path`, durably.

    For writers that take a path (Keras' save functions). `write_to` must
    create one regular file at the path it is given.

    Args:
        path: the target file (`str` or `os.PathLike`). Its directory must exist.
        write_to: a function of one argument, the path to write.

    Returns:
        What `write_to` returned.

    Raises:
        Whatever `write_to`, the file system or `os.fsync` raised; `path` is then
        unchanged and no temporary file is left.

    Example:

    ```python
    atomic_files.write_via("model.keras", model.save)
    ```
    """
    path = os.fspath(path)
    if is_remote(path):
        return write_to(path)
    temporary = temporary_path(path)
    try:
        result = write_to(temporary)
        sync_file(temporary)
        os.replace(temporary, path)
    except BaseException:
        _remove_quietly(temporary)
        raise
    sync_directory(os.path.dirname(os.path.abspath(path)))
    return result


def write_bytes(path, data):
    """Writes `data` (bytes) to `path` atomically and durably (see `write_via`).

    Example:

    ```python
    atomic_files.write_bytes("state.bin", payload)
    ```
    """

    def write_to(temporary):
        # O_EXCL: never write through a file (or link) that is already there.
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(descriptor, "wb") as writer:
            writer.write(data)

    path = os.fspath(path)
    if is_remote(path):
        raise ValueError(f"write_bytes writes local files only. Received: path={path!r}.")
    write_via(path, write_to)


def write_text(path, text, encoding="utf-8"):
    """Writes `text` to `path` atomically and durably (see `write_via`)."""
    write_bytes(path, text.encode(encoding))


def copy_file(source, target):
    """Copies the file `source` onto `target` atomically and durably."""
    with open(source, "rb") as reader:
        write_bytes(target, reader.read())


def sync_file(path):
    """`os.fsync` of the file at `path` (its data and size reach the disk)."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sync_directory(path):
    """`os.fsync` of the directory `path`, so renames and new names in it are durable.

    A no-op where directories cannot be opened (Windows) or synced (some
    network and FUSE file systems).
    """
    if os.name == "nt":
        return
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in _DIRECTORY_SYNC_UNSUPPORTED:
            raise
    finally:
        os.close(descriptor)


def _remove_quietly(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
