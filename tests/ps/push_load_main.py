"""Many worker processes on one host pushing to one parameter server at once, for tests.

Usage: python tests/ps/push_load_main.py ADDRESS TOKEN NUM_WORKERS PUSHES SIZE

Starts NUM_WORKERS worker processes (forked from this one after it imported
kdist, so that 32 of them do not each pay Keras' and torch's import on a
2-core machine; no gRPC object exists before the fork). Each worker opens its
own `VariableClient` (its own connection), waits until every worker is
connected, then sends PUSHES pushes of `SIZE` float32 values `worker + 1` to
the variable "w", each push twice with one update id (a push retried after
an unknown outcome). Prints `WORKER <index> OK` per worker, then `ALL OK`;
exits 1 if any worker failed (its error on stderr).
"""

import os
import sys
import traceback

import numpy as np

import kdist  # noqa: F401 (chooses the torch backend before Keras is imported)
from kdist.ps import DenseGradient, Security, ServiceOptions, VariableClient

OPTIONS = ServiceOptions(chunk_bytes=1000, rpc_timeout_seconds=45, connect_timeout_seconds=30)


def worker(index, address, token, pushes, size, ready_write, go_read):
    with VariableClient(address, options=OPTIONS, security=Security(token=token)) as client:
        client.wait_until_ready(timeout=30)
        os.write(ready_write, b"r")
        os.close(ready_write)  # the launcher sees EOF once every worker wrote or died
        if os.read(go_read, 1) != b"g":  # every worker is connected: push together
            raise RuntimeError("the launcher ended before the start signal")
        gradient = [DenseGradient("w", np.full(size, index + 1, "float32"))]
        for step in range(pushes):
            update_id = f"worker-{index}/step-{step}"
            client.push(gradient, update_id=update_id)
            client.push(gradient, update_id=update_id)  # the retry: applied once
    print(f"WORKER {index} OK", flush=True)


def main():
    address, token = sys.argv[1], sys.argv[2]
    num_workers, pushes, size = (int(value) for value in sys.argv[3:6])
    ready_read, ready_write = os.pipe()
    go_read, go_write = os.pipe()
    pids = []
    for index in range(num_workers):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(ready_read)
                os.close(go_write)
                worker(index, address, token, pushes, size, ready_write, go_read)
            except BaseException:  # reported, and the worker's exit code says so
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    os.close(ready_write)
    os.close(go_read)
    connected = 0
    while connected < num_workers:
        data = os.read(ready_read, num_workers)
        if not data:
            break  # every worker ended: some failed before connecting
        connected += len(data)
    if connected == num_workers:
        os.write(go_write, b"g" * num_workers)
    os.close(go_write)
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    if failed:
        print(f"{failed} of {num_workers} workers failed", file=sys.stderr, flush=True)
        sys.exit(1)
    print("ALL OK", flush=True)


if __name__ == "__main__":
    main()
