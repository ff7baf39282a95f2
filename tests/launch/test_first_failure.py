"""`kdist launch` shows the first failure first; the others' consequent errors get a line each.

The jobs are real: `cli.main(["launch", ...])` starts real processes (and, in
the first test, a real torch.distributed gloo job), as tests/launch/test_cli.py does.
"""

import pathlib
import sys
import tempfile
import textwrap
import time
import traceback

import pytest

from kdist.launch import cli, failure_report

pytestmark = pytest.mark.timeout(180)

# Rank 1 fails on a missing import after joining the job; rank 0 then waits for
# it in the first collective of `fit` (timeout 5 s) and raises CollectiveTimeoutError.
MISSING_IMPORT_JOB = """
import os

import kdist
import keras
import numpy as np

strategy = kdist.MultiWorkerMirroredStrategy(
    communication_options=kdist.CommunicationOptions(timeout_seconds=5))
if int(os.environ["RANK"]) == 1:
    import kdist_no_such_module  # noqa: F401
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
model.fit(np.zeros((8, 4)), np.zeros((8, 1)), epochs=1, verbose=0)
"""

# No torch, no sleeps: a handshake through files the launcher's own echo creates
# (`_Handshake`). Rank 1 fails once the launcher has echoed rank 0's "before";
# rank 0 prints "after" and fails once the launcher has announced rank 1's exit.
LATE_FAILURE_JOB = """
import os
import time

def wait_for(path):
    # A file that the test's stream wrapper creates; bounded, so a lost event fails the job, never hangs it.
    deadline = time.monotonic() + {deadline}
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{{path}} did not appear within {deadline} s")
        time.sleep(0.02)

if int(os.environ["RANK"]) == 1:
    wait_for({before_echoed!r})
    raise KeyError("the first failure")
print("rank 0 before", flush=True)
wait_for({failure_announced!r})
print("rank 0 after", flush=True)
raise RuntimeError("a consequent failure")
"""
HANDSHAKE_SECONDS = 60


class _Tee:
    """Passes writes through to `stream`; creates `path` once `marker` was written (the launcher's echo)."""

    def __init__(self, stream, marker, path):
        self._stream, self._marker, self._path = stream, marker, path
        self._written = ""

    def write(self, text):
        self._stream.write(text)
        if not self._path.exists():
            self._written += text
            if self._marker in self._written:
                self._stream.flush()
                self._path.touch()
        return len(text)

    def flush(self):
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _late_failure_script(tmp_path, monkeypatch):
    """LATE_FAILURE_JOB, its handshake files created from what the launcher echoes."""
    before_echoed, failure_announced = tmp_path / "before-echoed", tmp_path / "failure-announced"
    # The launcher writes to the current sys.stdout/sys.stderr (pytest's capture) at each write.
    monkeypatch.setattr(sys, "stdout", _Tee(sys.stdout, "[worker-0] rank 0 before\n", before_echoed))
    monkeypatch.setattr(sys, "stderr", _Tee(sys.stderr, "[kdist] worker-1 (pid ", failure_announced))
    source = LATE_FAILURE_JOB.format(
        deadline=HANDSHAKE_SECONDS, before_echoed=str(before_echoed), failure_announced=str(failure_announced)
    )
    return _script(tmp_path, source)


def _line_of(path, text):
    return next(number for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1) if text in line)


def _script(tmp_path, source):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def _summary(err):
    """The launcher's closing lines, from "failed first" on."""
    lines = err.splitlines()
    starts = [index for index, line in enumerate(lines) if " failed first: it " in line]
    assert starts, err
    return lines[starts[-1]:]


def test_missing_import_on_one_rank_is_shown_first_and_the_collective_timeout_in_one_line(tmp_path, capsys):
    logs = tmp_path / "logs"
    started = time.monotonic()
    code = cli.main(["launch", "--nproc", "2", "--grace", "20", "--log-dir", str(logs),
                     _script(tmp_path, MISSING_IMPORT_JOB)])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err

    assert code == 1, err
    assert elapsed < 90, elapsed  # Rank 0 gives up after its 5 s collective timeout, not the grace.
    # Live: rank 1's exception comes before anything of rank 0's error.
    assert "ModuleNotFoundError" in err and err.index("ModuleNotFoundError") < err.index("CollectiveTimeoutError")
    # The summary: rank 1 first, with its traceback; rank 0 in one line, naming its log.
    summary = _summary(err)
    assert summary[0] == "[kdist] worker-1 failed first: it exited with code 1; exit code 1", summary
    assert summary[1] == "[kdist] | Traceback (most recent call last):", summary
    assert summary[2].startswith('[kdist] |   File "') and "job.py" in summary[2]
    assert "[kdist] | ModuleNotFoundError: No module named 'kdist_no_such_module'" in summary
    index = summary.index("[kdist] | ModuleNotFoundError: No module named 'kdist_no_such_module'")
    assert summary[index + 1:-1] == [f"[kdist] worker-1's full output: {logs / 'worker-1.log'}"], summary
    last = summary[-1]
    assert last.startswith("[kdist] then worker-0 exited with code 1: kdist.errors.CollectiveTimeoutError: "), last
    assert last.endswith(f"(full output: {logs / 'worker-0.log'})"), last
    # The full outputs are in the logs: rank 0's whole traceback included.
    worker_0 = (logs / "worker-0.log").read_text()
    assert "Traceback (most recent call last):" in worker_0
    assert "kdist.errors.CollectiveTimeoutError: Collective #" in worker_0
    assert "ModuleNotFoundError: No module named 'kdist_no_such_module'" in (logs / "worker-1.log").read_text()


