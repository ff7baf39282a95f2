"""`ProcessSet`: start several processes, echo their output, stop them as one job.

The stop policy (`kdist.launch.policy`), applied by `wait()` and `poll()`: the
first failure's exit code is the set's; after it the other processes get
`grace_seconds`, then their stacks are dumped (SIGABRT + faulthandler) and they
are killed; daemons (parameter servers) are stopped once the others ended; a
spec with a `RestartPolicy` is restarted instead of failing while it has restarts;
with a `JobRestart`, a failure restarts every process (`kdist.launch.restarts`).
`wait(timeout)` past its deadline dumps the stacks of everything still running,
kills it and raises `ProcessSetTimeout` naming it. After the first failure only
its output and the stack dumps are echoed; the others' goes to their logs.

Every child starts in its own session (Ctrl-C on the terminal reaches only the
launcher, which decides how to stop the children) and, on Linux, dies with its
parent (`PR_SET_PDEATHSIG`). Stop signals go to the child's whole process group.
POSIX only.
"""

import os
import signal
import threading
import time

from kdist.errors import InvalidArgumentError
from kdist.launch import child, output
from kdist.launch.child import DRAIN_SECONDS
from kdist.launch.policy import StopPolicy, signal_all
from kdist.launch.restarts import JobRestart, JobRestarter  # noqa: F401  (re-exported)
from kdist.launch.spec import (
    ProcessSetStateError,
    ProcessSetTimeout,
    ProcessSpec,
    describe_returncode,
)

__all__ = ["JobRestart", "ProcessSet", "ProcessSetStateError", "ProcessSetTimeout", "ProcessSpec"]

# How long to wait for the kernel to reap a process after SIGKILL.
REAP_SECONDS = 5.0


