"""Warm processes: new processes forked from one that has already imported NumPy, torch and Keras.

A cold `python train.py` spends seconds importing torch and Keras before the
script's first line runs. A `WarmPool` starts one *zygote* per import-time
environment: a Python process that imports `PRELOADED_MODULES` and waits. Every
process a `ProcessSet` with a pool starts is then forked from it: the child takes
its argv, environment, working directory and standard streams, leads a session of
its own, and runs the script (or `-m` module, or `-c` code) as `python` would.
Its start costs milliseconds.

Safe by construction:
- A zygote forks from its only Python thread, having run no torch operation and
  opened no connection: no CUDA context, OpenMP pool, gloo group or gRPC channel
  exists to be copied. It checks for Python threads before every fork; if one
  appeared, it refuses and the pool starts that process cold.
- What an import fixes must match: a process whose environment differs from a
  zygote's in a variable read at import time (`import_time_environment`:
  `KERAS_BACKEND`, `PYTHONPATH`, `OMP_NUM_THREADS`, `HOME`, ...) gets a zygote of
  its own. A command other than `sys.executable` with a script, `-m` or `-c`
  (and the flags `-u`, `-B`, `-X faulthandler`) starts cold.
- What a process seeds at start-up is seeded again in the child: Python's `random`
  (by Python), NumPy's global generator, `tempfile`'s directory (from the child's
  environment). String hashing is the zygote's: every warm child of one zygote
  shares the hash seed unless `PYTHONHASHSEED` is set.
- Nobody else can ask a zygote for a process: it reads requests from one end of a
  socket pair its pool made (no address, no listening socket). It dies with the
  thread that started it (`PR_SET_PDEATHSIG`) or when its pool closes, and its
  children die with it: none outlives the job.

Where it is not used: off Linux (no `PR_SET_PDEATHSIG`; macOS spawns), under
`kdist launch --no-warm`, or with `KDIST_WARM=0` in the environment; processes
then start cold, as before. A zygote that fails to start (an import error) is
reported once by `WarmPool.unavailable` and its processes start cold. The zygote
itself is `kdist.launch.zygote`.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

from kdist.launch import child as _child, zygote as _zygote

PRELOADED_MODULES = ("numpy", "torch", "keras")
# Environment variables read while those modules (or the interpreter) start: a
# warm child must have the same values as its zygote.
IMPORT_TIME_PREFIXES = (
    "PYTHON", "KERAS_", "TORCH", "PYTORCH_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_",
    "LD_", "JAX_", "XLA_", "TF_CPP_", "LC_",
)
IMPORT_TIME_NAMES = ("HOME", "LANG")
# Applied in the child rather than at import: they may differ from the zygote's.
APPLIED_IN_CHILD = ("PYTHONUNBUFFERED", "PYTHONFAULTHANDLER")
ENABLE_VARIABLE = "KDIST_WARM"
# How long a zygote may take to import its modules (a loaded 2-core machine).
START_SECONDS = 180.0
# How long a zygote may take to answer a fork request with the child's pid.
FORK_SECONDS = 60.0
# Names the `kdist.launch.warm_broker.Broker` whose zygotes a pool uses first.
BROKER_VARIABLE = "KDIST_WARM_BROKER"
# How long one exchange with a broker may take: a zygote's imports plus margin.
BROKER_ANSWER_SECONDS = START_SECONDS + 20.0


def supported():
    """Whether this platform can fork warm processes safely (Linux with `fork` and fd passing)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(socket, "send_fds")


def enabled(environ=None):
    """Whether warm starts are on: `supported()` and `KDIST_WARM` is not "0"."""
    environ = os.environ if environ is None else environ
    return supported() and environ.get(ENABLE_VARIABLE, "1") != "0"


def import_time_environment(env):
    """The part of `env` fixed by starting Python and importing `PRELOADED_MODULES`, as a sorted tuple."""
    return tuple(sorted(
        (name, value) for name, value in env.items()
        if name not in APPLIED_IN_CHILD
        and (name.startswith(IMPORT_TIME_PREFIXES) or name in IMPORT_TIME_NAMES)
    ))


