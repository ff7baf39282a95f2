"""One child process of a `ProcessSet`: how it starts, its output threads, its end.

Children must not outlive the launcher (no orphans holding ports or GPUs), must
not receive the terminal's Ctrl-C directly (the launcher decides how to stop
them), and must print every thread's stack when sent SIGABRT.
"""

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

from kdist.launch import output

try:
    import resource
except ImportError:  # Not POSIX.
    resource = None

# From <linux/prctl.h>.
PR_SET_PDEATHSIG = 1
# How long, after a process ended, its output may take to drain (a grandchild
# that inherited a pipe can keep it open forever).
DRAIN_SECONDS = 5.0

# Set in every child so that SIGABRT makes Python print each thread's stack
# (faulthandler) before dying, and lines reach the parent as they are written.
CHILD_DEFAULTS = {"PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"}


def child_environment(overrides):
    """Returns `os.environ` + `CHILD_DEFAULTS` + `overrides`; a None value removes a name."""
    env = dict(os.environ)
    env.update(CHILD_DEFAULTS)
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    return env


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def make_preexec(core_dumps=False):
    """Returns the function `subprocess.Popen` runs in the child before exec.

    On Linux the child asks for SIGKILL when its parent dies
    (`prctl(PR_SET_PDEATHSIG)`). The kernel sends it when the *thread* that
    forked the child ends, so start children from a thread that outlives them
    (normally the main thread). Unless `core_dumps`, the child's soft core-file
    limit is 0: the SIGABRT used for stack dumps would otherwise write a core
    file of every stopped process.

    Everything that can allocate or import is resolved here, in the parent;
    the returned function only makes system calls, because the child of a
    multi-threaded parent must not take locks between fork and exec.
    """
    prctl = _load_prctl()
    parent_pid = os.getpid()
    core_limit = None
    if not core_dumps and resource is not None:
        core_limit = (0, resource.getrlimit(resource.RLIMIT_CORE)[1])

    def preexec():
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # The parent may have died before prctl ran; then nobody would kill us.
            if os.getppid() != parent_pid:
                os._exit(1)
        if core_limit is not None:
            resource.setrlimit(resource.RLIMIT_CORE, core_limit)

    return preexec


def log_path(log_dir, name):
    """Where the output of process `name` goes in `log_dir`: `<log_dir>/<name>.log`."""
    return os.path.join(log_dir, f"{name}.log")


def mute_all_but(first_failure, children):
    """Mutes every child but `first_failure`: their output then only goes to their logs.

    Consequent errors (a `CollectiveTimeoutError` on every rank that waited for
    the failed one) would otherwise bury the first failure's traceback.
    """
    for current in children:
        current.muted = current is not first_failure


class Child:
    """One process of a `ProcessSet`: its spec, output, threads, and what happened to it.

    Not thread-safe by itself: the owning `ProcessSet` guards the state fields
    (`returncode`, `exit_order`, `stopped`, ...) with its condition.
    """

    def __init__(self, spec, keep_lines):
        self.spec = spec
        self.log = output.OutputLog(keep_lines)
        self.popen = None
        self.threads = []
        self.returncode = None
        self.exit_order = None  # 0 for the first process of the set to exit, 1 for the next...
        self.ended_at = None
        self.stopped = False  # The set asked it to stop; its exit is not a failure.
        self.aborted = False  # It was sent SIGABRT for a stack dump.
        # Another process failed first (`mute_all_but`); a stack dump is echoed again.
        self.muted = False
        self.num_restarts = 0  # Times it was started again after a failure.
        self.restart_at = None  # While a restart is pending: when it is due.
        self.warm = False  # Its last start was forked from a zygote.

    @property
    def running(self):
        return self.popen is not None and self.returncode is None

    @property
    def alive(self):
        """Running, or ended with a restart pending."""
        return self.running or self.restart_at is not None

    def echoing(self):
        """Whether the output read now is echoed (read by the pump threads without a lock)."""
        return not self.muted or self.aborted

    @property
    def failed(self):
        return self.returncode not in (None, 0) and not self.stopped and self.restart_at is None

    def spawn(self, preexec, sinks, log_dir, on_exit, warm=None):
        """Starts the process and its threads; `on_exit(child, returncode)` runs when it ends.

        With a `kdist.launch.warm.WarmPool`, the process is forked from a zygote
        when its command allows (else, and without one, it starts cold).

        Raises:
            OSError: the command cannot be executed.
        """
        spec = self.spec
        restarting = self.popen is not None
        env = child_environment(spec.env)
        popen = None if warm is None else warm.spawn(spec.argv, env, spec.cwd)
        self.popen = popen or subprocess.Popen(
            spec.argv,
            env=env,
            cwd=spec.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=preexec,
        )
        self.warm = popen is not None
        if restarting:
            self.log.reopen()
            self.returncode = self.ended_at = self.restart_at = None
        log_file = None
        if log_dir is not None:
            mode = "a" if restarting else "w"
            log_file = open(log_path(log_dir, spec.name), mode, encoding="utf-8")
        file_lock = threading.Lock()
        prefix = f"[{spec.name}] "
        pipes = ((output.STDOUT, self.popen.stdout), (output.STDERR, self.popen.stderr))
        # A restarted child keeps the threads of its earlier runs (they may still
        # be draining); `join` waits for them all.
        first_new = len(self.threads)
        for stream, pipe in pipes:
            pump_args = (
                pipe, stream, self.log, sinks[stream], prefix, log_file, file_lock, self.echoing
            )
            self.threads.append(
                threading.Thread(
                    target=output.pump,
                    args=pump_args,
                    name=f"kdist-pump-{spec.name}-{stream}",
                    daemon=True,
                )
            )
        # Blocks in Popen.wait() without a deadline: the set always ends its
        # children (policy, timeout, stop_all, or PDEATHSIG if the parent dies).
        self.threads.append(
            threading.Thread(
                target=self._reap,
                args=(self.popen, on_exit, log_file, self.threads[first_new:]),
                name=f"kdist-wait-{spec.name}",
                daemon=True,
            )
        )
        for thread in self.threads[first_new:]:
            thread.start()

    def _reap(self, popen, on_exit, log_file, pumps):
        on_exit(self, popen.wait())
        if log_file is not None:
            deadline = time.monotonic() + DRAIN_SECONDS
            for thread in pumps:
                thread.join(max(0.0, deadline - time.monotonic()))
            log_file.close()

    def signal_group(self, sig):
        """Sends `sig` to the child's process group (it and what it started), if it runs."""
        if not self.running:
            return
        try:
            # The child leads its own session, so its pid is its group id.
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass  # Exited, not reaped yet.
        except PermissionError:
            self.popen.send_signal(sig)

    def join(self, deadline):
        """Waits (until `deadline`, a `time.monotonic()` value) for the output to drain."""
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
