"""Concurrent pushes: every one applied exactly once, atomically."""

import threading

import numpy as np
import pytest

from kdist.ps import DenseGradient, RowGradient, VariableClient, VariableInit
from tests.ps.conftest import sgd_config

pytestmark = pytest.mark.timeout(120)

NUM_THREADS = 3
PUSHES_PER_THREAD = 20


def _run_threads(target):
    errors = []

    def guarded(index):
        try:
            target(index)
        except BaseException as error:  # reported below, with the thread's index
            errors.append((index, error))

    threads = [threading.Thread(target=guarded, args=(index,)) for index in range(NUM_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a pushing thread hung"
    assert not errors, errors


def test_concurrent_pushes_are_each_applied_exactly_once(server, options):
    size = 5000  # several chunks per push
    with VariableClient(server.address, options=options) as setup:
        setup.create([VariableInit("w", np.zeros(size, "float32")),
                      VariableInit("table", np.zeros((10, 2), "float32"))])
        setup.configure_optimizer(sgd_config(1.0), ["w", "table"])

    def push_many(index):
        # One client per thread (separate channels), as separate workers have.
        with VariableClient(server.address, options=options) as client:
            for _ in range(PUSHES_PER_THREAD):
                client.push([DenseGradient("w", np.full(size, index + 1, "float32")),
                              RowGradient("table", np.array([index, index]),
                                          np.ones((2, 2), "float32"))])

    _run_threads(push_many)
    num_pushes = NUM_THREADS * PUSHES_PER_THREAD
    stats = server.stats()
    assert stats.variables["w"].applied_updates == num_pushes
    assert stats.variables["w"].version == num_pushes
    assert stats.applied_pushes == num_pushes
    assert stats.requests["push"] == num_pushes
    with VariableClient(server.address, options=options) as client:
        [weights, table] = client.pull(["w", "table"])
    # SGD(1.0): w = -sum of every gradient; a lost or doubled push changes it.
    expected = -PUSHES_PER_THREAD * sum(index + 1 for index in range(NUM_THREADS))
    np.testing.assert_array_equal(weights.value, np.full(size, expected))
    np.testing.assert_array_equal(table.value[:NUM_THREADS], np.full((NUM_THREADS, 2),
                                                                     -2.0 * PUSHES_PER_THREAD))


def test_one_client_shared_by_threads(client):
    client.create([VariableInit("w", np.zeros(3, "float32"))])
    client.configure_optimizer(sgd_config(1.0), ["w"])

    def push_and_pull(index):
        for _ in range(PUSHES_PER_THREAD):
            client.push([DenseGradient("w", np.ones(3, "float32"))])
            client.pull(["w"])

    _run_threads(push_and_pull)
    [state] = client.pull(["w"])
    assert state.version == NUM_THREADS * PUSHES_PER_THREAD
    np.testing.assert_array_equal(state.value, np.full(3, -NUM_THREADS * PUSHES_PER_THREAD))
