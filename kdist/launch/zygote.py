"""The zygote of `kdist.launch.warm`: imports NumPy, torch and Keras once, then forks on request.

Run as a script by `WarmPool` (`python .../zygote.py FD MODULES`), never imported
as part of the `kdist` package in that process: `import kdist` would choose a Keras
backend that a plain child never chose. So this module imports only the standard
library at its top. `kdist.launch.warm` imports its message helpers.

Protocol: requests come on the inherited `SOCK_SEQPACKET` socket FD, one JSON
message each with four file descriptors (the child's status socket, stdin, stdout,
stderr). The zygote answers on the status socket with `{"pid"}` once forked and
`{"returncode"}` once the child ended; the child itself never writes to it.
"""

import json
import os
import selectors
import signal
import socket
import sys
import threading
import time

MAX_MESSAGE = 1 << 20
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def receive(sock, timeout):
    """One JSON message from `sock`, or None at end-of-file or after `timeout` seconds (None: no limit)."""
    sock.settimeout(timeout)
    try:
        data = sock.recv(MAX_MESSAGE)
    except (socket.timeout, OSError):
        return None
    finally:
        sock.settimeout(None)
    return json.loads(data) if data else None


def send(sock, message):
    """Sends one JSON message; a closed peer is ignored (its end-of-file tells it what it needs)."""
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass


def _zygote_main(control_fd, modules):
    control = socket.socket(fileno=control_fd)
    try:
        import importlib

        for name in modules:
            importlib.import_module(name)
    except BaseException as error:  # noqa: BLE001  reported to the pool, which starts cold
        send(control, {"error": f"importing {name} raised {type(error).__name__}: {error}"})
        return 1
    import gc

    # What was imported stays out of the collector's work in every child (which would
    # otherwise copy each page it scans).
    gc.freeze()
    send(control, {"ready": True, "pid": os.getpid()})
    request = _serve(control)
    if request is None:
        return 0
    _finish(_run_child(request))


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
                    send(status, {"error": "a Python thread runs in the zygote; forking is unsafe"})
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
                send(status, {"pid": pid})
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
        send(status, {"returncode": os.waitstatus_to_exitcode(wait_status)})
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
