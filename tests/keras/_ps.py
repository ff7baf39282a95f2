"""Parameter-server clusters for tests: real servers, in this process or in their own.

```python
with _ps.server_processes(2) as cluster:          # two `kdist server` processes
    strategy = kdist.ParameterServerStrategy(cluster.resolver())
    ...
    cluster.clients()[0].stats()
```
"""

import contextlib
import dataclasses
import json
import sys

import kdist  # noqa: F401  (sets KERAS_BACKEND before keras is imported)
from kdist.cluster import SimpleClusterResolver
from kdist.ps import VariableClient, create_server
from tests import harness

SERVER_START_TIMEOUT = 60.0


@dataclasses.dataclass
class Cluster:
    """A cluster whose `ps` tasks are serving; workers are whoever asks for a resolver."""

    spec: dict

    def resolver(self, task_type="worker", task_id=0):
        return SimpleClusterResolver(self.spec, task_type=task_type, task_id=task_id)

    def clients(self):
        return [VariableClient(address) for address in self.spec["ps"]]

    def stats(self):
        clients = self.clients()
        try:
            return [client.stats() for client in clients]
        finally:
            for client in clients:
                client.close()


def _spec(ps_addresses, num_workers, chief=False):
    ports = harness.free_ports(num_workers + int(chief))
    spec = {"worker": [f"127.0.0.1:{port}" for port in ports[:num_workers]], "ps": list(ps_addresses)}
    if chief:
        spec["chief"] = [f"127.0.0.1:{ports[-1]}"]
    return spec


@contextlib.contextmanager
def in_process_servers(num_ps, num_workers=1, **server_kwargs):
    """`num_ps` variable servers on loopback ports inside this process."""
    servers = [create_server("127.0.0.1:0", **server_kwargs) for _ in range(num_ps)]
    try:
        yield Cluster(_spec([server.address for server in servers], num_workers))
    finally:
        for server in servers:
            server.stop(None)


@contextlib.contextmanager
def server_processes(num_ps, num_workers=1, chief=False, tmp_path=None, extra_args=()):
    """`num_ps` `kdist server` processes; yields the `Cluster` once every one serves."""
    ports = harness.free_ports(num_ps)
    spec = _spec([f"127.0.0.1:{port}" for port in ports], num_workers, chief)
    cluster_file = (tmp_path / "cluster.json") if tmp_path is not None else None
    if cluster_file is None:
        import tempfile

        cluster_file = __import__("pathlib").Path(tempfile.mkdtemp()) / "cluster.json"
    cluster_file.write_text(json.dumps(spec))
    specs = [
        harness.ProcessSpec(
            f"ps-{index}",
            (sys.executable, "-m", "kdist", "server", "--job", "ps", "--index", str(index), "--cluster", str(cluster_file), *extra_args),
            {},
            daemon=True,
        )
        for index in range(num_ps)
    ]
    with harness.start(specs) as processes:
        cluster = Cluster(spec)
        for client in cluster.clients():
            client.wait_until_ready(SERVER_START_TIMEOUT)
            client.close()
        yield cluster
