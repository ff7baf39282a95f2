"""Restarting a whole synchronous job after a process died (`kdist launch --max-restarts`).

In synchronous training (`MultiWorkerMirroredStrategy`, one `torch.distributed`
group) a lost rank cannot be replaced alone: the survivors wait for it in a
collective and the group cannot take a newcomer. What survives is the user's
`BackupAndRestore` backup. So, as `torchrun --max-restarts` does, the launcher
restarts every process:

1. A process fails (a non-zero exit the launcher did not cause) while job
   restarts are left: the launcher says which process, how it ended and
   "restarting the job (i of K)", and SIGTERMs every other process (no stack
   dumps: the cause is known), then SIGKILLs whoever is left after the set's
   `kill_after_seconds`. None of these exits is a failure.
2. Once every process has ended (and a delay: 1 s, then doubling), every
   process starts again from a fresh `ProcessSpec` (`JobRestart.make_specs`):
   the launcher picks a new rendezvous port (a new local cluster), so the new
   group can never meet a straggler of the old one. The user's script runs
   again from the start and its `fit` resumes from the backup.
3. A failure once the restarts are used up is the job's failure: the usual
   fail-fast rule (`kdist.launch.policy`) and failure summary apply.

A stop request (Ctrl-C, `--timeout`) cancels a pending job restart.
"""

import dataclasses
import signal
import time
from collections.abc import Callable

from kdist.errors import InvalidArgumentError
from kdist.launch.child import DRAIN_SECONDS
from kdist.launch.policy import signal_all
from kdist.launch.spec import RestartPolicy, describe_returncode

DEFAULT_BACKOFF_SECONDS = 1.0
# Environment variables that show the rendezvous a restarted job uses.
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class JobRestart:
    """How a `ProcessSet` restarts all of its processes after one fails.

    Args:
        max_restarts: restarts of the whole job over its life (0: none).
        make_specs: a callable returning the `ProcessSpec`s of a restarted job,
            one per process of the set, with the same names (usually on a new
            rendezvous port). Called once per restart, after every process ended.
        backoff_seconds: as `RestartPolicy`'s: the first restart follows the last
            process's end at once, the second after this delay, then doubling, at most 60 s.

    Raises:
        kdist.errors.InvalidArgumentError: a negative count or delay, or
            `make_specs` is not callable.

    Example:
        ```python
        restart = JobRestart(2, lambda: plans.build_specs(args))
        processes = ProcessSet(specs, job_restart=restart)
        ```
    """

    max_restarts: int
    make_specs: Callable
    backoff_seconds: float = DEFAULT_BACKOFF_SECONDS

    def __post_init__(self):
        RestartPolicy(self.max_restarts, self.backoff_seconds)  # Validates both.
        if not callable(self.make_specs):
            raise InvalidArgumentError(
                "make_specs must be a callable returning the restarted job's ProcessSpecs. "
                f"Received: make_specs={self.make_specs!r}."
            )

    def delay_seconds(self, restart_number):
        """Seconds between the end of the last process and restart `restart_number` (1-based)."""
        return RestartPolicy(self.max_restarts, self.backoff_seconds).delay_seconds(
            restart_number
        )


@dataclasses.dataclass
class _Pending:
    """A job restart between the failure and the new processes."""

    number: int
    kill_at: float  # When the processes still running get SIGKILL.
    terminated: bool = False  # SIGTERM was sent.
    start_at: float | None = None  # Set once every process ended.


