"""`StopPolicy`: when a `ProcessSet` sends which signal to which child.

Rules, in order of precedence:

1. A stop request (`request_stop`, e.g. the launcher got Ctrl-C): SIGTERM to
   everyone, SIGKILL to whoever is left after the request's timeout. These
   exits are not failures.
2. The first failure (a non-zero exit the set did not cause): the other
   non-daemon processes get `grace_seconds` to exit on their own, then SIGABRT
   (children run with PYTHONFAULTHANDLER=1, so Python prints every thread's
   stack), then SIGKILL after `kill_after_seconds`.
3. Daemons (servers): once every non-daemon process ended, SIGTERM, then SIGKILL
   after `kill_after_seconds`. These exits are not failures. A set with no
   non-daemon process runs until its daemons end.

A process whose spec has a `RestartPolicy` and fails while restarts are left is
started again after the policy's delay instead (the same command and
environment); that failure is not the set's. A stop request, a failure, or the
end of every non-daemon process cancels pending restarts (those exits then do
not count). Once its restarts are used, its next failure is a failure (rule 2).

With a `JobRestarter` (`kdist launch --max-restarts`), a failure while job
restarts are left stops every process and starts them all again instead
(`kdist.launch.restarts`); a stop request cancels it.
"""

import signal

from kdist.launch.spec import describe_returncode


