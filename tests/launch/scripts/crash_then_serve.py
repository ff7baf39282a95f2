"""Fails its first CRASHES runs, then serves: a worker for the restart tests.

crash_then_serve.py COUNTER_FILE CRASHES HOW. Each run appends its start time
(time.monotonic()) to COUNTER_FILE and prints "start N". Runs 1..CRASHES then
end: HOW "kill" kills the process with SIGKILL, a number exits with it. Later
runs print "ready" and sleep until they are stopped.
"""

import os
import signal
import sys
import time

counter_file, crashes, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(counter_file, "a") as file:
    file.write(f"{time.monotonic()}\n")
with open(counter_file) as file:
    run = len(file.read().splitlines())
print(f"start {run}", flush=True)
if run <= crashes:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(how))
print("ready", flush=True)
time.sleep(3600)
