"""The one harness for multi-process tests, built on `kdist.launch.ProcessSet`.

Every test that starts processes goes through here, so they all get hard
timeouts, the same environments `kdist launch` gives, and — when something goes
wrong — every process's output, including the stacks of hung processes, in the
failure message.

```python
from tests import harness

def test_two_ranks_agree():
    specs = harness.python_specs(harness.torchrun_envs(2), SCRIPT, "--steps", "3")
    result = harness.run(specs, timeout=60)
    result.check()
    assert "loss" in result.output("worker-0")
```

Each child gets `KERAS_BACKEND=torch`, `PYTHONUNBUFFERED=1`, `PYTHONFAULTHANDLER=1`
and the repository root first on `PYTHONPATH` (so `import kdist` works from any
script path).

Children start warm: forked from a zygote that imported NumPy, torch and Keras
once for the whole session (`kdist.launch.warm`), unless their command or
environment rules it out, `warm=False` is passed, or `KDIST_WARM=0` is set.
"""

import os
import select
import sys
import time
from pathlib import Path

import pytest

from kdist.launch import task_env, warm as _warm
from kdist.launch.ports import free_port, free_ports
from kdist.launch.processes import ProcessSet, ProcessSetTimeout
from kdist.launch.spec import ProcessSpec

__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_TIMEOUT",
    "REPO_ROOT",
    "ProcessSpec",
    "RunResult",
    "free_port",
    "free_ports",
    "python_specs",
    "run",
    "start",
    "tf_config_envs",
    "torchrun_envs",
    "wait",
    "wait_until_gone",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
# Well under pytest-timeout's 300 s, so a hang fails through this harness (with
# every stack) rather than through pytest-timeout (with none of the children's).
DEFAULT_TIMEOUT = 120.0
# After one process fails, how long the others may run before their stacks are
# dumped: long enough to exit on their own, short enough to keep failing tests fast.
DEFAULT_GRACE = 10.0
KILL_AFTER_SECONDS = 5.0


# -- Environments ---------------------------------------------------------------


def torchrun_envs(nproc, master_addr="127.0.0.1", master_port=None):
    """Returns `[(name, env), ...]` for `nproc` ranks, as `kdist launch --nproc` sets them.

    Names are "worker-0" ... ; `master_port` defaults to a free port.
    """
    port = free_port(master_addr) if master_port is None else master_port
    return [
        (f"worker-{rank}", task_env.torchrun_env(rank, nproc, master_addr, port))
        for rank in range(nproc)
    ]


def tf_config_envs(workers, chief=False, ps=0, evaluator=False):
    """Returns `[(name, env), ...]` with per-task `TF_CONFIG`s, each task on a free local port.

    The same cluster `kdist launch --workers N --ps K [--chief] [--evaluator]`
    builds, in its start order (ps, worker, chief, evaluator); names are "ps-0",
    "worker-1", "chief-0", ...
    """
    cluster = task_env.local_cluster(workers, ps, chief, evaluator)
    return [
        (task_env.task_name(*task), task_env.tf_config_env(cluster, *task))
        for task in task_env.cluster_tasks(cluster)
    ]


def python_specs(envs, script, *args, daemon_jobs=("ps",)):
    """Returns one `ProcessSpec` per `(name, env)` running `python script *args`.

    Processes whose name starts with a job in `daemon_jobs` ("ps-0") are daemons:
    stopped once the others ended, their exit codes ignored.
    """
    argv = [sys.executable, str(script), *map(str, args)]
    return [
        ProcessSpec(name, argv, env, daemon=name.rsplit("-", 1)[0] in daemon_jobs)
        for name, env in envs
    ]


def _with_test_env(spec):
    python_path = [str(REPO_ROOT)] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
    ]
    env = {
        "KERAS_BACKEND": "torch",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(python_path),
    }
    env.update(spec.env)
    return ProcessSpec(spec.name, spec.argv, env, spec.daemon, spec.cwd)


# -- Running ----------------------------------------------------------------------


