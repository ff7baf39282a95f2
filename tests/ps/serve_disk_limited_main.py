"""A variable-service server whose files may not grow past a limit, like a full disk.

Usage: python tests/ps/serve_disk_limited_main.py MAX_FILE_BYTES

Sets `RLIMIT_FSIZE` (and ignores `SIGXFSZ`), so a write past the limit fails
for real with `OSError(EFBIG)`, then prints `PORT <n>` and serves with the
cluster secret from `KDIST_SECRET` until the test kills it.
"""

import resource
import signal
import sys

import kdist  # noqa: F401 (chooses the torch backend before Keras is imported)
from kdist.ps import create_server


def main():
    limit = int(sys.argv[1])
    server = create_server()
    # After start-up, so that only the server's own writes meet the limit.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    print(f"PORT {server.port}", flush=True)
    server.wait()


if __name__ == "__main__":
    main()