class ProcessSet:
    """Runs processes as one job: output prefixed per process, fail-fast, no orphans.

    Thread-safe: every method may be called from any thread; `request_stop` and
    `kill_all` may also be called from a signal handler in the main thread.
    Call `start`, and `wait`/`poll` (which make restarts), from a thread that
    outlives the children (see `child.make_preexec`).

    Args:
        specs: `ProcessSpec`s (more can be `add`ed before `start`).
        grace_seconds: after the first failure, how long the others may run on.
        kill_after_seconds: how long a process gets after SIGABRT or SIGTERM before SIGKILL.
        echo: False keeps output in memory only.
        stdout, stderr: text streams for the echoed lines; None means the
            current `sys.stdout` / `sys.stderr` at each write.
        keep_lines: lines kept in memory per process (None: all).
        log_dir: if given, each process's output is also written to `<name>.log` there.
        core_dumps: False (default) sets the children's soft core-file limit to 0.
        job_restart: a `JobRestart`: after a failure, stop every process and start
            them all again (from `job_restart.make_specs()`), up to its `max_restarts`.
        warm: a `kdist.launch.warm.WarmPool` to fork the processes (and restarts)
            from, or None to start them cold. The set does not close it.

    Example:
        ```python
        specs = [ProcessSpec(f"worker-{i}", [sys.executable, "train.py"], {"RANK": str(i)})
                 for i in range(2)]
        with ProcessSet(specs, grace_seconds=10) as processes:
            processes.start()
            processes.wait(timeout=600)
        sys.exit(processes.exit_code())
        ```
    """

    def __init__(
        self,
        specs=(),
        *,
        grace_seconds=30.0,
        kill_after_seconds=5.0,
        echo=True,
        stdout=None,
        stderr=None,
        keep_lines=None,
        log_dir=None,
        core_dumps=False,
        job_restart=None,
        warm=None,
    ):
        if grace_seconds < 0 or kill_after_seconds < 0:
            raise InvalidArgumentError(
                "grace_seconds and kill_after_seconds must be >= 0. Received: "
                f"grace_seconds={grace_seconds}, kill_after_seconds={kill_after_seconds}."
            )
        self.grace_seconds = float(grace_seconds)
        self.kill_after_seconds = float(kill_after_seconds)
        self._sinks = {
            output.STDOUT: output.PrefixedSink(output.STDOUT, stdout, echo),
            output.STDERR: output.PrefixedSink(output.STDERR, stderr, echo),
        }
        self._keep_lines, self._log_dir = keep_lines, log_dir
        self._core_dumps, self._warm = core_dumps, warm
        # An RLock, so that a signal handler running in the main thread while
        # the main thread holds the lock (inside `wait`) can still call
        # `request_stop` / `kill_all`.
        self._condition = threading.Condition(threading.RLock())
        self._children = {}
        self._started = False
        self._exits = 0
        self._preexec = None
        restarter = None
        if job_restart is not None:
            restarter = JobRestarter(
                job_restart, self.kill_after_seconds, self._announce, self._respawn
            )
        self._policy = StopPolicy(
            self.grace_seconds, self.kill_after_seconds, self._announce, self._respawn, restarter
        )
        for spec in specs:
            self.add(spec)

    # -- Setting up -------------------------------------------------------------

    def add(self, spec):
        """Adds a `ProcessSpec` (before `start`). Names must be unique."""
        with self._condition:
            if self._started:
                raise ProcessSetStateError(
                    f"Cannot add {spec.name!r}: the ProcessSet already started."
                )
            if spec.name in self._children:
                raise InvalidArgumentError(
                    f"Process names must be unique. Received: {spec.name!r} twice."
                )
            self._children[spec.name] = child.Child(spec, self._keep_lines)

    @property
    def names(self):
        """Process names in the order they were added (and started)."""
        return list(self._children)

    @property
    def pids(self):
        """Name -> pid of every started process."""
        with self._condition:
            return {name: c.popen.pid for name, c in self._children.items() if c.popen is not None}

    def start(self):
        """Starts every process, in order; if one cannot start, stops the others and raises.

        Raises:
            OSError: a command cannot be executed (e.g. no such file).
            ProcessSetStateError: `start` was already called, or there is nothing to start.
        """
        with self._condition:
            if self._started:
                raise ProcessSetStateError("ProcessSet.start() was already called.")
            if not self._children:
                raise ProcessSetStateError("ProcessSet.start() needs at least one ProcessSpec.")
            self._started = True
            self._preexec = child.make_preexec(self._core_dumps)
            if self._log_dir is not None:
                os.makedirs(self._log_dir, exist_ok=True)
            try:
                for current in self._children.values():
                    self._respawn(current)
            except OSError as error:
                failed_name, failure = current.spec.name, error
            else:
                return
        self.stop_all(f"{failed_name} could not start ({failure})")
        raise failure

    def _respawn(self, current):
        current.spawn(self._preexec, self._sinks, self._log_dir, self._on_exit, self._warm)

    def _on_exit(self, current, returncode):
        """Runs in the child's waiter thread once the process ended."""
        with self._condition:
            current.returncode = returncode
            current.exit_order = self._exits
            current.ended_at = time.monotonic()
            self._exits += 1
            self._policy.on_exit(list(self._children.values()), current, current.ended_at)
            if current.failed and not current.aborted and not current.muted:
                child.mute_all_but(current, self._children.values())  # The first failure.
                what = describe_returncode(returncode)
                self._announce(f"{current.spec.name} (pid {current.popen.pid}) {what}")
            self._condition.notify_all()

    # -- Results ----------------------------------------------------------------

    @property
    def returncodes(self):
        """Name -> `Popen.returncode` (None while running; -N when killed by signal N)."""
        with self._condition:
            return {name: c.returncode for name, c in self._children.items()}

    def failures(self):
        """Returns `(name, returncode)` of every process that failed, in the order they ended."""
        with self._condition:
            ends = sorted((c.exit_order, n) for n, c in self._children.items() if c.failed)
            return [(name, self._children[name].returncode) for _, name in ends]

    def first_failure(self):
        """Returns `(name, returncode)` of the earliest process to fail, or None."""
        return next(iter(self.failures()), None)

    def exit_code(self):
        """The first failure's code as a shell reports it (signal N -> 128 + N), or 0."""
        failure = self.first_failure()
        if failure is None:
            return 0
        returncode = failure[1]
        return 128 - returncode if returncode < 0 else returncode

    def output(self, name, stream=None):
        """Everything process `name` wrote ("stdout", "stderr", or both when None)."""
        return self._child(name).log.text(stream)

    def wait_for_output(self, name, substring, timeout):
        """Waits until process `name` printed `substring`.

        Returns:
            True when it did; False after `timeout` seconds or once the process's
            output ended without it.
        """
        return self._child(name).log.wait_for(substring, timeout)

    def wait_for_exit(self, name, timeout):
        """Waits until process `name` ended (without applying the stop policy).

        Returns:
            Its returncode, or None if it still runs after `timeout` seconds.
        """
        current = self._child(name)
        self._wait_until_ended([current], time.monotonic() + timeout)
        with self._condition:
            return current.returncode

    def _child(self, name):
        try:
            return self._children[name]
        except KeyError:
            raise InvalidArgumentError(
                f"No process named {name!r}. Received: name={name!r}; "
                f"known: {', '.join(self._children)}."
            ) from None

    # -- Waiting and the stop policy --------------------------------------------

    def poll(self):
        """Applies the stop policy without blocking.

        Returns:
            `exit_code()` once every process ended, else None.
        """
        with self._condition:
            self._require_started()
            self._apply_policy(time.monotonic())
            if any(c.alive for c in self._children.values()):
                return None
        return self.exit_code()

    def wait(self, timeout=None):
        """Waits until every process ended, applying the policy (module docstring).

        Args:
            timeout: seconds for the whole job, or None for no limit.

        Returns:
            `returncodes`.

        Raises:
            ProcessSetTimeout: `timeout` passed; the stacks of the processes still
                running were dumped to their stderr and they were killed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            self._require_started()
            while True:
                now = time.monotonic()
                wake_at = self._apply_policy(now)
                running = [name for name, c in self._children.items() if c.alive]
                if not running or (deadline is not None and now >= deadline):
                    break
                wake_times = [t for t in (wake_at, deadline) if t is not None]
                self._condition.wait(max(0.0, min(wake_times) - now) if wake_times else None)
        if running:
            self._time_out(running, timeout)
        self._join_threads(time.monotonic() + DRAIN_SECONDS)
        return self.returncodes

    def _apply_policy(self, now):
        return self._policy.apply(list(self._children.values()), now)

    def _time_out(self, running, timeout):
        """Dumps stacks, lets output drain, kills, and raises ProcessSetTimeout."""
        pids = self.pids
        described = ", ".join(f"{name} (pid {pids[name]})" for name in running)
        hung = [self._children[name] for name in running]
        with self._condition:
            self._policy.cancel_restarts(list(self._children.values()))  # Nothing starts now.
            self._announce(f"timed out after {timeout:g}s; dumping stacks of {described}")
            signal_all(hung, signal.SIGABRT, aborted=True)
            self._wait_until_ended(hung, time.monotonic() + self.kill_after_seconds)
            signal_all(hung, signal.SIGKILL)
            self._wait_until_ended(hung, time.monotonic() + REAP_SECONDS)
        self._join_threads(time.monotonic() + DRAIN_SECONDS)
        raise ProcessSetTimeout(
            f"The processes did not finish within {timeout:g}s. Still running: {described}. "
            "Each one's stack was dumped (SIGABRT with faulthandler) to its stderr; "
            "read it with ProcessSet.output(name). Find the hang there, or raise the timeout "
            "if the job is only slow.",
            running,
        )

    def _wait_until_ended(self, children, deadline):
        with self._condition:
            while any(c.running for c in children):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._condition.wait(remaining)
        return True

    def _join_threads(self, deadline):
        for current in list(self._children.values()):
            current.join(deadline)

    def _require_started(self):
        if not self._started:
            raise ProcessSetStateError("Call ProcessSet.start() first.")

    # -- Signals ----------------------------------------------------------------

    def send_signal(self, name, sig):
        """Sends `sig` to process `name` only (not its group); no-op once it ended.

        The exit it causes counts like any other (e.g. SIGKILL is a failure, -9).
        """
        with self._condition:
            current = self._child(name)
            if current.running:
                current.popen.send_signal(sig)

    def request_stop(self, reason, timeout=None):
        """Asks the current or next `wait`/`poll` to stop every process.

        They get SIGTERM, then SIGKILL after `timeout` seconds (default
        `kill_after_seconds`); their exits are not failures. Does not block, so
        a signal handler can call it.
        """
        with self._condition:
            self._policy.request_stop(
                reason, self.kill_after_seconds if timeout is None else timeout
            )
            self._condition.notify_all()

    def stop_all(self, reason, timeout=None):
        """Stops every process: SIGTERM, up to `timeout` s to exit, then SIGKILL.

        Blocks until they exited; their exits are not failures.

        Returns:
            `returncodes`.
        """
        self.request_stop(reason, timeout)
        with self._condition:
            if not self._started:
                return self.returncodes
            self._apply_policy(time.monotonic())
            self._wait_until_ended(list(self._children.values()), self._policy.stop_deadline)
            signal_all(self._children.values(), signal.SIGKILL)
            self._wait_until_ended(list(self._children.values()), time.monotonic() + REAP_SECONDS)
        self._join_threads(time.monotonic() + DRAIN_SECONDS)
        return self.returncodes

    def kill_all(self):
        """SIGKILLs every running process group now; does not wait (signal handlers may call it)."""
        with self._condition:
            signal_all(self._children.values(), signal.SIGKILL, stopped=True)
            self._condition.notify_all()

    def _announce(self, message):
        # Called with self._condition held: the lock order is always condition,
        # then sink, so a signal handler that takes the condition cannot deadlock.
        self._sinks[output.STDERR].write("[kdist] ", message + "\n")

    # -- Context manager --------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if self._started and any(c.running for c in self._children.values()):
            self.stop_all("leaving the ProcessSet's with-block")
        return False
