"""One process's zygotes shared with the launchers it starts: a broker for `kdist.launch.warm`.

A `kdist launch` started by another program (a test session runs hundreds) would
start its own zygote, importing NumPy, torch and Keras again for every job. A
`Broker` lets such launchers use zygotes the broker's process keeps instead: the
broker puts `KDIST_WARM_BROKER` in the environment its children inherit, and a
`WarmPool` that finds it asks the broker for the zygote of an import-time
environment before starting one of its own. The broker starts that zygote once
(in its own thread) and hands the pool a copy of the zygote's request socket; the
pool then forks from it exactly as from its own zygote.

Only a pool running the broker's own Python (the same interpreter in the same
virtual environment, `warm.same_interpreter`) gets a zygote: a zygote runs the
broker's packages. Who may ask: the broker listens on an abstract Unix socket (no file), and answers
only a peer running as the same user (`SO_PEERCRED`) that presents the random
token from `KDIST_WARM_BROKER`; anything else gets the connection closed. What
stays true of every warm child: it dies when its zygote dies (the broker's process
ending), and its zygote kills it when the pool that asked for it closes its status
socket (the launcher exiting or killed), so no child outlives the launcher that
started it.
"""

import json
import os
import secrets
import socket
import struct
import sys
import threading

from kdist.launch import warm, zygote as _zygote

VARIABLE = warm.BROKER_VARIABLE  # The pool's side, `warm.request_broker_control`, reads it.
# How long the broker waits for a request once connected (a peer that sends nothing is dropped).
REQUEST_SECONDS = 10.0
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Broker:
    """Serves the zygotes of a `WarmPool` it owns to the pools of other processes.

    Start it from the thread that will outlive the processes it serves (usually
    the main thread); it runs its own daemon thread, which owns the zygotes.
    `close()` ends them, and with them every process they forked.
    """

    def __init__(self):
        self._token = secrets.token_hex(16)
        self._address = f"\0kdist-warm-{os.getpid()}-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(self._address)
        self._listener.listen(16)
        self._ready = threading.Event()
        self._pool = None
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kdist-warm-broker", daemon=True)
        self._thread.start()
        self._ready.wait()

    @property
    def value(self):
        """What `KDIST_WARM_BROKER` holds for the processes this broker serves."""
        return json.dumps({"address": self._address[1:], "token": self._token})

    def _serve(self):
        self._pool = warm.WarmPool(use_broker=False)  # Owned by this thread: its zygotes die with it.
        self._ready.set()
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            with connection:
                self._answer(connection)

    def _answer(self, connection):
        ucred = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
        _, uid, _ = _CREDENTIALS.unpack(ucred)
        request = _zygote.receive(connection, REQUEST_SECONDS)
        if uid != os.getuid() or not isinstance(request, dict) or request.get("token") != self._token:
            return  # A stranger: the connection closes unanswered.
        executable = request.get("executable")
        if not isinstance(executable, str) or not warm.same_interpreter(executable, sys.executable):
            # Its zygotes run this process's Python and packages: another's would run the wrong ones.
            _zygote.send(connection, {"error": f"the broker runs {sys.executable}, not {executable!r}"})
            return
        control = self._pool.zygote_control(request.get("env") or {})
        if control is None:
            _zygote.send(connection, {"error": self._pool.unavailable or "no zygote"})
            return
        try:
            socket.send_fds(connection, [b'{"ok": true}'], [control.fileno()])
        except OSError:
            pass

    def close(self):
        """Stops answering and ends the zygotes (and every process they forked that still runs)."""
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=warm.BROKER_ANSWER_SECONDS)
        if self._pool is not None:
            self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False
