"""ClusterCoordinator under failures: killed workers and parameter servers, raising functions.

Real `kdist server` processes on loopback (`_cluster`); workers and parameter
servers are killed with SIGKILL, as a crashed or preempted machine would be.
"""

import contextlib
import json
import socket
import sys
import time
from pathlib import Path

import pytest

import kdist
import kdist.coordinator
from kdist.coordinator import RemoteValueStatus
from kdist.errors import CancelledError, OutOfRangeError, RemoteFunctionError, RemoteTraceback
from tests import harness
from tests.coordinator import _cluster, _failing, _functions

CHIEF_SCRIPT = Path(__file__).with_name("_fit_chief.py")

# An unfailed run of the same custom loop (3 workers, 90 steps, measured the
# same way) reaches about 0.6 test accuracy, 0.75 after 180 steps: three
# workers pushing Adam steps asynchronously learn slower per step than two.
# Five times chance (0.1), with room for the asynchrony.
MIN_ACCURACY = 0.5
# Asynchronous runs of the same length differ by up to about 0.1 in test accuracy
# (the order of pushes differs); the failed run may not fall further behind.
ACCURACY_TOLERANCE = 0.15
# How long a restarted worker may take to get work again: its dispatcher calls
# it every `worker_retry_seconds`, and it imports Keras and torch first.
RESTART_SECONDS = 20.0


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


@contextlib.contextmanager
def _a_worker_killed_mid_closure(tmp_path, steps, held_step, fresh_update_ids=False):
    """3 workers train `steps` closures; the worker running closure `held_step` dies after its push.

    Yields `(cluster, coordinator, worker_fn, iterator, killed index, facts)`
    once `join()` returned; `facts` holds the coordinator's and the ps's
    stats, the chief's accuracy count and the test accuracy.
    """
    with _cluster.start(num_workers=3, num_ps=1, tmp_path=tmp_path) as cluster, _listener() as listener:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        coordinator = kdist.coordinator.ClusterCoordinator(strategy)
        iterator = iter(coordinator.create_per_worker_dataset(_functions.dataset_fn))
        model, optimizer, accuracy, worker_fn = _functions.train_state(strategy)
        step = _failing.make_held_step(worker_fn, listener.getsockname(), fresh_update_ids)
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
        x_test, y_test = _functions.make_digits(500, seed=7)
        facts = {
            "stats": coordinator.stats,
            "ps": cluster.ps_stats()[0],
            "count": float(accuracy.count.numpy()),
            "test_accuracy": _functions.accuracy_of(model, x_test, y_test),
        }
        yield cluster, coordinator, worker_fn, iterator, killed, facts
        coordinator.shutdown()


@pytest.mark.timeout(240)
def test_killed_worker_mid_closure_every_step_applied_once_and_restarted_worker_gets_work(tmp_path):
    steps, held_step = 90, 30
    with _a_worker_killed_mid_closure(tmp_path, steps, held_step) as (cluster, coordinator, worker_fn, iterator,
                                                                      killed, facts):
        stats, ps_stats, test_accuracy = facts["stats"], facts["ps"], facts["test_accuracy"]
        # Every closure's metric state counted once: the held run's never arrived.
        assert facts["count"] == steps * _functions.BATCH
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

        # The unfailed reference: a fresh model trained the same way on the same 3 workers.
        strategy = coordinator.strategy
        model, _, _, reference_fn = _functions.train_state(strategy)
        reference_iterator = iter(coordinator.create_per_worker_dataset(_functions.dataset_fn))
        for _ in range(steps):
            coordinator.schedule(reference_fn, args=(reference_iterator,))
        coordinator.join()
        x_test, y_test = _functions.make_digits(500, seed=7)
        unfailed_accuracy = _functions.accuracy_of(model, x_test, y_test)
    print(f"test accuracy after the failed run: {test_accuracy:.3f}, unfailed run: {unfailed_accuracy:.3f}")
    assert {v.applied_updates for v in ps_stats.variables.values()} == {steps + extra_steps}
    assert test_accuracy >= unfailed_accuracy - ACCURACY_TOLERANCE, (test_accuracy, unfailed_accuracy)


