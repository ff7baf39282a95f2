"""Prints one line to each stream, waits DELAY seconds, exits with CODE: exit_code.py CODE DELAY."""

import sys
import time

code, delay = int(sys.argv[1]), float(sys.argv[2])
print("out line")
print("err line", file=sys.stderr)
time.sleep(delay)
print(f"exiting with {code}")
sys.exit(code)