class JobRestarter:
    """The decisions of a `JobRestart`, for the `StopPolicy` of one `ProcessSet`.

    Not thread-safe: the set calls it with its condition held.

    Args:
        restart: the `JobRestart`.
        kill_after_seconds: how long the others get after SIGTERM before SIGKILL.
        announce: callable taking one message for the user.
        respawn: callable taking a `child.Child` to start again; it may raise OSError.
    """

    def __init__(self, restart, kill_after_seconds, announce, respawn):
        self.restart = restart
        self.kill_after_seconds = kill_after_seconds
        self._announce = announce
        self._respawn = respawn
        self.num_restarts = 0
        self._pending = None

    @property
    def pending(self):
        """True between a failure that restarts the job and the new processes' start."""
        return self._pending is not None

    def on_exit(self, children, ended, now):
        """Decides whether the exit of `ended` belongs to a job restart.

        Returns:
            True when it does (a failure that starts one, or any exit while one
            is pending): it is then no failure of the set.
        """
        if self._pending is not None:
            ended.restart_at = now  # Keeps it `alive` (and no failure) until the restart.
            return True
        if ended.returncode == 0 or ended.stopped:
            return False
        what = f"{ended.spec.name} (pid {ended.popen.pid}) {describe_returncode(ended.returncode)}"
        maximum = self.restart.max_restarts
        if self.num_restarts >= maximum:
            if maximum:
                self._announce(f"{what}; all {maximum} job restarts used, so the job fails")
            return False
        self._pending = _Pending(self.num_restarts + 1, now + self.kill_after_seconds)
        ended.restart_at = now
        others = [c for c in children if c.running]
        for current in others:
            # Whatever they do from now on (a CollectiveTimeoutError) follows from this failure.
            current.stopped = True
        stopping = (
            f": stopping {', '.join(c.spec.name for c in others)} (SIGTERM, SIGKILL after "
            f"{self.kill_after_seconds:g}s)"
            if others
            else ""
        )
        number = self._pending.number
        self._announce(f"{what}; restarting the job ({number} of {maximum}){stopping}")
        return True

    def cancel(self, children):
        """Drops a pending restart (a stop request came); returns whether one was pending."""
        if self._pending is None:
            return False
        self._pending = None
        for current in children:
            if current.restart_at is not None:
                current.restart_at = None
                current.stopped = True
        return True

    def apply(self, children, now):
        """Stops the old processes, then starts the new ones, when due.

        Returns:
            When to call again, or None to wait for the next exit.
        """
        pending = self._pending
        running = [c for c in children if c.running]
        if running:
            if not pending.terminated:
                pending.terminated = True
                signal_all(running, signal.SIGTERM, stopped=True)
            if now < pending.kill_at:
                return pending.kill_at
            signal_all(running, signal.SIGKILL, stopped=True)
            return None  # Their exits wake the set.
        if pending.start_at is None:
            pending.start_at = now + self.restart.delay_seconds(pending.number)
        if now < pending.start_at:
            return pending.start_at
        self._start_again(children, pending.number)
        return None

    def _start_again(self, children, number):
        self._pending = None
        self.num_restarts = number
        label = f"restarting the job ({number} of {self.restart.max_restarts})"
        try:
            specs = self._new_specs(children)
        except (InvalidArgumentError, OSError) as error:
            self._announce(f"{label} failed: {error}; the job fails")
            self._give_up(children, started=[])
            return
        # The old runs' output drains first (their log files close): a new run's
        # lines never interleave with, or get cut by the end of, an old one's.
        drained_by = time.monotonic() + DRAIN_SECONDS
        for current in children:
            current.join(drained_by)
        started = []
        for current in children:
            current.spec = specs[current.spec.name]
            current.stopped = current.aborted = current.muted = False
            try:
                self._respawn(current)
            except OSError as error:
                self._announce(f"{label} failed: {current.spec.name} could not start ({error})")
                self._give_up(children, started, current)
                return
            started.append(current)
        pids = ", ".join(f"{c.spec.name} (pid {c.popen.pid})" for c in children)
        self._announce(f"{label}: started {pids}{_rendezvous(children[0].spec.env)}")

    def _new_specs(self, children):
        specs = {spec.name: spec for spec in self.restart.make_specs()}
        names = [c.spec.name for c in children]
        if sorted(specs) != sorted(names):
            raise InvalidArgumentError(
                "JobRestart.make_specs must return one ProcessSpec per process, with the same "
                f"names. Received: {sorted(specs)}; expected: {sorted(names)}."
            )
        return specs

    def _give_up(self, children, started, unstartable=None):
        """No restart after all: the new processes are stopped, and a failure is left to report."""
        self.num_restarts = self.restart.max_restarts
        signal_all(started, signal.SIGKILL, stopped=True)
        for current in children:
            current.restart_at = None
        # The process that could not start (or, without one, the first to have
        # failed) is the job's failure; the others' exits were the launcher's doing.
        failed = unstartable or min(
            (c for c in children if c.returncode not in (None, 0)),
            key=lambda c: c.exit_order,
            default=None,
        )
        if failed is not None and failed.returncode is not None:
            failed.stopped = False


def _rendezvous(env):
    if all(env.get(name) for name in RENDEZVOUS_VARIABLES):
        return f"; rendezvous {env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return ""
