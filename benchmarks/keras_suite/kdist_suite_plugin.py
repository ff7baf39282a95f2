"""pytest plugin: runs Keras' own tests with every model created inside a kdist strategy's scope.

Loaded by `benchmarks/keras_suite/run.py` (`-p kdist_suite_plugin`). With
`--kdist-mirrored`, each test runs inside
`kdist.MirroredStrategy(["cpu:0", "cpu:1"]).scope()` (a fresh strategy per test),
so every model the test creates or compiles is attached to two replicas. Without
it, the same tests run on plain Keras (the baseline of the comparison).

With `--kdist-multi-worker`, pytest runs in each process of a
`kdist launch --nproc N` job and every test runs inside the scope of one
`kdist.MultiWorkerMirroredStrategy()` made for the session (one CPU replica per
process). Every rank collects and runs the same tests in the same order, so the
strategy's collectives pair up; each rank writes its own junit file
(`NAME-rankR.xml` for `--junitxml=NAME.xml`).

With `--kdist-offline` (the runner passes it for keras-hub and keras-rs), a socket
may connect to this host only: a test that would download weights or data fails
with `ConnectionRefusedError` instead, in both runs.

It also plays the part of Keras' own `conftest.py` (not shipped in the sdist):
the `requires_trainable_backend` and `multi_device` markers.
"""

import ipaddress
import pathlib
import socket

import pytest

import kdist  # before Keras: kdist installs its hooks (KERAS_BACKEND is set by the runner)


def pytest_addoption(parser):
    parser.addoption("--kdist-mirrored", action="store_true",
                     help="run each test inside MirroredStrategy(['cpu:0', 'cpu:1']).scope()")
    parser.addoption("--kdist-multi-worker", action="store_true",
                     help="under kdist launch: run each test inside one MultiWorkerMirroredStrategy's scope")
    parser.addoption("--kdist-offline", action="store_true",
                     help="refuse every socket connection except to this host (nothing downloads)")


# The session's MultiWorkerMirroredStrategy (--kdist-multi-worker): one process group per process.
_multi_worker = {}


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # tryfirst: before junitxml's own pytest_configure opens the file named by --junitxml.
    if config.getoption("--kdist-multi-worker"):
        strategy = kdist.MultiWorkerMirroredStrategy()
        _multi_worker["strategy"] = strategy
        if config.option.xmlpath:
            config.option.xmlpath = rank_xml_path(config.option.xmlpath, strategy.extended.collectives.rank)
    config.addinivalue_line("markers", "requires_trainable_backend: needs a backend that trains")
    config.addinivalue_line("markers", "multi_device: needs several accelerators")
    if config.getoption("--kdist-offline"):
        _refuse_remote_connections()


def pytest_sessionfinish(session):
    # Every rank leaves together: the launcher stops the others once one process exits
    # non-zero (a failed test), and a rank may still be running its last test.
    if "strategy" in _multi_worker:
        _multi_worker["strategy"].extended.collectives.barrier("keras_suite session end")


def rank_xml_path(path, rank):
    """`NAME-rankR.xml` for `NAME.xml`: each rank of a multi-worker run writes its own junit file."""
    path = pathlib.Path(path)
    return str(path.with_name(f"{path.stem}-rank{rank}{path.suffix}"))


def _is_local(address):
    if not isinstance(address, tuple):
        return True  # a Unix socket's path
    host = address[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a host name other than localhost


def _refuse_remote_connections():
    """Makes `socket.connect`/`connect_ex` refuse every address that is not this host."""
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guarded_connect(sock, address):
        if not _is_local(address):
            raise ConnectionRefusedError(f"kdist_suite_plugin --kdist-offline: no downloads. Received: address={address!r}")
        return connect(sock, address)

    def guarded_connect_ex(sock, address):
        if not _is_local(address):
            raise ConnectionRefusedError(f"kdist_suite_plugin --kdist-offline: no downloads. Received: address={address!r}")
        return connect_ex(sock, address)

    socket.socket.connect, socket.socket.connect_ex = guarded_connect, guarded_connect_ex


def pytest_collection_modifyitems(config, items):
    # As Keras' conftest: multi_device tests need real accelerators (Keras' CI runs
    # them separately); skip them in both runs so the comparison is like for like.
    skip = pytest.mark.skip(reason="multi_device: needs several accelerators")
    for item in items:
        if "multi_device" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _kdist_strategy_scope(request):
    if request.config.getoption("--kdist-multi-worker"):
        strategy = _multi_worker["strategy"]
        with strategy.scope():
            yield strategy
        return
    if not request.config.getoption("--kdist-mirrored"):
        yield None
        return
    strategy = kdist.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        yield strategy
