"""Tests for kdist.launch.policy's restarts (and spec.RestartPolicy), through a real ProcessSet.

The set mirrors coordinator training: a chief (non-daemon), workers that serve
(daemons with a `RestartPolicy`) and a ps (a daemon without one).
"""

import io
import signal
import sys
import time
from pathlib import Path

import pytest

from kdist.errors import InvalidArgumentError
from kdist.launch import ProcessSet, ProcessSpec
from kdist.launch.spec import MAX_RESTART_DELAY_SECONDS, RestartPolicy

SCRIPTS = Path(__file__).parent / "scripts"
TIMEOUT = 30.0


def worker(counter_file, crashes, how, restart, name="worker-0"):
    argv = [sys.executable, str(SCRIPTS / "crash_then_serve.py"), str(counter_file)]
    return ProcessSpec(name, [*argv, str(crashes), str(how)], daemon=True, restart=restart)


def chief(code, delay):
    argv = [sys.executable, str(SCRIPTS / "exit_code.py"), str(code), str(delay)]
    return ProcessSpec("chief-0", argv)


def blocking(name, daemon=False):
    argv = [sys.executable, str(SCRIPTS / "block.py"), "-", "sleep"]
    return ProcessSpec(name, argv, daemon=daemon)


def run(specs, grace=0.5):
    announcements = io.StringIO()
    with ProcessSet(
        specs, grace_seconds=grace, kill_after_seconds=2, stderr=announcements, stdout=io.StringIO()
    ) as processes:
        processes.start()
        processes.wait(TIMEOUT)
    return processes, announcements.getvalue()


def starts(counter_file):
    return [float(line) for line in Path(counter_file).read_text().splitlines()]


def test_restart_delays_double_up_to_a_cap():
    policy = RestartPolicy(max_restarts=3, backoff_seconds=1.0)
    assert [policy.delay_seconds(n) for n in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 4.0]
    assert policy.delay_seconds(20) == MAX_RESTART_DELAY_SECONDS
    with pytest.raises(InvalidArgumentError, match="Received: max_restarts=-1"):
        RestartPolicy(max_restarts=-1)


def test_a_killed_worker_is_restarted_and_the_chief_decides_the_outcome(tmp_path):
    counter = tmp_path / "worker-0.starts"
    processes, said = run(
        [worker(counter, 1, "kill", RestartPolicy(3, 0.1)), chief(0, 1.5)]
    )

    assert processes.exit_code() == 0 and processes.first_failure() is None
    assert processes.returncodes == {"worker-0": -signal.SIGTERM, "chief-0": 0}
    assert len(starts(counter)) == 2
    assert "worker-0 (pid" in said and "was killed by SIGKILL; restarting it (1 of 3) in 0s" in said
    assert "restarted worker-0 (pid" in said
    output = processes.output("worker-0")
    assert "start 1\n" in output and "start 2\nready\n" in output


def test_the_chiefs_failure_is_the_jobs_exit_code_after_a_restart(tmp_path):
    counter = tmp_path / "worker-0.starts"
    processes, _ = run([worker(counter, 1, "kill", RestartPolicy(3, 0.1)), chief(5, 1.5)])

    assert processes.first_failure() == ("chief-0", 5)
    assert processes.exit_code() == 5
    assert len(starts(counter)) == 2


def test_restarts_are_bounded_with_a_doubling_delay_then_the_worker_fails_the_job(tmp_path):
    counter = tmp_path / "worker-0.starts"
    processes, said = run(
        [worker(counter, 99, "3", RestartPolicy(3, 0.2)), blocking("chief-0")], grace=0.2
    )

    assert processes.first_failure() == ("worker-0", 3)
    assert processes.exit_code() == 3
    assert processes.returncodes["chief-0"] == -signal.SIGABRT  # Today's fail-fast rule.
    times = starts(counter)
    assert len(times) == 4
    assert times[2] - times[1] >= 0.2 and times[3] - times[2] >= 0.4
    assert "restarting it (1 of 3) in 0s" in said and "restarting it (2 of 3) in 0.2s" in said
    assert "restarting it (3 of 3) in 0.4s" in said
    assert "all 3 restarts used, so it fails" in said


def test_zero_restarts_is_todays_fail_fast(tmp_path):
    counter = tmp_path / "worker-0.starts"
    processes, said = run(
        [worker(counter, 1, "kill", RestartPolicy(0, 0.1)), blocking("chief-0")], grace=0.2
    )

    assert processes.first_failure() == ("worker-0", -signal.SIGKILL)
    assert len(starts(counter)) == 1 and "restarting" not in said


def test_a_ps_death_still_fails_fast_and_stops_restarts(tmp_path):
    counter = tmp_path / "worker-0.starts"
    ps = ProcessSpec(
        "ps-0", [sys.executable, str(SCRIPTS / "exit_code.py"), "4", "2.0"], daemon=True
    )
    processes, said = run(
        [ps, worker(counter, 2, "kill", RestartPolicy(3, 5.0)), blocking("chief-0")], grace=0.2
    )

    assert processes.first_failure() == ("ps-0", 4)
    assert processes.exit_code() == 4
    assert processes.returncodes["chief-0"] == -signal.SIGABRT
    # The worker's second restart (5 s of backoff) was pending when the ps failed: it
    # is dropped, not counted.
    assert len(starts(counter)) == 2
    assert processes.returncodes["worker-0"] == -signal.SIGKILL


def test_a_pending_restart_does_not_outlive_the_chief(tmp_path):
    counter = tmp_path / "worker-0.starts"
    started = time.monotonic()
    processes, _ = run([worker(counter, 2, "kill", RestartPolicy(3, 20.0)), chief(0, 1.0)])

    assert processes.exit_code() == 0
    assert len(starts(counter)) == 2  # the second restart waits 20 s: the chief ends first
    assert time.monotonic() - started < 10


def test_a_stop_request_cancels_a_pending_restart(tmp_path):
    counter = tmp_path / "worker-0.starts"
    restart = RestartPolicy(3, 20.0)
    with ProcessSet(
        [worker(counter, 2, "kill", restart), blocking("chief-0")], echo=False
    ) as processes:
        processes.start()
        assert processes.wait_for_exit("worker-0", TIMEOUT) == -signal.SIGKILL
        assert processes.poll() is None  # The first restart is immediate: poll makes it.
        assert processes.wait_for_exit("worker-0", TIMEOUT) == -signal.SIGKILL
        assert processes.poll() is None  # The second is pending (20 s): the set is not done.
        processes.request_stop("asked by the test", timeout=2)
        started = time.monotonic()
        processes.wait(TIMEOUT)

    assert time.monotonic() - started < 10
    assert processes.first_failure() is None and len(starts(counter)) == 2
