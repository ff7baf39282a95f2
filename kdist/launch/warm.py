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
  thread that started it (`PR_SET_PDEATHSIG`), and its children die with it.

Where it is not used: off Linux (no `PR_SET_PDEATHSIG`; macOS spawns), under
`kdist launch --no-warm`, or with `KDIST_WARM=0` in the environment; processes
then start cold, as before. A zygote that fails to start (an import error) is
reported once by `WarmPool.unavailable` and its processes start cold.
"""

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

# The zygote runs this file as a script, so that it imports no kdist module (`import
# kdist` would choose a Keras backend a plain child never chose): only the standard
# library above this line, and kdist's modules inside the pool's functions.

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
MAX_MESSAGE = 1 << 20
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
    if not argv or not _same_file(argv[0], sys.executable):
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


def _same_file(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


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

    Args:
        modules: what a zygote imports before it serves.
        core_dumps: as `ProcessSet`'s (False: children get a core-file limit of 0).
    """

    def __init__(self, modules=PRELOADED_MODULES, core_dumps=False):
        self.modules = tuple(modules)
        self._core_dumps = core_dumps
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
            if key not in self._zygotes:
                if threading.current_thread() is not self._owner:
                    return None
                self._zygotes[key] = self._start_zygote(env)
            zygote = self._zygotes[key]
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
    def __init__(self, modules, env, core_dumps):
        from kdist.launch import child

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._control = ours
        self._send_lock = threading.Lock()
        try:
            self._process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(theirs.fileno()), ",".join(modules)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                preexec_fn=child.make_preexec(core_dumps),
            )
        except OSError as error:
            ours.close()
            raise _ZygoteGone(f"the zygote could not start: {error}") from error
        finally:
            theirs.close()
        ready = _receive(ours, START_SECONDS)
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
        reply = _receive(ours, FORK_SECONDS)
        if reply is None or "pid" not in reply:
            for fd in (out_read, err_read):
                os.close(fd)
            ours.close()
            why = "no answer" if reply is None else reply.get("error")
            raise _ZygoteGone(f"the zygote did not fork: {why}")
        return WarmProcess(reply["pid"], ours, os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb"))

    def close(self):
        self._control.close()  # The zygote reads end-of-file and exits.
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _receive(sock, timeout):
    """One JSON message from `sock`, or None at end-of-file or after `timeout` seconds."""
    sock.settimeout(timeout)
    try:
        data = sock.recv(MAX_MESSAGE)
    except (socket.timeout, OSError):
        return None
    finally:
        sock.settimeout(None)
    return json.loads(data) if data else None


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
                message = _receive(self._status, None)
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


# ----- the zygote --------------------------------------------------------------------


def _zygote_main(control_fd, modules):
    control = socket.socket(fileno=control_fd)
    try:
        import importlib

        for name in modules:
            importlib.import_module(name)
    except BaseException as error:  # noqa: BLE001  reported to the pool, which starts cold
        _send(control, {"error": f"importing {name} raised {type(error).__name__}: {error}"})
        return 1
    import gc

    # What was imported stays out of the collector's work in every child (which would
    # otherwise copy each page it scans).
    gc.freeze()
    _send(control, {"ready": True, "pid": os.getpid()})
    request = _serve(control)
    if request is None:
        return 0
    _finish(_run_child(request))


def _send(sock, message):
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass  # The other side is gone; its end-of-file tells it what it needs.


def _serve(control):
    """Forks a child per request. Returns the request in the child; None in the zygote when told to end."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, "control")
    selector.register(wake_read, selectors.EVENT_READ, "exits")
    statuses = {}  # pid -> socket its exit is reported on
    while True:
        for key, _ in selector.select():
            if key.data == "control":
                try:
                    data, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 8)
                except OSError:
                    data, fds = b"", []
                if not data:  # The pool closed; children still running die with the zygote.
                    return None
                if len(fds) != 4:
                    for fd in fds:
                        os.close(fd)
                    continue
                status = socket.socket(fileno=fds[0])
                if threading.active_count() != 1:
                    _send(status, {"error": "a Python thread runs in the zygote; forking is unsafe"})
                    status.close()
                    for fd in fds[1:]:
                        os.close(fd)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                zygote = os.getpid()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    control.close()
                    for other in statuses.values():
                        other.close()
                    status.close()
                    os.close(wake_read)
                    os.close(wake_write)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    _become_child(fds[1:])
                    if os.getppid() != zygote:
                        os._exit(1)  # The zygote died before PR_SET_PDEATHSIG was set.
                    return json.loads(data)
                for fd in fds[1:]:
                    os.close(fd)
                _send(status, {"pid": pid})
                statuses[pid] = status
                selector.register(status, selectors.EVENT_READ, pid)
            elif key.data == "exits":
                try:
                    while os.read(wake_read, 4096):
                        pass
                except BlockingIOError:
                    pass
                _reap(statuses, selector)
            else:
                # The pool closed its end before the child ended: nobody waits for
                # it, so it must not outlive its job.
                pid = key.data
                selector.unregister(key.fileobj)
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass


def _reap(statuses, selector):
    while statuses:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status = statuses.pop(pid, None)
        if status is None:
            continue
        _send(status, {"returncode": os.waitstatus_to_exitcode(wait_status)})
        try:
            selector.unregister(status)
        except (KeyError, ValueError):
            pass
        status.close()


def _become_child(fds):
    """In the forked child: its own session, death with the zygote, the pool's streams."""
    import ctypes

    os.setsid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # Dies with the zygote.
    stdin, stdout, stderr = fds
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run_child(request):
    """Runs the request's command in this (forked) process, as `python` would; returns the exit code."""
    import faulthandler
    import runpy
    import tempfile
    import types

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # Recomputed from this process's TMPDIR.
    if request["unbuffered"] or os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    if request["faulthandler"] or os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(all_threads=True)
    else:
        faulthandler.disable()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # Its global generator was seeded when the zygote imported it.
    kind, target = request["kind"], request["target"]
    # The zygote removed the entry Python puts first (this file's directory).
    if kind == "script":
        sys.argv = [target, *request["args"]]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        run = lambda: runpy.run_path(target, run_name="__main__")  # noqa: E731
    elif kind == "module":
        sys.argv = ["-m", *request["args"]]  # run_module puts the module's file first
        sys.path.insert(0, os.getcwd())
        run = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        sys.argv = ["-c", *request["args"]]
        sys.path.insert(0, "")
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        run = lambda: exec(compile(target, "<string>", "exec"), main.__dict__)  # noqa: E731
    try:
        run()
    except SystemExit as request_to_exit:
        code = request_to_exit.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)  # As the interpreter prints sys.exit("message").
        return 1
    except KeyboardInterrupt as error:
        _print_uncaught(error)
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # Ends as an interrupted interpreter does.
        time.sleep(1)
        return 130
    except BaseException as error:  # noqa: BLE001  printed as the interpreter prints it
        _print_uncaught(error)
        return 1
    return 0


