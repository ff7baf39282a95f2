"""`kdist.atomic_files`: durable (fsync file, rename, fsync directory) and atomic writes."""

import errno
import os
import stat
import subprocess
import sys

import pytest

from kdist import atomic_files
from tests import harness

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fsyncs(monkeypatch):
    """Records `(kind, device, inode)` of every descriptor passed to `os.fsync`, in order."""
    calls = []
    real_fsync = os.fsync

    def recording_fsync(descriptor):
        info = os.fstat(descriptor)
        kind = "directory" if stat.S_ISDIR(info.st_mode) else "file"
        calls.append((kind, info.st_dev, info.st_ino))
        return real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return calls


def _identity(path):
    info = os.stat(path)
    return info.st_dev, info.st_ino


def _write_in_parts(path):
    with open(path, "wb") as writer:
        writer.write(b"new ")
        writer.write(b"contents")


@pytest.mark.parametrize("write", ["write_via", "write_bytes"])
def test_the_file_is_synced_before_the_rename_and_the_directory_after(tmp_path, fsyncs, write):
    target = tmp_path / "model.keras"
    target.write_bytes(b"old contents")
    seen_before_rename = []

    def write_to(temporary):
        _write_in_parts(temporary)
        seen_before_rename.append(target.read_bytes())

    if write == "write_via":
        atomic_files.write_via(target, write_to)
    else:
        atomic_files.write_bytes(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    file_sync = ("file", *_identity(target))  # the temporary file's inode is the target's now
    directory_sync = ("directory", *_identity(tmp_path))
    assert file_sync in fsyncs and directory_sync in fsyncs, fsyncs
    assert fsyncs.index(file_sync) < fsyncs.index(directory_sync)
    assert sorted(os.listdir(tmp_path)) == ["model.keras"]
    if seen_before_rename:
        assert seen_before_rename == [b"old contents"]  # readers saw the old file until the rename


def test_a_writer_that_fails_leaves_the_old_file_and_no_temporary_file(tmp_path):
    target = tmp_path / "latest.weights.h5"
    target.write_bytes(b"old contents")
    names = []

    def failing(temporary):
        names.append(os.path.basename(temporary))
        with open(temporary, "wb") as writer:
            writer.write(b"half")
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        atomic_files.write_via(target, failing)
    assert target.read_bytes() == b"old contents"
    assert sorted(os.listdir(tmp_path)) == ["latest.weights.h5"]
    # Hidden, and the target's name (its suffix) last, as Keras needs.
    assert names[0].startswith(atomic_files.TEMPORARY_PREFIX) and names[0].endswith("-latest.weights.h5")


def test_temporary_names_differ_per_call(tmp_path):
    assert atomic_files.temporary_path(tmp_path / "a.keras") != atomic_files.temporary_path(tmp_path / "a.keras")


def test_remote_paths_are_written_directly():
    received = []
    assert atomic_files.write_via("gs://bucket/model.keras", lambda path: received.append(path) or "done") == "done"
    assert received == ["gs://bucket/model.keras"]


_FILE_SIZE_LIMIT = """
import os, resource, signal, sys
from kdist import atomic_files
target, limit = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    atomic_files.write_bytes(target, b"n" * 3 * limit)
except OSError as error:
    print("errno", error.errno)
"""


def test_a_write_past_the_file_size_limit_raises_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "state.bin"
    target.write_bytes(b"o" * 3000)
    result = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT, str(target), "1000"],
                            capture_output=True, text=True, timeout=30, check=True, cwd=harness.REPO_ROOT)
    assert result.stdout.split() == ["errno", str(errno.EFBIG)], result.stdout + result.stderr
    assert target.read_bytes() == b"o" * 3000
    assert sorted(os.listdir(tmp_path)) == ["state.bin"]
