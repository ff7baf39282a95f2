"""Prints "ready", then exits with CODE when it receives SIGUSR1: exit_on_signal.py CODE."""

import signal
import sys
import time

code = int(sys.argv[1])
signal.signal(signal.SIGUSR1, lambda signum, frame: sys.exit(code))
print("ready", flush=True)
time.sleep(3600)
