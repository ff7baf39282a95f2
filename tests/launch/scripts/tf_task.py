"""A task of a local TF_CONFIG cluster: ps tasks serve, the others check the ps and exit.

tf_task.py OUTDIR. A ps task listens on its own address from TF_CONFIG, saves
its TF_CONFIG as OUTDIR/ps-<i>.json and serves until it is stopped. Any other task
connects to every ps address (proving the port is the one that ps bound), saves its
TF_CONFIG and exits 0.
"""

import json
import os
import socket
import sys
import time

CONNECT_DEADLINE_SECONDS = 30.0

config = json.loads(os.environ["TF_CONFIG"])
task_type, task_index = config["task"]["type"], config["task"]["index"]
name = f"{task_type}-{task_index}"


def save():
    with open(os.path.join(sys.argv[1], f"{name}.json"), "w") as file:
        json.dump({"TF_CONFIG": config, "pid": os.getpid()}, file)


def serve():
    host, port = config["cluster"]["ps"][task_index].rsplit(":", 1)
    with socket.create_server((host, int(port))) as server:
        save()
        print("serving", flush=True)
        while True:
            connection, _ = server.accept()
            connection.close()


def connect(address):
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + CONNECT_DEADLINE_SECONDS
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            return
        except OSError:
            # The server may not be listening yet; nothing to wait on but time.
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


if task_type == "ps":
    serve()
for address in config["cluster"].get("ps", []):
    connect(address)
save()
print(f"{name} done")