class RunResult:
    """What a finished set of processes left: exit codes and output.

    Attributes:
        processes: the underlying `ProcessSet`.
    """

    def __init__(self, processes):
        self.processes = processes

    @property
    def returncodes(self):
        """Name -> `Popen.returncode`."""
        return self.processes.returncodes

    def output(self, name, stream=None):
        """Everything process `name` wrote ("stdout", "stderr" or both)."""
        return self.processes.output(name, stream)

    def first_failure(self):
        """`(name, returncode)` of the first process to fail, or None."""
        return self.processes.first_failure()

    def exit_code(self):
        """The first failure's shell exit code, or 0."""
        return self.processes.exit_code()

    def check(self):
        """Raises AssertionError with every process's output if any process failed."""
        failure = self.first_failure()
        if failure is not None:
            raise AssertionError(
                f"{failure[0]} failed first with returncode {failure[1]}; "
                f"returncodes: {self.returncodes}\n{format_outputs(self.processes)}"
            )
        return self


def start(specs, *, grace=DEFAULT_GRACE, kill_after=KILL_AFTER_SECONDS, echo=False, log_dir=None,
          warm=True):
    """Starts `specs` and returns the live `ProcessSet`, for tests that interact with it.

    Use it as a context manager so that nothing outlives the test, and finish
    with `harness.wait(processes, timeout)`:

    ```python
    with harness.start(specs) as processes:
        assert processes.wait_for_output("worker-1", "ready", timeout=30)
        processes.send_signal("worker-1", signal.SIGKILL)
        result = harness.wait(processes, timeout=60)
    ```
    """
    processes = ProcessSet(
        [_with_test_env(spec) for spec in specs],
        grace_seconds=grace,
        kill_after_seconds=kill_after,
        echo=echo,
        log_dir=log_dir,
        warm=_warm.shared_pool() if warm and _warm.enabled() else None,
    )
    processes.start()
    return processes


def wait(processes, timeout=DEFAULT_TIMEOUT):
    """Waits for a started `ProcessSet`; a timeout fails the test with every output and stack."""
    try:
        processes.wait(timeout)
    except ProcessSetTimeout as error:
        pytest.fail(f"{error}\n{format_outputs(processes)}", pytrace=False)
    return RunResult(processes)


def run(
    specs,
    *,
    timeout=DEFAULT_TIMEOUT,
    grace=DEFAULT_GRACE,
    kill_after=KILL_AFTER_SECONDS,
    echo=False,
    warm=True,
):
    """Starts `specs`, waits for all of them, and returns a `RunResult` (call `.check()`).

    A hang past `timeout` fails the test (pytest.fail) with the timeout message
    and every process's output, including the faulthandler stacks of the
    processes that were still running.
    """
    with start(specs, grace=grace, kill_after=kill_after, echo=echo, warm=warm) as processes:
        return wait(processes, timeout)


def format_outputs(processes):
    """Every process's output, each line prefixed with `[name] `, one block per process."""
    blocks = []
    returncodes = processes.returncodes
    for name in processes.names:
        text = processes.output(name)
        lines = "".join(f"[{name}] {line}" for line in text.splitlines(keepends=True))
        blocks.append(f"----- {name} (returncode {returncodes[name]}) -----\n{lines}")
    return "\n".join(blocks)


# -- Processes outside a ProcessSet -------------------------------------------------


def wait_until_gone(pids, timeout):
    """Waits until every pid has exited (a zombie counts as exited).

    Returns:
        The pids still running at the deadline (empty when all are gone).
    """
    deadline = time.monotonic() + timeout
    return [pid for pid in pids if not _wait_gone(pid, deadline)]


def _wait_gone(pid, deadline):
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):
        return _poll_gone(pid, deadline)
    try:
        # A pidfd becomes readable when the process exits.
        readable, _, _ = select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
        return bool(readable)
    finally:
        os.close(pidfd)


def _poll_gone(pid, deadline):
    # No pidfd (old kernel): nothing to wait on for a process that is not our
    # child, so poll with a deadline.
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if _is_zombie(pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _is_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