def parse_command(argv):
    """`{"kind", "target", "args", "unbuffered", "faulthandler"}` for a command a zygote can run, else None.

    Runnable: `sys.executable [-u] [-B] [-X faulthandler] (script | -m module | -c code) args...`.
    """
    argv = list(argv)
    if not argv or not same_interpreter(argv[0], sys.executable):
        return None
    command = {"unbuffered": False, "faulthandler": False}
    index = 1
    while index < len(argv):
        arg = argv[index]
        if arg == "-u":
            command["unbuffered"] = True
        elif arg == "-B":
            pass  # Bytecode files: the zygote's imports are done either way.
        elif arg == "-X" and index + 1 < len(argv) and argv[index + 1] == "faulthandler":
            command["faulthandler"] = True
            index += 1
        elif arg in ("-m", "-c"):
            if index + 1 >= len(argv):
                return None
            command.update(kind="module" if arg == "-m" else "code", target=argv[index + 1],
                           args=argv[index + 2:])
            return command
        elif arg.startswith("-"):
            return None  # A flag the interpreter would apply at start-up.
        else:
            command.update(kind="script", target=arg, args=argv[index + 1:])
            return command
        index += 1
    return None  # An interactive interpreter.


def same_interpreter(a, b):
    """Whether executables `a` and `b` are one Python with one environment.

    The same file is not enough: every virtual environment's `bin/python` is a
    link to one base interpreter, and which packages it sees follows from the
    folder the link is in (its `pyvenv.cfg`). So the folders must be one too.
    """
    try:
        return os.path.samefile(a, b) and os.path.samefile(os.path.dirname(os.path.abspath(a)),
                                                           os.path.dirname(os.path.abspath(b)))
    except OSError:
        return False


def request_broker_control(env, environ=None):
    """A socket to the zygote of `kdist.launch.warm_broker.Broker` for `env`'s import-time environment, or None.

    None when `environ` (default `os.environ`) names no broker, the broker is
    gone, or it has no zygote for `env`; the caller then starts its own.
    """
    value = (os.environ if environ is None else environ).get(BROKER_VARIABLE)
    if not value:
        return None
    try:
        named = json.loads(value)
        address, token = "\0" + named["address"], named["token"]
    except (ValueError, KeyError, TypeError):
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
        try:
            connection.settimeout(BROKER_ANSWER_SECONDS)
            connection.connect(address)
            connection.send(json.dumps({"token": token, "env": dict(env), "executable": sys.executable}).encode())
            data, fds, _, _ = socket.recv_fds(connection, _zygote.MAX_MESSAGE, 1)
        except OSError:
            return None
        if not fds:
            return None
        control = socket.socket(fileno=fds[0])
        if not data or "ok" not in json.loads(data):
            control.close()
            return None
        return control


# ----- the pool (the launcher's side) --------------------------------------------------

_shared = None
_shared_lock = threading.Lock()


def shared_pool():
    """This process's `WarmPool`, made on first use by the main thread (else None) and closed at exit.

    Every job a process launches (`kdist launch` runs one; a test session runs
    many) forks from the same zygotes, so each import-time environment is
    imported once per process.
    """
    global _shared
    with _shared_lock:
        if _shared is None and threading.current_thread() is threading.main_thread():
            import atexit

            _shared = WarmPool()
            atexit.register(_shared.close)
        return _shared



class WarmPool:
    """Starts processes by forking them from zygotes, one zygote per import-time environment.

    Thread-safe. A zygote is started by the first `spawn` that needs it, and only
    from the thread that made the pool (the zygote dies with that thread); from
    another thread such a process starts cold. `close()` ends the zygotes and
    with them any process they started that still runs (close after the job).

    Where the environment names a `kdist.launch.warm_broker.Broker`
    (`KDIST_WARM_BROKER`), a zygote the broker's process keeps is used instead of
    starting one (from any thread).

    Args:
        modules: what a zygote imports before it serves.
        core_dumps: as `ProcessSet`'s (False: children get a core-file limit of 0).
        use_broker: ask the environment's broker first (a broker's own pool does not).
    """

    def __init__(self, modules=PRELOADED_MODULES, core_dumps=False, use_broker=True):
        self.modules = tuple(modules)
        self._core_dumps = core_dumps
        self._use_broker = use_broker
        self._owner = threading.current_thread()
        self._lock = threading.Lock()
        self._zygotes = {}  # import-time environment -> _Zygote, or None once it failed
        self.unavailable = None  # Why the last zygote that failed could not serve.

    def spawn(self, argv, env, cwd=None):
        """Forks `argv` with the full environment `env` from a zygote; returns a `WarmProcess`.

        Returns None when this command cannot start warm (see the module doc);
        the caller then starts it cold. The child leads a new session.
        """
        command = parse_command(argv)
        if command is None:
            return None
        key = import_time_environment(env)
        with self._lock:
            zygote = self._zygote(key, env)
        if zygote is None:
            return None
        request = dict(command, env=dict(env), cwd=os.path.abspath(cwd or os.getcwd()))
        try:
            return zygote.fork(request)
        except _ZygoteGone as error:
            with self._lock:
                if self._zygotes.get(key) is zygote:
                    self._zygotes[key] = None
                self.unavailable = str(error)
            return None

    def _zygote(self, key, env):
        """(Under the lock.) The zygote for `key`: known, a broker's, or started here; None: start cold."""
        if key not in self._zygotes:
            control = request_broker_control(env) if self._use_broker else None
            if control is not None:
                self._zygotes[key] = _Zygote.shared(control)
            elif threading.current_thread() is not self._owner:
                return None
            else:
                self._zygotes[key] = self._start_zygote(env)
        return self._zygotes[key]

    def zygote_control(self, env):
        """The request socket of the zygote for `env` (started if needed), or None: what a broker hands out."""
        with self._lock:
            zygote = self._zygote(import_time_environment(env), env)
        return None if zygote is None else zygote._control

    def _start_zygote(self, env):
        try:
            return _Zygote(self.modules, env, self._core_dumps)
        except _ZygoteGone as error:
            self.unavailable = str(error)
            return None

    def close(self):
        """Ends every zygote, and any process a zygote started that still runs."""
        with self._lock:
            zygotes = [z for z in self._zygotes.values() if z is not None]
            self._zygotes.clear()
        for zygote in zygotes:
            zygote.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False