class StopPolicy:
    """The timers and decisions of the rules above, for one `ProcessSet`.

    Not thread-safe: its `ProcessSet` calls it with the set's condition held.

    Args:
        grace_seconds: how long the others may run on after the first failure.
        kill_after_seconds: time between SIGABRT/SIGTERM and SIGKILL.
        announce: callable taking one message for the user.
        respawn: callable taking a `child.Child` to start again; it may raise
            OSError. Needed only for specs with a `RestartPolicy`.
        job_restarter: a `restarts.JobRestarter` to restart the whole set after
            a failure, or None.
    """

    def __init__(
        self, grace_seconds, kill_after_seconds, announce, respawn=None, job_restarter=None
    ):
        self._job = job_restarter
        self.grace_seconds = grace_seconds
        self.kill_after_seconds = kill_after_seconds
        self._announce = announce
        self._respawn = respawn
        self._stop_request = None  # (reason, timeout)
        self._stop_sent_at = None
        self._failure_announced = False
        self._abort_sent_at = None
        self._daemon_stop_at = None

    def request_stop(self, reason, timeout):
        """Records a stop request (the first one wins); `apply` carries it out."""
        if self._stop_request is None:
            self._stop_request = (reason, timeout)

    @property
    def stop_deadline(self):
        """When a carried-out stop request turns into SIGKILL, or None."""
        if self._stop_sent_at is None:
            return None
        return self._stop_sent_at + self._stop_request[1]

    def on_exit(self, children, ended, now):
        """Decides whether `ended` (a child that just exited) is restarted.

        Sets `ended.restart_at` when it is (and says so); `apply` starts it
        once that time has come. With a job restarter, it decides first.
        """
        if self._job is not None and self._stop_request is None:
            if self._job.on_exit(children, ended, now):
                return
        restart = ended.spec.restart
        if restart is None or ended.returncode == 0 or ended.stopped:
            return
        what = f"{ended.spec.name} (pid {ended.popen.pid}) {describe_returncode(ended.returncode)}"
        if self._stop_request is not None or self._daemon_stop_at is not None:
            return
        if any(c.failed for c in children if c is not ended):
            return
        if ended.num_restarts >= restart.max_restarts:
            if restart.max_restarts:
                self._announce(f"{what}; all {restart.max_restarts} restarts used, so it fails")
            return
        number = ended.num_restarts + 1
        delay = restart.delay_seconds(number)
        ended.restart_at = now + delay
        self._announce(f"{what}; restarting it ({number} of {restart.max_restarts}) in {delay:g}s")

    def cancel_restarts(self, children):
        """Drops every pending restart, of a process or of the whole job (the set is ending)."""
        if self._job is not None:
            self._job.cancel(children)
        _cancel_restarts(children)

    def apply(self, children, now):
        """Sends the signals, and makes the restarts, that are due at `now` (`time.monotonic()`).

        Args:
            children: every `child.Child` of the set.

        Returns:
            When the next signal or restart will be due, or None if nothing is pending.
        """
        if self._stop_request is not None:
            self.cancel_restarts(children)
            return self._apply_stop(children, now)
        if self._job is not None and self._job.pending:
            return self._job.apply(children, now)
        if any(c.failed for c in children):
            _cancel_restarts(children)
        wake_times = [self._apply_restarts(children, now)]
        survivors = [c for c in children if c.alive and not c.spec.daemon]
        wake_times.append(self._apply_fail_fast(children, survivors, now))
        wake_times.append(self._apply_daemon_stop(children, survivors, now))
        return min((t for t in wake_times if t is not None), default=None)

    def _apply_restarts(self, children, now):
        pending = [c for c in children if c.restart_at is not None]
        for current in pending:
            if now < current.restart_at:
                continue
            current.num_restarts += 1
            try:
                self._respawn(current)
            except OSError as error:
                current.restart_at = None  # Its last exit is now a failure.
                self._announce(f"{current.spec.name} could not be restarted ({error})")
                continue
            self._announce(f"restarted {current.spec.name} (pid {current.popen.pid})")
        return min((c.restart_at for c in children if c.restart_at is not None), default=None)

    def _apply_stop(self, children, now):
        if self._stop_sent_at is None:
            self._announce(f"stopping every process: {self._stop_request[0]}")
            self._stop_sent_at = now
            signal_all(children, signal.SIGTERM, stopped=True)
        return _kill_when_due(children, self.stop_deadline, now)

    def _apply_fail_fast(self, children, survivors, now):
        failed = [c for c in children if c.failed]
        if failed and survivors and self._abort_sent_at is None:
            first = min(failed, key=lambda c: c.exit_order)
            due = first.ended_at + self.grace_seconds
            if not self._failure_announced:
                self._failure_announced = True
                self._announce(
                    f"{first.spec.name} failed first; the others get {self.grace_seconds:g}s to "
                    "exit, then their stacks are dumped (SIGABRT) and they are killed"
                )
            if now < due:
                return due
            names = ", ".join(c.spec.name for c in survivors)
            self._announce(f"grace period over; dumping stacks of {names} and stopping them")
            signal_all(survivors, signal.SIGABRT, aborted=True)
            self._abort_sent_at = now
        if self._abort_sent_at is None:
            return None
        return _kill_when_due(survivors, self._abort_sent_at + self.kill_after_seconds, now)

    def _apply_daemon_stop(self, children, survivors, now):
        has_non_daemons = any(not c.spec.daemon for c in children)
        if has_non_daemons and not survivors:
            _cancel_restarts(children)
        daemons = [c for c in children if c.running and c.spec.daemon]
        if has_non_daemons and daemons and not survivors and self._daemon_stop_at is None:
            self._daemon_stop_at = now
            names = ", ".join(c.spec.name for c in daemons)
            self._announce(f"every non-daemon process ended; stopping {names} (SIGTERM)")
            signal_all(daemons, signal.SIGTERM, stopped=True)
        if self._daemon_stop_at is None:
            return None
        return _kill_when_due(daemons, self._daemon_stop_at + self.kill_after_seconds, now)


def signal_all(children, sig, stopped=False, aborted=False):
    """Sends `sig` to the process group of each running child and records why.

    Args:
        stopped: the set asked them to stop: their exits are not failures.
        aborted: they were sent SIGABRT for a stack dump.
    """
    for current in children:
        if current.running:
            current.stopped = current.stopped or stopped
            current.aborted = current.aborted or aborted
            current.signal_group(sig)


def _cancel_restarts(children):
    """Drops pending restarts; those children's last exits then do not count as failures."""
    for current in children:
        if current.restart_at is not None:
            current.restart_at = None
            current.stopped = True


def _kill_when_due(children, due, now):
    """SIGKILLs the running `children` once `due` passed; returns `due` while pending."""
    if not any(c.running for c in children):
        return None
    if now < due:
        return due
    signal_all(children, signal.SIGKILL)
    return None
