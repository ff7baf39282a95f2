"""Writes its pid to PIDDIR/<pid>.pid (unless PIDDIR is "-"), prints "ready", then blocks.

block.py PIDDIR sleep    -- blocks in time.sleep
block.py PIDDIR socket   -- blocks in socket.accept on a listening socket
"""

import os
import socket
import sys
import time


def wait_in_sleep():
    time.sleep(3600)


def wait_in_accept():
    with socket.create_server(("127.0.0.1", 0)) as server:
        print("ready", flush=True)
        server.accept()


pid_dir, how = sys.argv[1], sys.argv[2]
if pid_dir != "-":
    with open(os.path.join(pid_dir, f"{os.getpid()}.pid"), "w") as file:
        file.write(str(os.getpid()))
if how == "socket":
    wait_in_accept()
else:
    print("ready", flush=True)
    wait_in_sleep()
