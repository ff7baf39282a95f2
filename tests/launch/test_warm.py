"""Warm processes (`kdist.launch.warm`): a forked child runs a command as a cold `python` does.

Each behaviour is checked against the same command started cold (`subprocess`),
which is the reference: argv, `sys.path[0]`, environment, working directory,
exit codes, the uncaught-exception traceback, files left open at exit. The
pool's own rules: which commands and environments it refuses (they start cold),
what a zygote's death does to its children, and that `kdist launch --no-warm`
starts its processes cold (the control for "they were forked").
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kdist.launch import child, warm
from tests import harness

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not warm.supported(), reason="warm starts need Linux"),
]

REPORT = textwrap.dedent(
    """
    import json, os, sys
    import numpy
    print(json.dumps({
        "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "foo": os.environ.get("FOO"),
        "main_file": getattr(sys.modules["__main__"], "__file__", None), "name": __name__,
        "numpy": float(numpy.random.rand()), "ppid": os.getppid(), "pgid": os.getpgid(0),
        "pid": os.getpid(),
    }))
    """
)


@pytest.fixture(scope="module")
def pool():
    # Its own zygotes, not the session's broker's (tests/conftest.py): closing it must end them.
    with warm.WarmPool(use_broker=False) as pool:
        yield pool


def _env(**extra):
    return child.child_environment({"KERAS_BACKEND": "torch", **extra})


def _run_warm(pool, argv, env, cwd=None):
    process = pool.spawn(argv, env, cwd)
    assert process is not None, pool.unavailable
    out, err = process.stdout.read().decode(), process.stderr.read().decode()
    return process.wait(), out, err, process


def _run_cold(argv, env, cwd=None):
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


def test_a_script_sees_what_a_cold_start_shows_it(pool, tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    argv = [sys.executable, str(script), "a", "--b"]
    env = _env(FOO="bar")
    code, out, err, process = _run_warm(pool, argv, env, cwd=str(tmp_path))
    cold_code, cold_out, cold_err = _run_cold(argv, env, cwd=str(tmp_path))
    assert (code, err) == (cold_code, cold_err) == (0, "")
    warm_report, cold_report = json.loads(out), json.loads(cold_out)
    for key in ("argv", "path0", "cwd", "foo", "main_file", "name"):
        assert warm_report[key] == cold_report[key], key
    assert warm_report["pid"] == process.pid == warm_report["pgid"]  # leads its own session
    assert warm_report["ppid"] != os.getpid()  # forked by the zygote


def test_module_and_code_commands_match_cold_ones(pool, tmp_path):
    (tmp_path / "reportmod.py").write_text(REPORT)
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    for argv in ([sys.executable, "-m", "reportmod", "x"], [sys.executable, "-c", REPORT, "y"]):
        code, out, _, _ = _run_warm(pool, argv, env, cwd=str(tmp_path))
        cold_code, cold_out, _ = _run_cold(argv, env, cwd=str(tmp_path))
        assert code == cold_code == 0
        warm_report, cold_report = json.loads(out), json.loads(cold_out)
        for key in ("argv", "path0", "cwd", "main_file", "name"):
            assert warm_report[key] == cold_report[key], (argv[1], key)


def test_exit_codes_signals_and_tracebacks_are_a_cold_start_s(pool, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("def f():\n    raise ValueError('boom')\nf()\n")
    cases = [
        [sys.executable, "-c", "import sys; sys.exit(3)"],
        [sys.executable, "-c", "import sys; sys.exit('a message')"],
        [sys.executable, str(script)],
    ]
    for argv in cases:
        code, _, err, _ = _run_warm(pool, argv, _env())
        cold_code, _, cold_err = _run_cold(argv, _env())
        assert (code, err) == (cold_code, cold_err), argv
    assert cold_err.startswith(f'Traceback (most recent call last):\n  File "{script}", line 3')
    process = pool.spawn([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], _env())
    assert process.stdout.readline() == b"up\n"
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL


def test_files_left_open_are_flushed_and_atexit_runs(pool, tmp_path):
    target = tmp_path / "left_open.txt"
    code = (
        "import atexit\n"
        f"f = open({str(target)!r}, 'w')\n"
        "f.write('written')\n"
        "atexit.register(print, 'atexit ran')\n"
    )
    status, out, _, _ = _run_warm(pool, [sys.executable, "-c", code], _env())
    assert (status, out) == (0, "atexit ran\n")
    assert target.read_text() == "written"


def test_numpy_s_global_generator_is_seeded_per_child(pool, tmp_path):
    draws = [json.loads(_run_warm(pool, [sys.executable, "-c", REPORT], _env())[1])["numpy"] for _ in range(2)]
    assert draws[0] != draws[1]


def test_commands_and_environments_a_zygote_cannot_serve_start_cold(pool):
    assert warm.parse_command(["/bin/echo", "x"]) is None
    assert warm.parse_command([sys.executable, "-O", "x.py"]) is None
    assert warm.parse_command([sys.executable]) is None
    assert warm.parse_command([sys.executable, "-u", "-X", "faulthandler", "-m", "m", "a"]) == {
        "unbuffered": True, "faulthandler": True, "kind": "module", "target": "m", "args": ["a"],
    }
    assert pool.spawn(["/bin/echo", "x"], _env()) is None
    # A different import-time variable gets another zygote, which imported with it.
    code, out, _, _ = _run_warm(
        pool, [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        _env(OMP_NUM_THREADS="1"),
    )
    assert (code, out) == (0, "1\n")
    assert warm.import_time_environment({"OMP_NUM_THREADS": "1", "RANK": "0"}) == (("OMP_NUM_THREADS", "1"),)


def test_closing_the_pool_ends_its_zygote_and_children_still_running():
    pool = warm.WarmPool(use_broker=False)
    process = pool.spawn([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], _env())
    assert process.stdout.readline() == b"up\n"
    pool.close()
    assert process.wait() == -signal.SIGKILL
    assert harness.wait_until_gone([process.pid], timeout=10) == []


# One write per line: the launcher runs its children unbuffered (PYTHONUNBUFFERED=1),
# where print(a, b, ...) writes each piece on its own, and a piece that arrives
# while another rank's line is open continues on a row of its own.
_WHO = "import os\nprint(f\"parent {os.getppid()} launcher {os.environ['LAUNCHER_PID']}\")\n"
_LAUNCHER = (
    "import os, sys\n"
    "os.environ['LAUNCHER_PID'] = str(os.getpid())\n"
    "from kdist.launch.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _started_by_the_launcher(tmp_path, *launch_args):
    """For each process `kdist launch *launch_args` starts: whether the launcher itself started it."""
    script = tmp_path / "who.py"
    script.write_text(_WHO)
    argv = [sys.executable, "-c", _LAUNCHER, "launch", *launch_args, "--timeout", "60", str(script)]
    result = harness.run([harness.ProcessSpec("launcher", argv)], timeout=90, warm=False).check()
    lines = [line.split() for line in result.output("launcher", "stdout").splitlines() if "parent" in line]
    return [words[2] == words[4] for words in lines]


@pytest.mark.parametrize("warm_flag", [(), ("--no-warm",)], ids=["warm", "no_warm"])
def test_kdist_launch_forks_its_ranks_unless_told_not_to(tmp_path, warm_flag):
    expected = [True, True] if warm_flag else [False, False]
    assert _started_by_the_launcher(tmp_path, *warm_flag, "--nproc", "2") == expected


def test_a_lone_process_without_restarts_starts_cold(tmp_path):
    # Nothing to share with one process: started by the launcher itself.
    assert _started_by_the_launcher(tmp_path, "--nproc", "1") == [True]


def test_another_virtual_environment_s_python_starts_cold(tmp_path):
    # Every venv's bin/python links to one base interpreter; its folder decides its packages.
    other = tmp_path / "other-venv" / "bin"
    other.mkdir(parents=True)
    (other / "python").symlink_to(os.path.realpath(sys.executable))
    assert os.path.samefile(other / "python", sys.executable)
    assert not warm.same_interpreter(str(other / "python"), sys.executable)
    assert warm.parse_command([str(other / "python"), "x.py"]) is None