class _ZygoteGone(OSError):
    """A zygote could not start, or stopped answering."""


class _Zygote:
    @classmethod
    def shared(cls, control):
        """A zygote another process started, reached through `control` (a copy of its request socket)."""
        zygote = cls.__new__(cls)
        zygote._control, zygote._send_lock, zygote._process = control, threading.Lock(), None
        return zygote

    def __init__(self, modules, env, core_dumps):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._control = ours
        self._send_lock = threading.Lock()
        try:
            self._process = subprocess.Popen(
                [sys.executable, os.path.abspath(_zygote.__file__), str(theirs.fileno()), ",".join(modules)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                preexec_fn=_child.make_preexec(core_dumps),
            )
        except OSError as error:
            ours.close()
            raise _ZygoteGone(f"the zygote could not start: {error}") from error
        finally:
            theirs.close()
        ready = _zygote.receive(ours, START_SECONDS)
        if ready is None or "error" in ready:
            self.close()
            why = "it exited" if ready is None else ready["error"]
            raise _ZygoteGone(f"the zygote did not become ready: {why}")
        self.pid = ready["pid"]

    def fork(self, request):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        stdin = os.open(os.devnull, os.O_RDONLY)
        try:
            data = json.dumps(request).encode()
            with self._send_lock:
                socket.send_fds(self._control, [data], [theirs.fileno(), stdin, out_write, err_write])
        except OSError as error:
            for fd in (out_read, err_read):
                os.close(fd)
            ours.close()
            raise _ZygoteGone(f"the zygote stopped taking requests: {error}") from error
        finally:
            theirs.close()
            for fd in (stdin, out_write, err_write):
                os.close(fd)
        reply = _zygote.receive(ours, FORK_SECONDS)
        if reply is None or "pid" not in reply:
            for fd in (out_read, err_read):
                os.close(fd)
            ours.close()
            why = "no answer" if reply is None else reply.get("error")
            raise _ZygoteGone(f"the zygote did not fork: {why}")
        return WarmProcess(reply["pid"], ours, os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb"))

    def close(self):
        self._control.close()  # The zygote reads end-of-file and exits (once every copy is closed).
        if self._process is None:
            return  # Another process's: it stays.
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class WarmProcess:
    """A process forked by a zygote, with the part of `subprocess.Popen`'s interface a `ProcessSet` uses.

    Attributes:
        pid: its process id (it leads its own session: the pid is its group id).
        stdout, stderr: binary readers of its output pipes.
        returncode: None while it runs; its exit code, or -N when signal N ended it.
    """

    def __init__(self, pid, status, stdout, stderr):
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode = None
        self._status = status
        self._lock = threading.Lock()

    def wait(self):
        """Blocks until the process ended (the zygote reports it); returns `returncode`."""
        with self._lock:
            if self.returncode is None:
                message = _zygote.receive(self._status, None)
                self._status.close()
                # No report: the zygote died, and its children with it (PR_SET_PDEATHSIG).
                self.returncode = -signal.SIGKILL if message is None else message["returncode"]
            return self.returncode

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        """Sends `sig` to the process (not its group), unless it is known to have ended."""
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
