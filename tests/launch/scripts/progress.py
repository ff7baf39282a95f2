"""Writes its arguments to stdout one at a time, waiting for SIGUSR1 between two.

progress.py SEGMENT...  -- each SEGMENT is unicode-escaped ("\\r50%"); an empty
                           one writes nothing (a child that waits first).

No newline is added, so a test can check what the parent shows of a line before
its end arrives. SIGUSR1 is blocked before "ready" goes to stderr and before the
first write, so a signal the test sends after seeing either cannot be lost; each
wait gives up after WAIT_SECONDS with exit code 3.
"""

import signal
import sys

WAIT_SECONDS = 60

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
print("ready", file=sys.stderr, flush=True)
segments = [argument.encode().decode("unicode_escape") for argument in sys.argv[1:]]
for index, segment in enumerate(segments):
    if index and signal.sigtimedwait({signal.SIGUSR1}, WAIT_SECONDS) is None:
        sys.exit(3)
    sys.stdout.write(segment)
    sys.stdout.flush()