def test_after_the_first_failure_the_others_output_goes_only_to_their_logs(tmp_path, capsys, monkeypatch):
    logs = tmp_path / "logs"
    script = _late_failure_script(tmp_path, monkeypatch)
    code = cli.main(["launch", "--nproc", "2", "--grace", "20", "--log-dir", str(logs), script])
    captured = capsys.readouterr()

    assert code == 1
    # The control: before rank 1 failed, rank 0's output was echoed; after, it was not.
    assert "[worker-0] rank 0 before" in captured.out
    assert "rank 0 after" not in captured.out and "[worker-0] RuntimeError" not in captured.err
    lines = captured.err.splitlines()
    exited = lines.index(next(line for line in lines if line.startswith("[kdist] worker-1 (pid ")))
    assert not [line for line in lines[exited:] if line.startswith("[worker-0]")], captured.err
    assert _summary(captured.err) == [
        "[kdist] worker-1 failed first: it exited with code 1; exit code 1",
        "[kdist] | Traceback (most recent call last):",
        f'[kdist] |   File "{script}", line {_line_of(script, "raise KeyError")}, in <module>',
        "[kdist] |     raise KeyError(\"the first failure\")",
        "[kdist] | KeyError: 'the first failure'",
        f"[kdist] worker-1's full output: {logs / 'worker-1.log'}",
        f"[kdist] then worker-0 exited with code 1: RuntimeError: a consequent failure "
        f"(full output: {logs / 'worker-0.log'})",
    ]
    worker_0 = (logs / "worker-0.log").read_text()
    # (Its two streams share the file, each line whole, in the order they were read.)
    assert "rank 0 after\n" in worker_0 and "\nRuntimeError: a consequent failure\n" in worker_0


def test_without_log_dir_the_logs_are_kept_only_when_the_job_fails(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    succeeded = tmp_path / "ok.py"
    succeeded.write_text("print('fine')\n")

    assert cli.main(["launch", "--nproc", "2", str(succeeded)]) == 0
    ok = capsys.readouterr()
    assert "[worker-1] fine" in ok.out and "failed first" not in ok.err
    assert not list(tmp_path.glob(f"{cli.LOG_DIR_PREFIX}*")), "a successful job's logs are removed"

    script = _late_failure_script(tmp_path, monkeypatch)
    assert cli.main(["launch", "--nproc", "2", "--grace", "20", script]) == 1
    err = capsys.readouterr().err
    (log_dir,) = tmp_path.glob(f"{cli.LOG_DIR_PREFIX}*")
    assert f"; logs in {log_dir}" in err
    assert _summary(err)[-1].endswith(f"(full output: {log_dir / 'worker-0.log'})")
    assert "rank 0 after" in (log_dir / "worker-0.log").read_text()


def _formatted(error):
    return "".join(traceback.format_exception(error))


def _raise_chained():
    try:
        {}["missing"]
    except KeyError as error:
        raise RuntimeError("while loading") from error


def test_last_traceback_keeps_the_chain_and_strips_a_rank_prefix():
    try:
        _raise_chained()
    except RuntimeError as error:
        text = _formatted(error)
    prefixed = "".join(f"[rank1]: {line}" for line in text.splitlines(keepends=True))
    noise = "loss: 0.3\n"
    for stderr in (text, noise + prefixed):
        lines = failure_report.last_traceback(stderr)
        assert lines[0] == "Traceback (most recent call last):" and lines[-1] == "RuntimeError: while loading"
        assert "KeyError: 'missing'" in lines
        assert "The above exception was the direct cause of the following exception:" in lines
        assert failure_report.final_exception_line(stderr) == "RuntimeError: while loading"
    # Two unrelated tracebacks: only the last one (with its own chain).
    again = text.replace("while loading", "again")
    assert failure_report.last_traceback(text + "later\n" + again) == failure_report.last_traceback(again)
    assert failure_report.final_exception_line("no traceback here\n") is None
    long_message = "Traceback (most recent call last):\n  File \"x\", line 1\nValueError: " + "x" * 1000 + "\n"
    line = failure_report.final_exception_line(long_message)
    assert len(line) == failure_report.MAX_EXCEPTION_CHARS and line.endswith("...")



def test_an_error_location_line_is_never_taken_for_the_exception():
    # Python 3.11 marks the failing expression with ^ and ~; such a line left unindented
    # once the rank prefix is removed was reported as the survivor's exception ("^^^^").
    stderr = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "train.py", line 9, in <module>',
        "[rank0]:     model.fit(x, y)",
        "[rank0]: ^^^^^^^^^^^^^^^",
        "[rank0]: ~~~~~~^^^^^^",
        "[rank0]: kdist.errors.CollectiveTimeoutError: Collective #1 all_reduce failed. Missing rank(s): [1]",
    ]) + "\n"
    line = failure_report.final_exception_line(stderr)
    assert line == "kdist.errors.CollectiveTimeoutError: Collective #1 all_reduce failed. Missing rank(s): [1]"
    assert failure_report.last_traceback(stderr)[-1] == line
