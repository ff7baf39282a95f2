"""The warm-process broker (`kdist.launch.warm_broker`): launchers fork from zygotes another process keeps.

Real launchers (`python -m kdist launch`) in real processes. Which zygote forked a
rank is read from the rank's parent pid: a zygote the broker keeps is a child of
this test's process.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from kdist.launch import warm, warm_broker
from tests import harness

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not warm.supported(), reason="warm starts need Linux"),
]

WHO = "import json, os\nprint(json.dumps({'ppid': os.getppid(), 'pid': os.getpid()}), flush=True)\n"


@pytest.fixture
def broker():
    with warm_broker.Broker() as broker:
        yield broker


def _children_of(pid):
    """Every thread's children (the broker's zygotes are its thread's)."""
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as children:
            found.update(int(child) for child in children.read().split())
    return found


def _launch(tmp_path, broker_value, *args, script=WHO):
    path = tmp_path / "who.py"
    path.write_text(script)
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=str(harness.REPO_ROOT))
    env.pop(warm_broker.VARIABLE, None)
    if broker_value is not None:
        env[warm_broker.VARIABLE] = broker_value
    done = subprocess.run([sys.executable, "-m", "kdist", "launch", "--nproc", "2", "--timeout", "120", *args,
                           str(path)], env=env, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line.split("] ", 1)[1]) for line in done.stdout.splitlines() if '"ppid"' in line]


def test_two_launchers_fork_their_ranks_from_the_brokers_one_zygote(tmp_path, broker):
    first = _launch(tmp_path, broker.value)
    second = _launch(tmp_path, broker.value)
    zygotes = {rank["ppid"] for rank in first + second}
    assert len(first) == len(second) == 2 and len(zygotes) == 1
    # That zygote is this process's child (the broker's), started once for both jobs.
    assert zygotes <= _children_of(os.getpid())


def test_without_a_broker_a_launcher_starts_its_own_zygote(tmp_path, broker):
    # The control: the same job, the environment naming no broker (or a broker that is gone).
    for value in (None, json.dumps({"address": "kdist-warm-gone", "token": "x"})):
        ranks = _launch(tmp_path, value)
        zygotes = {rank["ppid"] for rank in ranks}
        assert len(ranks) == 2 and len(zygotes) == 1
        assert not zygotes & _children_of(os.getpid())


def test_a_stranger_without_the_token_is_refused_and_the_broker_still_serves(broker):
    named = json.loads(broker.value)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stranger:
        stranger.settimeout(30)
        stranger.connect("\0" + named["address"])
        stranger.send(json.dumps({"token": "guess", "env": dict(os.environ)}).encode())
        data, fds, _, _ = socket.recv_fds(stranger, 1 << 16, 1)
    assert (data, fds) == (b"", [])  # closed unanswered: no zygote socket
    bad = json.dumps({**named, "token": "guess"})
    assert warm.request_broker_control(dict(os.environ), {warm_broker.VARIABLE: bad}) is None
    control = warm.request_broker_control(dict(os.environ), {warm_broker.VARIABLE: broker.value})
    assert control is not None
    control.close()


def _ask(broker, executable):
    named = json.loads(broker.value)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as pool:
        pool.settimeout(120)
        pool.connect("\0" + named["address"])
        pool.send(json.dumps({"token": named["token"], "env": dict(os.environ), "executable": executable}).encode())
        data, fds, _, _ = socket.recv_fds(pool, 1 << 16, 1)
    for fd in fds:
        os.close(fd)
    return json.loads(data), len(fds)


def test_a_pool_running_another_environment_s_python_gets_no_zygote(tmp_path, broker):
    # Its zygote would run this environment's packages (Keras 3.15 for a Keras 3.16 job, say).
    other = tmp_path / "other-venv" / "bin"
    other.mkdir(parents=True)
    (other / "python").symlink_to(os.path.realpath(sys.executable))
    answer, fds = _ask(broker, str(other / "python"))
    assert fds == 0 and "error" in answer and str(other / "python") in answer["error"]
    assert _ask(broker, sys.executable) == ({"ok": True}, 1)  # the control: this environment's


def test_ranks_of_a_launcher_killed_with_sigkill_die_with_it(tmp_path, broker):
    # The broker's zygote outlives the launcher; the ranks it forked for it must not.
    script = textwrap.dedent(
        """
        import json, os, time
        print(json.dumps({'ppid': os.getppid(), 'pid': os.getpid()}), flush=True)
        time.sleep(600)
        """
    )
    path = tmp_path / "sleep.py"
    path.write_text(script)
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=str(harness.REPO_ROOT))
    env[warm_broker.VARIABLE] = broker.value
    launcher = subprocess.Popen([sys.executable, "-m", "kdist", "launch", "--nproc", "2", str(path)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        pids = []
        while len(pids) < 2:
            line = launcher.stdout.readline()
            assert line, "the launcher ended before its ranks started"
            if '"ppid"' in line:
                pids.append(json.loads(line.split("] ", 1)[1])["pid"])
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        assert harness.wait_until_gone(pids, timeout=30) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.stdout.close()
