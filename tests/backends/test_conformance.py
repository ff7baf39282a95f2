"""The Strategy API conformance checks on every Keras backend (torch, TensorFlow, JAX).

Each check of `conformance_worker.py` becomes one test per backend: contexts,
`run`, `reduce` axis semantics, `gather`, `merge_call`/`all_reduce` (or, on
JAX, their documented error), distributed datasets, and a model trained in
and out of the scope.
"""

import ast
from pathlib import Path

import pytest

from tests.backends import _matrix

WORKER = Path(__file__).with_name("conformance_worker.py")

pytestmark = pytest.mark.timeout(300)


def _check_names():
    tree = ast.parse(WORKER.read_text(encoding="utf-8"))
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(getattr(decorator, "id", None) == "check" for decorator in node.decorator_list)]


CHECKS = _check_names()


def test_the_worker_defines_checks():
    assert len(CHECKS) >= 15, CHECKS


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("backend", _matrix.BACKENDS)
def test_conformance(backend, check):
    _matrix.require_installed(backend)
    output = _matrix.run_worker(WORKER, backend)
    reports = {report["name"]: report for report in _matrix.lines(output, "CHECK")}
    assert set(reports) == set(CHECKS), f"the worker reported {sorted(reports)}\n{output}"
    report = reports[check]
    assert report["status"] == "passed", f"{check} on {backend}:\n{report['detail']}"
