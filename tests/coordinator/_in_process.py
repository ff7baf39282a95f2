"""TensorFlow's in-process cluster for tests: kdist servers in the test process, a resolver naming no task."""

import contextlib

import kdist
from kdist.cluster import ClusterSpec, SimpleClusterResolver
from kdist.launch.ports import free_ports


@contextlib.contextmanager
def cluster(num_workers=1, num_ps=1):
    """Yields `(resolver, strategy)`; stops the servers and the coordinator afterwards."""
    ports = free_ports(num_workers + num_ps)
    spec = ClusterSpec({
        "worker": [f"127.0.0.1:{port}" for port in ports[:num_workers]],
        "ps": [f"127.0.0.1:{port}" for port in ports[num_workers:]],
    })
    servers = [kdist.distribute.Server(spec, "worker", index) for index in range(num_workers)]
    servers += [kdist.distribute.Server(spec, "ps", index) for index in range(num_ps)]
    resolver = SimpleClusterResolver(spec, rpc_layer="grpc")
    strategy = kdist.ParameterServerStrategy(resolver)
    try:
        yield resolver, strategy
    finally:
        coordinator = strategy.extended.cluster_coordinator
        if coordinator is not None:
            coordinator.shutdown()
        for server in servers:
            server.stop(0)
