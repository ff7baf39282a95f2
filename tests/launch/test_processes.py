"""Tests for kdist.launch.processes: output, exit codes, fail-fast, daemons, timeouts, stops."""

import signal
import sys
import time
from pathlib import Path

import pytest

from kdist.errors import InvalidArgumentError
from kdist.launch import ProcessSet, ProcessSetStateError, ProcessSetTimeout, ProcessSpec

SCRIPTS = Path(__file__).parent / "scripts"
# Every wait in these tests is bounded by this; reaching it is a failure.
TIMEOUT = 30.0
STACK_MARKER = "most recent call first"


def exits(name, code, delay=0.0, daemon=False):
    return ProcessSpec(
        name, [sys.executable, str(SCRIPTS / "exit_code.py"), str(code), str(delay)], daemon=daemon
    )


def blocks(name, how="sleep", daemon=False):
    return ProcessSpec(name, [sys.executable, str(SCRIPTS / "block.py"), "-", how], daemon=daemon)


def run(specs, timeout=TIMEOUT, **options):
    options.setdefault("echo", False)
    with ProcessSet(specs, **options) as processes:
        processes.start()
        processes.wait(timeout)
    return processes


def test_lines_are_prefixed_and_kept_per_stream(capsys):
    processes = run([exits("worker-0", 0), exits("worker-1", 0)], echo=True)

    captured = capsys.readouterr()
    for name in ("worker-0", "worker-1"):
        assert f"[{name}] out line\n" in captured.out
        assert f"[{name}] exiting with 0\n" in captured.out
        assert f"[{name}] err line\n" in captured.err
        assert f"[{name}] err line" not in captured.out
        assert processes.output(name, "stdout") == "out line\nexiting with 0\n"
        assert processes.output(name, "stderr") == "err line\n"
        assert "out line\n" in processes.output(name) and "err line\n" in processes.output(name)


def test_exit_code_is_the_failing_process_code():
    processes = run([exits("ok", 0), exits("bad", 3, delay=0.3)])

    assert processes.returncodes == {"ok": 0, "bad": 3}
    assert processes.first_failure() == ("bad", 3)
    assert processes.exit_code() == 3


@pytest.mark.parametrize("first, second", [("a", "b"), ("b", "a")])
def test_first_failure_is_first_in_time_not_in_name_order(first, second):
    codes = {first: 5, second: 7}
    specs = [
        ProcessSpec(name, [sys.executable, str(SCRIPTS / "exit_on_signal.py"), str(codes[name])])
        for name in ("a", "b")
    ]
    with ProcessSet(specs, grace_seconds=TIMEOUT, echo=False) as processes:
        processes.start()
        for name in (first, second):
            assert processes.wait_for_output(name, "ready", TIMEOUT)
        for name in (first, second):
            processes.send_signal(name, signal.SIGUSR1)
            assert processes.wait_for_exit(name, TIMEOUT) == codes[name]
        processes.wait(TIMEOUT)

    assert processes.returncodes == {first: 5, second: 7}
    assert processes.first_failure() == (first, 5)
    assert processes.exit_code() == 5


def test_no_failure_gives_exit_code_zero():
    processes = run([exits("a", 0), exits("b", 0)])

    assert processes.first_failure() is None
    assert processes.exit_code() == 0
    assert processes.poll() == 0


def test_survivors_of_a_failure_get_their_stacks_dumped_after_grace():
    grace = 0.5
    started = time.monotonic()
    processes = run(
        [exits("bad", 3, delay=0.2), blocks("sleeping", "sleep"), blocks("accepting", "socket")],
        grace_seconds=grace,
        kill_after_seconds=5,
    )
    elapsed = time.monotonic() - started

    assert processes.exit_code() == 3
    assert processes.first_failure() == ("bad", 3)
    assert (
        processes.returncodes["sleeping"] == processes.returncodes["accepting"] == -signal.SIGABRT
    )
    sleeping, accepting = (
        processes.output("sleeping", "stderr"),
        processes.output("accepting", "stderr"),
    )
    assert (
        STACK_MARKER in sleeping
        and 'block.py", line' in sleeping
        and "in wait_in_sleep" in sleeping
    )
    assert (
        STACK_MARKER in accepting and "in accept" in accepting and "in wait_in_accept" in accepting
    )
    assert grace <= elapsed < TIMEOUT / 2


def test_survivor_ignoring_sigabrt_is_killed():
    ignores_abort = ProcessSpec(
        "stubborn",
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGABRT, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(3600)",
        ],
    )
    processes = ProcessSet(
        [exits("bad", 2, delay=0.3), ignores_abort],
        grace_seconds=0,
        kill_after_seconds=0.5,
        echo=False,
    )
    with processes:
        processes.start()
        assert processes.wait_for_output("stubborn", "ready", TIMEOUT)
        processes.wait(TIMEOUT)

    assert processes.returncodes == {"bad": 2, "stubborn": -signal.SIGKILL}
    assert processes.exit_code() == 2


def test_timeout_dumps_stacks_kills_and_names_the_hung_process():
    processes = ProcessSet(
        [exits("quick", 0), blocks("hung", "socket")], kill_after_seconds=5, echo=False
    )
    with processes:
        processes.start()
        assert processes.wait_for_output("hung", "ready", TIMEOUT)
        with pytest.raises(ProcessSetTimeout) as raised:
            processes.wait(timeout=0.5)

    assert raised.value.running == ("hung",)
    assert "hung (pid" in str(raised.value) and "quick" not in str(raised.value)
    assert processes.returncodes == {"quick": 0, "hung": -signal.SIGABRT}
    assert STACK_MARKER in processes.output("hung") and "in accept" in processes.output("hung")