@pytest.mark.timeout(240)
def test_negative_control_without_stable_update_ids_the_retried_closure_counts_twice(tmp_path):
    """The same failure, but each run of a closure pushes under fresh keys: the ps applies both."""
    steps, held_step = 12, 4
    with _a_worker_killed_mid_closure(tmp_path, steps, held_step, fresh_update_ids=True) as (*_, facts):
        ps_stats = facts["ps"]
    assert facts["count"] == steps * _functions.BATCH  # metrics still count the closure once
    assert {v.applied_updates for v in ps_stats.variables.values()} == {steps + 1}
    assert ps_stats.deduplicated_updates == 0


# ----- parameter server failures --------------------------------------------------------
PS_UNAVAILABLE_SECONDS = 5.0
# The documented bound is `ps_unavailable_seconds` plus one health-check round
# (1 s period, 2 s deadline); the rest is slack for two busy cores.
PS_DETECTION_BOUND = PS_UNAVAILABLE_SECONDS + 30.0


@pytest.mark.timeout(180)
def test_killed_ps_raises_parameter_server_unavailable_within_the_bound(tmp_path):
    with _cluster.start(num_workers=2, num_ps=1, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        coordinator = kdist.coordinator.ClusterCoordinator(strategy, ps_unavailable_seconds=PS_UNAVAILABLE_SECONDS)
        iterator = iter(coordinator.create_per_worker_dataset(_functions.dataset_fn))
        _, _, _, worker_fn = _functions.train_state(strategy)
        values = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(400)]
        values[20].get(timeout=120)
        cluster.kill("ps", 0)
        killed_at = time.monotonic()
        # Reported by a worker whose pull or push failed, or by the health
        # checks, whichever comes first.
        with pytest.raises(kdist.errors.ParameterServerUnavailableError) as raised:
            coordinator.join()
        training_detection = time.monotonic() - killed_at
        print(f"join raised: {str(raised.value)[:300]}")
        assert raised.value.address == cluster.spec["ps"][0]
        assert any(value.status is RemoteValueStatus.CANCELLED for value in values)
        coordinator.shutdown()

        # Workers busy with functions that never reach the parameter server:
        # the coordinator's own health checks notice the outage.
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        coordinator = kdist.coordinator.ClusterCoordinator(strategy, ps_unavailable_seconds=PS_UNAVAILABLE_SECONDS)
        started = time.monotonic()
        for _ in range(coordinator.num_workers):
            coordinator.schedule(_failing.work, args=(PS_UNAVAILABLE_SECONDS + 5.0, None))
        with pytest.raises(kdist.errors.ParameterServerUnavailableError):
            coordinator.join()
        watchdog_detection = time.monotonic() - started
        coordinator.shutdown()
    print(f"ps failure detected after {training_detection:.1f} s during training, "
          f"{watchdog_detection:.1f} s by the health checks alone")
    assert training_detection < PS_DETECTION_BOUND
    assert PS_UNAVAILABLE_SECONDS <= watchdog_detection < PS_DETECTION_BOUND


def _chief_spec(name, cluster, backup_dir, epochs, pause_port=0, pause_after_epoch=0):
    command = [sys.executable, str(CHIEF_SCRIPT), "--cluster", str(cluster.cluster_file),
               "--backup-dir", str(backup_dir), "--epochs", str(epochs),
               "--ps-unavailable-seconds", str(PS_UNAVAILABLE_SECONDS),
               "--pause-after-epoch", str(pause_after_epoch), "--pause-port", str(pause_port)]
    return harness.ProcessSpec(name, tuple(command), {}, cwd=str(harness.REPO_ROOT))


def _history(output):
    [line] = [line for line in output.splitlines() if line.startswith("history ")]
    return json.loads(line[len("history "):])


