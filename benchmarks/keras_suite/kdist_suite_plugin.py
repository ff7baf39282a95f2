"""pytest plugin: runs Keras' own tests with every model created inside a kdist strategy's scope.

Loaded by `benchmarks/keras_suite/run.py` (`-p kdist_suite_plugin`). With
`--kdist-mirrored`, each test runs inside
`kdist.MirroredStrategy(["cpu:0", "cpu:1"]).scope()` (a fresh strategy per test),
so every model the test creates or compiles is attached to two replicas. Without
it, the same tests run on plain Keras (the baseline of the comparison).

It also plays the part of Keras' own `conftest.py` (not shipped in the sdist):
the `requires_trainable_backend` and `multi_device` markers.
"""

import pytest

import kdist  # before Keras: kdist installs its hooks (KERAS_BACKEND is set by the runner)


def pytest_addoption(parser):
    parser.addoption("--kdist-mirrored", action="store_true",
                     help="run each test inside MirroredStrategy(['cpu:0', 'cpu:1']).scope()")


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_trainable_backend: needs a backend that trains")
    config.addinivalue_line("markers", "multi_device: needs several accelerators")


def pytest_collection_modifyitems(config, items):
    # As Keras' conftest: multi_device tests need real accelerators (Keras' CI runs
    # them separately); skip them in both runs so the comparison is like for like.
    skip = pytest.mark.skip(reason="multi_device: needs several accelerators")
    for item in items:
        if "multi_device" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _kdist_strategy_scope(request):
    if not request.config.getoption("--kdist-mirrored"):
        yield None
        return
    strategy = kdist.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        yield strategy
