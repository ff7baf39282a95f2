"""Does what the argument for its RANK says: by_rank.py ACTION_FOR_RANK_0 ACTION_FOR_RANK_1 ...

ACTION is "exit:CODE:DELAY" (print, wait DELAY seconds, exit CODE) or "block"
(print "ready", then block in time.sleep until stopped).
"""

import os
import sys
import time

rank = int(os.environ["RANK"])
action = sys.argv[1 + rank].split(":")
if action[0] == "block":
    print("ready", flush=True)
    time.sleep(3600)
code, delay = int(action[1]), float(action[2])
time.sleep(delay)
print(f"rank {rank} exiting with {code}")
sys.exit(code)