@pytest.mark.timeout(240)
def test_chief_relaunched_after_ps_failure_resumes_from_backup(tmp_path):
    epochs, pause_after_epoch = 4, 2
    backup_dir = tmp_path / "backup"
    with _cluster.start(num_workers=2, num_ps=1, tmp_path=tmp_path) as cluster, _listener() as listener:
        with harness.start([_chief_spec("chief-0", cluster, backup_dir, epochs, listener.getsockname()[1],
                                        pause_after_epoch)]) as first:
            connection, _ = listener.accept()
            with connection:
                assert connection.makefile().readline().strip() == f"epoch {pause_after_epoch} done"
                cluster.kill("ps", 0)
                killed_at = time.monotonic()
            returncode = first.wait_for_exit("chief-0", timeout=PS_DETECTION_BOUND + 30)
            exit_time = time.monotonic() - killed_at
            first_output = first.output("chief-0")
        assert returncode not in (None, 0), first_output
        assert "ParameterServerUnavailableError" in first_output, first_output
        assert exit_time < PS_DETECTION_BOUND, (exit_time, first_output)
        first_losses = [float(line.split("loss=")[1]) for line in first_output.splitlines()
                        if line.startswith("epoch ")]
        assert len(first_losses) == pause_after_epoch, first_output

        # A fresh parameter server on the same port; the workers stayed up.
        cluster.restart("ps", 0)
        second = harness.run([_chief_spec("chief-0", cluster, backup_dir, epochs)], timeout=150).check()
        history = _history(second.output("chief-0"))
    print(f"chief exited {exit_time:.1f} s after the ps was killed; first run's losses {first_losses}, "
          f"resumed run: {history}")
    # Resumed after the last backed-up epoch, from the backed-up weights.
    assert history["epochs"] == list(range(pause_after_epoch, epochs))
    assert len(history["loss"]) == epochs - pause_after_epoch
    assert history["loss"][0] < first_losses[0]


# ----- functions that raise ------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with _cluster.start(num_workers=2, num_ps=1, tmp_path=tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def coordinator(cluster):
    strategy = kdist.ParameterServerStrategy(cluster.resolver())
    # One closure per worker at a time (TensorFlow's behaviour): closures behind
    # a failing one are still queued, not already sent, when it fails.
    coordinator = kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
    yield coordinator
    coordinator.shutdown()


@pytest.mark.timeout(120)
def test_raising_function_reraises_with_worker_traceback_and_cancels_the_queue(coordinator):
    with _listener() as listener:
        # One worker is kept busy, so the closures behind the failing one are
        # still queued when it fails.
        held = coordinator.schedule(_failing.hold, args=(listener.getsockname(),))
        connection, _ = listener.accept()
        with connection:
            connection.makefile().readline()  # the held worker's pid: it is busy now
            failing = coordinator.schedule(_functions.fail, args=("boom",))
            queued = [coordinator.schedule(_failing.work, args=(0.0, index)) for index in range(5)]
            with pytest.raises(ValueError, match="boom") as raised:
                coordinator.join()
    cause = raised.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "in fail" in cause.traceback and "ValueError: boom" in cause.traceback
    assert failing.status is RemoteValueStatus.FAILED
    with pytest.raises(ValueError, match="boom"):
        failing.fetch()
    for value in queued:
        assert value.status is RemoteValueStatus.CANCELLED
        with pytest.raises(CancelledError):
            value.fetch()
    # The closure that was running when the other failed still finishes, and
    # the coordinator takes new work.
    assert held.get(timeout=60) == "released"
    after = coordinator.schedule(_failing.work, args=(0.0, 7))
    coordinator.join()
    assert after.fetch() == 7


@pytest.mark.timeout(120)
def test_unpicklable_exception_becomes_remote_function_error(coordinator):
    coordinator.schedule(_failing.raise_unpicklable, args=("cannot travel",))
    with pytest.raises(RemoteFunctionError) as raised:
        coordinator.join()
    error = raised.value
    assert error.error_type == "tests.coordinator._failing.UnpicklableError"
    assert "in raise_unpicklable" in error.traceback
    assert "cannot travel" in str(error)
    assert error.worker in coordinator.strategy.extended.cluster_resolver.cluster_spec().job_tasks("worker")


@pytest.mark.timeout(120)
def test_exhausted_per_worker_iterator_raises_out_of_range(coordinator):
    def two_items():
        return [1, 2]

    iterator = iter(coordinator.create_per_worker_dataset(two_items))
    # Two workers, two items each: a fifth next() runs out wherever it runs.
    for _ in range(5):
        coordinator.schedule(next, args=(iterator,))
    with pytest.raises(OutOfRangeError) as raised:
        coordinator.join()
    assert isinstance(raised.value.__cause__, RemoteTraceback)
    assert "StopIteration" in raised.value.__cause__.traceback
