"""Several variable-service servers in their own processes, for tests that kill them.

Imports kdist once, then forks one child per server (a fresh interpreter takes
seconds to import Keras and torch). Each child prints `PORT <port> PID <pid>`
and serves until the test kills it; the parent exits when every child is gone.

Usage: python tests/ps/serve_many_main.py <num_servers>
"""

import ctypes
import os
import signal
import sys

import kdist  # noqa: F401 (chooses the torch backend before Keras is imported)
from kdist.ps import ServiceOptions, create_server

PR_SET_PDEATHSIG = 1


def serve():
    # A child outlives nothing: it dies with the parent (which the harness kills).
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    server = create_server(options=ServiceOptions())
    print(f"PORT {server.port} PID {os.getpid()}", flush=True)
    server.wait()


def main():
    children = []
    for _ in range(int(sys.argv[1])):
        pid = os.fork()
        if pid == 0:
            try:
                serve()
            finally:
                os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
