"""Launcher tests keep the launcher's default log directories in each test's own tmp_path.

Without `--log-dir`, `kdist launch` writes the processes' logs to a new
`kdist-launch-*` directory in the temporary directory and keeps it when the job
fails; many tests here fail jobs on purpose.
"""

import tempfile

import pytest


@pytest.fixture(autouse=True)
def temporary_directory_per_test(tmp_path, monkeypatch):
    directory = tmp_path / "tmp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))  # `kdist launch` run in this process.
    monkeypatch.setenv("TMPDIR", str(directory))  # ... and run as a child process.
    return directory
