"""Runs a worker script once per Keras backend, through the test harness.

A process can drive one Keras backend only, so each backend's checks run in a
child process of their own (`KERAS_BACKEND` set for it) and report JSON lines.
A backend that is not installed is skipped with the install command, except
under CI (`CI=true`), where the matrix must run in full.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from tests import harness

BACKENDS = ("torch", "tensorflow", "jax")
TIMEOUT_SECONDS = 240.0


def require_installed(backend):
    """Skips (or, under CI, fails) when `backend`'s package is missing."""
    if backend == "torch" or importlib.util.find_spec(backend) is not None:
        return
    message = f"{backend} is not installed: pip install -e '.[backends]'"
    if os.environ.get("CI") == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


_runs = {}


def run_worker(script, backend):
    """The stdout of one worker run, run once per (script, backend) per session.

    A failed run fails every test that reads it, with the same message, without
    running the worker again.
    """
    key = (str(script), backend)
    if key not in _runs:
        spec = harness.ProcessSpec(f"{backend}-0", (sys.executable, str(script)), {"KERAS_BACKEND": backend},
                                   cwd=str(harness.REPO_ROOT))
        try:
            result = harness.run([spec], timeout=TIMEOUT_SECONDS).check()
            _runs[key] = (True, result.output(f"{backend}-0", "stdout"))
        except BaseException as error:  # AssertionError, or pytest's Failed on a hang
            _runs[key] = (False, str(error))
    succeeded, text = _runs[key]
    if not succeeded:
        pytest.fail(f"{Path(script).name} failed on {backend}:\n{text}", pytrace=False)
    return text


def lines(output, prefix):
    """The JSON documents of `output`'s lines that start with `prefix + " "`."""
    return [json.loads(line[len(prefix) + 1:]) for line in output.splitlines() if line.startswith(prefix + " ")]