def test_daemons_are_stopped_once_the_others_ended_and_do_not_count():
    processes = run(
        [
            blocks("ps-0", daemon=True),
            blocks("ps-1", "socket", daemon=True),
            exits("worker-0", 0, 0.2),
        ]
    )

    assert processes.returncodes == {
        "ps-0": -signal.SIGTERM,
        "ps-1": -signal.SIGTERM,
        "worker-0": 0,
    }
    assert processes.first_failure() is None
    assert processes.exit_code() == 0


def test_a_daemon_that_fails_on_its_own_is_a_failure():
    processes = run([exits("ps-0", 4, 0.2, daemon=True), blocks("worker-0")], grace_seconds=0.2)

    assert processes.first_failure() == ("ps-0", 4)
    assert processes.returncodes["worker-0"] == -signal.SIGABRT


def test_a_set_of_daemons_runs_until_they_end():
    processes = run([exits("ps-0", 0, 0.2, daemon=True)])

    assert processes.returncodes == {"ps-0": 0}


def test_killing_one_process_fails_the_set_with_its_signal():
    with ProcessSet(
        [blocks("victim"), blocks("other")], grace_seconds=0.2, echo=False
    ) as processes:
        processes.start()
        assert processes.wait_for_output("victim", "ready", TIMEOUT)
        processes.send_signal("victim", signal.SIGKILL)
        processes.wait(TIMEOUT)

    assert processes.first_failure() == ("victim", -signal.SIGKILL)
    assert processes.exit_code() == 128 + signal.SIGKILL
    assert processes.returncodes["other"] == -signal.SIGABRT


def test_wait_for_exit_returns_none_while_running():
    with ProcessSet([blocks("a")], echo=False) as processes:
        processes.start()
        assert processes.wait_for_exit("a", 0.1) is None
        processes.send_signal("a", signal.SIGTERM)
        assert processes.wait_for_exit("a", TIMEOUT) == -signal.SIGTERM
        processes.wait(TIMEOUT)


def test_wait_for_output_stops_waiting_when_the_process_ended():
    with ProcessSet([exits("a", 0)], echo=False) as processes:
        processes.start()
        started = time.monotonic()
        assert not processes.wait_for_output("a", "never printed", TIMEOUT)
        assert time.monotonic() - started < TIMEOUT / 2
        assert processes.wait_for_output("a", "exiting with 0", TIMEOUT)
        processes.wait(TIMEOUT)


def test_stop_all_terminates_everything_without_failures():
    with ProcessSet([blocks("a"), blocks("b", "socket")], echo=False) as processes:
        processes.start()
        assert processes.wait_for_output("b", "ready", TIMEOUT)
        returncodes = processes.stop_all("test is done", timeout=5)

    assert returncodes == {"a": -signal.SIGTERM, "b": -signal.SIGTERM}
    assert processes.first_failure() is None


def test_request_stop_is_carried_out_by_wait():
    with ProcessSet([blocks("a")], echo=False) as processes:
        processes.start()
        processes.request_stop("asked by the test", timeout=5)
        assert processes.wait(TIMEOUT) == {"a": -signal.SIGTERM}


def test_children_get_fault_handler_and_overrides_and_removals(monkeypatch):
    monkeypatch.setenv("KDIST_TEST_REMOVED", "present")
    code = (
        "import os; print(os.environ.get('PYTHONFAULTHANDLER'), os.environ.get('KDIST_TEST_SET'), "
        "os.environ.get('KDIST_TEST_REMOVED'))"
    )
    spec = ProcessSpec(
        "a", [sys.executable, "-c", code], {"KDIST_TEST_SET": "x", "KDIST_TEST_REMOVED": None}
    )

    assert run([spec]).output("a") == "1 x None\n"


def test_a_command_that_cannot_start_stops_the_others():
    processes = ProcessSet(
        [blocks("a"), ProcessSpec("missing", ["/nonexistent/kdist-test-binary"])], echo=False
    )
    with pytest.raises(OSError):
        processes.start()

    assert processes.returncodes["a"] == -signal.SIGTERM


def test_log_dir_gets_one_file_per_process(tmp_path):
    run([exits("a", 0), exits("b", 1)], log_dir=tmp_path)

    # Both streams go to one file; their relative order is the order lines arrived.
    assert sorted((tmp_path / "a.log").read_text().splitlines()) == [
        "err line",
        "exiting with 0",
        "out line",
    ]
    assert "exiting with 1" in (tmp_path / "b.log").read_text()


def test_misuse_is_reported():
    with pytest.raises(InvalidArgumentError, match="name"):
        ProcessSpec("has space", ["true"])
    with pytest.raises(InvalidArgumentError, match="argv"):
        ProcessSpec("a", [])
    with pytest.raises(InvalidArgumentError, match="unique"):
        ProcessSet([exits("a", 0), exits("a", 0)])
    processes = ProcessSet([exits("a", 0)], echo=False)
    with pytest.raises(ProcessSetStateError):
        processes.wait(1)
    with pytest.raises(InvalidArgumentError, match="No process named 'b'"):
        processes.output("b")
    with processes:
        processes.start()
        with pytest.raises(ProcessSetStateError):
            processes.start()
        processes.wait(TIMEOUT)