def _finish(code):
    """Ends the child as the interpreter ends, less the teardown of the modules it shares with the zygote.

    As at any exit, `threading`'s exit hooks run and non-daemon threads are joined,
    then `atexit` functions run; files still open are flushed, and the process
    exits with `code`. Tearing down torch and Keras
    (seconds, and a copy of every page the zygote shared) is skipped.
    """
    import atexit
    import gc
    import io

    # What the interpreter does first at exit: the hooks of `threading._register_atexit`
    # (ThreadPoolExecutor's shutdown), then a join of every non-daemon thread.
    threading._shutdown()
    atexit._run_exitfuncs()
    # Objects made in this process only: the zygote's are frozen out of the collector.
    for obj in gc.get_objects():
        if isinstance(obj, io.IOBase):
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _print_uncaught(error):
    """Prints `error` as the interpreter prints an uncaught exception (through `sys.excepthook`)."""
    traceback = _user_frames(error.__traceback__)
    sys.excepthook(type(error), error.with_traceback(traceback), traceback)


def _user_frames(traceback):
    """`traceback` without its first frames in this file and in runpy (the interpreter shows none)."""
    import runpy

    ours = (__file__, runpy.__file__, "<frozen runpy>")
    while traceback is not None and traceback.tb_frame.f_code.co_filename in ours:
        traceback = traceback.tb_next
    return traceback


if __name__ == "__main__":
    del sys.path[0]  # kdist/launch: its modules must not shadow what the zygote imports.
    sys.exit(_zygote_main(int(sys.argv[1]), [m for m in sys.argv[2].split(",") if m]))
