"""Coordinator clusters for tests: `kdist server` processes for every ps and worker.

```python
with _cluster.start(num_workers=2, num_ps=1, tmp_path=tmp_path) as cluster:
    strategy = kdist.ParameterServerStrategy(cluster.resolver())
    coordinator = kdist.coordinator.ClusterCoordinator(strategy)
    ...
    cluster.kill("worker", 1)        # SIGKILL
    cluster.restart("worker", 1)     # a new process on the same port
```

Each task is a process set of its own, so killing one does not stop the
others. Every process's output is printed (prefixed) when the test fails.
"""

import contextlib
import json
import signal
import sys

import pytest

import kdist  # noqa: F401  (sets KERAS_BACKEND before keras is imported)
from kdist.cluster import SimpleClusterResolver
from kdist.ps import VariableClient
from tests import harness

START_TIMEOUT = 90.0


class Cluster:
    """A chief-less cluster description plus the processes serving its ps and worker tasks."""

    def __init__(self, spec, cluster_file, token_file):
        self.spec = spec
        self.cluster_file = cluster_file
        self.token_file = token_file
        self._processes = {}
        self._generation = {}
        self._all = []

    def resolver(self):
        return SimpleClusterResolver(self.spec, task_type="chief", task_id=0)

    def start_task(self, job, index, wait=True):
        generation = self._generation.get((job, index), -1) + 1
        self._generation[(job, index)] = generation
        name = f"{job}-{index}" + (f"-restart{generation}" if generation else "")
        command = [sys.executable, "-m", "kdist", "server", "--job", job, "--index", str(index),
                   "--cluster", str(self.cluster_file), "--grace", "1"]
        if self.token_file is not None:
            command += ["--token-file", str(self.token_file)]
        processes = harness.start([harness.ProcessSpec(name, tuple(command), {}, daemon=True)], echo=False)
        self._processes[(job, index)] = (name, processes)
        self._all.append(processes)
        if wait and not processes.wait_for_output(name, "serving", timeout=START_TIMEOUT):
            pytest.fail(f"{name} did not start serving:\n{harness.format_outputs(processes)}", pytrace=False)
        return processes

    def kill(self, job, index):
        name, processes = self._processes[(job, index)]
        processes.send_signal(name, signal.SIGKILL)
        processes.wait_for_exit(name, timeout=30)

    def restart(self, job, index):
        return self.start_task(job, index)

    def ps_stats(self):
        clients = [VariableClient(address) for address in self.spec["ps"]]
        try:
            return [client.stats() for client in clients]
        finally:
            for client in clients:
                client.close()

    def outputs(self):
        return "\n".join(harness.format_outputs(processes) for processes in self._all)

    def close(self):
        for processes in self._all:
            processes.kill_all()
            processes.__exit__(None, None, None)


@contextlib.contextmanager
def start(num_workers, num_ps=1, tmp_path=None, token=None, evaluator=False):
    ports = harness.free_ports(num_workers + num_ps + 2)
    spec = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "worker": [f"127.0.0.1:{port}" for port in ports[1:1 + num_workers]],
        "ps": [f"127.0.0.1:{port}" for port in ports[1 + num_workers:1 + num_workers + num_ps]],
    }
    if evaluator:
        spec["evaluator"] = [f"127.0.0.1:{ports[-1]}"]
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(spec))
    token_file = None
    if token is not None:
        token_file = tmp_path / "token"
        token_file.write_text(token)
    cluster = Cluster(spec, cluster_file, token_file)
    try:
        for index in range(num_ps):
            cluster.start_task("ps", index, wait=False)
        for index in range(num_workers):
            cluster.start_task("worker", index, wait=False)
        for (job, index), (name, processes) in list(cluster._processes.items()):
            if not processes.wait_for_output(name, "serving", timeout=START_TIMEOUT):
                pytest.fail(f"{name} did not start serving:\n{cluster.outputs()}", pytrace=False)
        yield cluster
    except BaseException:
        print(cluster.outputs())
        raise
    finally:
        cluster.close()
