"""Test-wide setup: Keras must see the torch backend before any test module imports it."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")
# This process talks gRPC (in-process parameter servers and clients) and forks
# children (tests/harness.py). With gRPC's fork support on, a forked child
# restarts gRPC's poller thread, which dies on the epoll descriptor that
# subprocess closes before exec: the child aborts (SIGABRT) before it runs
# (grpc/grpc#43055). Must be set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

# Every kdist service refuses callers without the cluster secret. The tests'
# servers, clients and child processes (which inherit this environment) share one
# secret per run, as the tasks of a `kdist launch` job do; tests of refusals give
# other secrets or none explicitly.
import secrets  # noqa: E402

os.environ.setdefault("KDIST_SECRET", secrets.token_urlsafe(32))

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible")
    for item in items:
        # The marker, not a keyword: a parametrize id that reads "gpu" is not a GPU test.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_configure(config):
    # The `kdist launch` processes tests start fork their ranks from this session's
    # zygotes (one import of torch and Keras per environment for the whole run, not
    # one per job), through a broker only this session's children can reach.
    from kdist.launch import warm, warm_broker

    if warm.enabled() and warm_broker.VARIABLE not in os.environ:
        broker = warm_broker.Broker()
        os.environ[warm_broker.VARIABLE] = broker.value
        config.add_cleanup(broker.close)
