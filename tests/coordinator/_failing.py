"""Functions that failure and security tests send to their workers.

Module-level functions travel by reference (workers import this module);
the wrappers made by the `make_*` factories travel by value with the
resources (model, optimizer, metric, iterator) they close over.
"""

import os
import socket
import threading
import time
import uuid

import kdist

# How long a held closure waits for the test to kill its worker; a test that
# forgot to kill it fails on its own timeout long before this.
HOLD_SECONDS = 120.0


class UnpicklableError(Exception):
    """An exception that cannot be pickled: it holds a lock."""

    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def raise_unpicklable(message):
    raise UnpicklableError(message)


def work(seconds, value):
    """Stands in for a step that takes `seconds` (a workload, not a wait for a condition)."""
    time.sleep(seconds)
    return value


def pid():
    return os.getpid()


def make_held_step(worker_fn, hold_address, fresh_update_ids=False):
    """`worker_fn` wrapped to report its worker's pid and hold, after its pushes, when `hold` is true.

    A held closure connects to `hold_address` (the test's listening socket),
    sends the pid of its worker and blocks until the test kills that worker:
    its updates already reached the parameter servers, its result never
    reaches the coordinator. When the test no longer listens (the retry of
    the same closure on another worker), the closure just returns.

    `fresh_update_ids=True` is the negative control: every run pushes under
    new idempotency keys, as if keys were not derived from the closure, so a
    retried closure's updates count twice.
    """

    def step(iterator, hold=False):
        if fresh_update_ids:
            store = kdist.get_strategy().extended.variable_router
            with store.idempotent_updates(uuid.uuid4().hex):
                loss = worker_fn(iterator)
        else:
            loss = worker_fn(iterator)
        if hold:
            try:
                connection = socket.create_connection(hold_address, timeout=5.0)
            except OSError:
                return loss
            with connection:
                connection.sendall(f"{os.getpid()}\n".encode())
                connection.settimeout(HOLD_SECONDS)
                connection.recv(1)
        return loss

    return step


def make_step_with_pid(worker_fn):
    """`worker_fn` wrapped to return `(pid of the worker, loss)`."""

    def step(iterator):
        return os.getpid(), worker_fn(iterator)

    return step


def hold(address):
    """Keeps its worker busy until the test closes the connection it opened to `address`."""
    with socket.create_connection(address, timeout=5.0) as connection:
        connection.sendall(f"{os.getpid()}\n".encode())
        connection.settimeout(HOLD_SECONDS)
        connection.recv(1)
    return "released"
