"""ClusterCoordinator under failures: killed workers and parameter servers, raising functions.

Real `kdist server` processes on loopback (`_cluster`); workers and parameter
servers are killed with SIGKILL, as a crashed or preempted machine would be.
"""

import contextlib
import socket
import time

import pytest

import kdist
import kdist.coordinator
import keras
from kdist.coordinator import RemoteValueStatus
from kdist.errors import CancelledError, OutOfRangeError, RemoteFunctionError, RemoteTraceback
from tests.coordinator import _cluster, _failing, _functions

# An unfailed run of the same custom loop (3 workers, 90 steps) reaches about
# 0.9 test accuracy; well above chance (0.1), with room for the asynchrony.
MIN_ACCURACY = 0.8
# How long a restarted worker may take to get work again: its dispatcher calls
# it every `worker_retry_seconds`, and it imports Keras and torch first.
RESTART_SECONDS = 90.0


def _train_state(strategy):
    with strategy.scope():
        model = _functions.build_model()
        optimizer = keras.optimizers.Adam(0.02)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    return model, optimizer, accuracy, _functions.make_train_step(strategy, model, optimizer, accuracy, loss_fn)


def _worker_index(cluster, pid):
    """The index of the worker task whose current process is `pid`."""
    for (job, index), (name, processes) in cluster._processes.items():
        if job == "worker" and processes.pids.get(name) == pid:
            return index
    raise AssertionError(f"No worker process has pid {pid}: {cluster._processes}")


def _worker_pid(cluster, index):
    name, processes = cluster._processes[("worker", index)]
    return processes.pids[name]


@contextlib.contextmanager
def _listener():
    """A loopback socket a held closure reports to (see `_failing.make_held_step`)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(120.0)
    try:
        yield listener
    finally:
        listener.close()


@pytest.mark.timeout(240)
def test_killed_worker_mid_closure_every_step_applied_once_and_restarted_worker_gets_work(tmp_path):
    steps, held_step = 90, 30
    with _cluster.start(num_workers=3, num_ps=1, tmp_path=tmp_path) as cluster, _listener() as listener:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        coordinator = kdist.coordinator.ClusterCoordinator(strategy)
        iterator = iter(coordinator.create_per_worker_dataset(_functions.dataset_fn))
        model, optimizer, accuracy, worker_fn = _train_state(strategy)
        step = _failing.make_held_step(worker_fn, listener.getsockname())
        values = [coordinator.schedule(step, args=(iterator,), kwargs={"hold": index == held_step})
                  for index in range(steps)]
        # The held closure has pushed its updates; its worker dies before it answers.
        connection, _ = listener.accept()
        with connection:
            held_pid = int(connection.makefile().readline())
            listener.close()  # the closure's retry finds nobody listening and returns
            killed = _worker_index(cluster, held_pid)
            cluster.kill("worker", killed)
        coordinator.join()
        assert all(value.status is RemoteValueStatus.READY for value in values)
        stats = coordinator.stats
        [ps_stats] = cluster.ps_stats()
        x_test, y_test = _functions.make_digits(500, seed=7)
        test_accuracy = _functions.accuracy_of(model, x_test, y_test)
        # Every closure's metric state counted once: the held run's never arrived.
        assert float(accuracy.count.numpy()) == steps * _functions.BATCH
        assert stats["closures_done"] == steps
        assert stats["worker_failures"] >= 1 and stats["closures_retried"] >= 1, stats
        # Each variable got every scheduled step once: the retry's push of the
        # held closure was recognised by its idempotency key and dropped.
        assert len(ps_stats.variables) == 4
        assert {v.applied_updates for v in ps_stats.variables.values()} == {steps}
        assert ps_stats.deduplicated_updates >= 1, ps_stats
        assert test_accuracy >= MIN_ACCURACY, test_accuracy

        # The restarted worker (a new process on the same port) gets work again,
        # with the model and its per-worker iterator rebuilt there.
        cluster.restart("worker", killed)
        restarted_pid = _worker_pid(cluster, killed)
        step_with_pid = _failing.make_step_with_pid(worker_fn)
        started, extra_steps, pids = time.monotonic(), 0, set()
        while restarted_pid not in pids:
            assert time.monotonic() - started < RESTART_SECONDS, (
                f"worker {killed} (pid {restarted_pid}) got no work; results came from {pids}")
            round_values = [coordinator.schedule(step_with_pid, args=(iterator,)) for _ in range(6)]
            coordinator.join()
            extra_steps += len(round_values)
            pids.update(int(pid) for pid, _ in coordinator.fetch(round_values))
        print(f"restarted worker got work after {time.monotonic() - started:.1f} s, {extra_steps} extra steps")
        [ps_stats] = cluster.ps_stats()
        coordinator.shutdown()
    assert held_pid not in pids
    assert {v.applied_updates for v in ps_stats.variables.values()} == {steps + extra_steps}
