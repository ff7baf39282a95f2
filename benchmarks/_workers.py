"""Worker-process plumbing shared by the multi-process benchmarks.

A driver starts a `WorkerGroup`: `world_size` processes of one command, each
with the torchrun variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` on a free port), one torch
thread (`OMP_NUM_THREADS=1`) and the driver's kdist on `PYTHONPATH`. Each
worker runs `serve(worker)`: it reads one JSON command per line on stdin,
calls the worker's method of that name and answers with one marked JSON line
on stdout. Every wait of the driver has a deadline; when one passes, or a
worker dies, every worker of the group is killed and `WorkerGroupError`
carries the tails of their stderr. Workers are SIGKILLed when the driver
dies (`PR_SET_PDEATHSIG`) and end at EOF on stdin.
"""

import json
import os
import select
import subprocess
import sys
import tempfile
import time

MESSAGE_MARKER = "@@kdist_benchmark "


# ----- worker side --------------------------------------------------------------
def reply(message):
    print(MESSAGE_MARKER + json.dumps(message), flush=True)


def step_durations(step_ends, num_warmup):
    """Seconds per step after the first `num_warmup` steps, from the steps' end times."""
    return [b - a for a, b in zip(step_ends[num_warmup - 1 : -1], step_ends[num_warmup:])]


def serve(worker):
    """Answers the driver's commands until `quit` or EOF (the driver died). `worker` has `rank`."""
    reply({"event": "hello", "rank": worker.rank})
    for line in sys.stdin:
        command = json.loads(line)
        operation = command.pop("op")
        if operation == "quit":
            break
        reply({"event": "done", "rank": worker.rank, **getattr(worker, operation)(**command)})


# ----- driver side ----------------------------------------------------------------
def kdist_root():
    import kdist

    return os.path.dirname(os.path.dirname(os.path.abspath(kdist.__file__)))


class WorkerGroupError(RuntimeError):
    """A worker group failed or missed a deadline; its processes have been killed."""


class WorkerGroup:
    """`world_size` processes running `argv`, forming one process group. Not thread-safe.

    Start groups from the main thread: `PR_SET_PDEATHSIG` fires when the thread
    that started a child ends.
    """

    def __init__(self, name, argv, world_size):
        from kdist.launch.child import make_preexec
        from kdist.launch.ports import free_port

        root = kdist_root()
        self.name = name
        port = free_port()
        self._processes, self._logs, self._buffers = [], [], []
        for rank in range(world_size):
            env = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
            env.update(
                RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS="1", KERAS_BACKEND="torch", PYTHONUNBUFFERED="1",
                # The workers import the kdist the driver imported.
                PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
            )
            log = tempfile.TemporaryFile()
            self._logs.append(log)
            self._buffers.append(b"")
            self._processes.append(
                subprocess.Popen(
                    list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                    preexec_fn=make_preexec(),
                )
            )

    def request(self, timeout, **command):
        """Sends `command` to every rank; returns their replies in rank order."""
        line = (json.dumps(command) + "\n").encode()
        for rank, process in enumerate(self._processes):
            try:
                process.stdin.write(line)
                process.stdin.flush()
            except OSError as error:
                self._fail(f"rank {rank} could not be sent a command ({error})")
        return self.receive(timeout)

    def receive(self, timeout):
        deadline = time.monotonic() + timeout
        return [self._receive_one(rank, deadline) for rank in range(len(self._processes))]

    def _receive_one(self, rank, deadline):
        process = self._processes[rank]
        while True:
            line, newline, rest = self._buffers[rank].partition(b"\n")
            if newline:
                self._buffers[rank] = rest
                text = line.decode(errors="replace")
                if text.startswith(MESSAGE_MARKER):
                    return json.loads(text[len(MESSAGE_MARKER) :])
                continue
            remaining = deadline - time.monotonic()
            ready = select.select([process.stdout], [], [], max(0.0, remaining))[0] if remaining > 0 else []
            if not ready:
                self._fail(f"rank {rank} sent nothing within the deadline")
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:
                self._fail(f"rank {rank} exited with code {process.wait()}")
            self._buffers[rank] += chunk

    def _fail(self, reason):
        self.kill()
        tails = []
        for rank, log in enumerate(self._logs):
            log.seek(0)
            tails.append(f"--- rank {rank} stderr (tail) ---\n{log.read()[-3000:].decode(errors='replace')}")
        raise WorkerGroupError(f"Worker group {self.name}: {reason}; all its workers were killed.\n" + "\n".join(tails))

    def close(self):
        for process in self._processes:
            try:
                process.stdin.write(b'{"op": "quit"}\n')
                process.stdin.close()
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 20
        for process in self._processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self):
        for process in self._processes:
            if process.poll() is None:
                process.kill()
                process.wait()
