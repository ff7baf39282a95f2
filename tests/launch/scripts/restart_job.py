"""One process of a job that `kdist launch --max-restarts` restarts; no Keras, no torch.

restart_job.py OUTDIR FAIL_RANK FAIL_RUNS HOW [--ignore-term]

Every run appends "pid rendezvous" to OUTDIR/runs-<name>.txt (the rendezvous is
MASTER_PORT, or the ports of TF_CONFIG's cluster) and writes OUTDIR/<pid>.pid;
the number of lines before its own is the run's number (0 for the first).
In runs 0 .. FAIL_RUNS-1, the process of rank FAIL_RANK fails once every process
of the run has written its line: HOW is "kill9" (SIGKILL to itself) or "exitN"
(exit code N); the others print "ready" and block until stopped (with
--ignore-term rank 0 ignores SIGTERM, so only SIGKILL ends it). From run
FAIL_RUNS on, every process prints "run R done" and exits 0.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

WAIT_FOR_OTHERS_SECONDS = 60.0


def identity():
    if "RANK" in os.environ:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return f"worker-{rank}", rank, size, os.environ["MASTER_PORT"]
    config = json.loads(os.environ["TF_CONFIG"])
    tasks = [(job, i) for job in sorted(config["cluster"]) for i in range(len(config["cluster"][job]))]
    task = (config["task"]["type"], config["task"]["index"])
    ports = ",".join(address.rsplit(":", 1)[1] for job, i in tasks for address in [config["cluster"][job][i]])
    return f"{task[0]}-{task[1]}", tasks.index(task), len(tasks), ports


def main():
    out, fail_rank, fail_runs, how = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    name, rank, size, rendezvous = identity()
    if "--ignore-term" in sys.argv and rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    runs = out / f"runs-{name}.txt"
    run = len(runs.read_text().splitlines()) if runs.exists() else 0
    (out / f"{os.getpid()}.pid").write_text(str(os.getpid()))
    with runs.open("a") as file:
        file.write(f"{os.getpid()} {rendezvous}\n")
    if run >= fail_runs:
        print(f"run {run} done", flush=True)
        return 0
    if rank != fail_rank:
        print("ready", flush=True)
        time.sleep(3600)
        return 0
    deadline = time.monotonic() + WAIT_FOR_OTHERS_SECONDS
    # Test script: other processes' files have nothing to wait on but polling.
    while sum(len(path.read_text().splitlines()) > run for path in out.glob("runs-*.txt")) < size:
        if time.monotonic() > deadline:
            raise TimeoutError("the other processes of this run did not start")
        time.sleep(0.05)
    print(f"run {run}: failing with {how}", flush=True)
    if how == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    return int(how[len("exit"):])


if __name__ == "__main__":
    sys.exit(main())
