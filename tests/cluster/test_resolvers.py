"""Tests for the resolver interface, rendezvous ranks, SimpleClusterResolver and resolve_cluster."""

import json

import pytest

from kdist.cluster import (
    ClusterResolver,
    ClusterSpec,
    Rendezvous,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    local_cluster_resolver,
    resolve_cluster,
)
from kdist.cluster.resolve import is_local_cluster
from kdist.errors import InvalidArgumentError

SEED_CLUSTER = {
    "chief": ["chief.example.com:2222"],
    "ps": ["ps0.example.com:2222", "ps1.example.com:2222"],
    "worker": [
        "worker0.example.com:2222",
        "worker1.example.com:2222",
        "worker2.example.com:2222",
    ],
}
TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def seed_resolver(task_type, task_id):
    return SimpleClusterResolver(ClusterSpec(SEED_CLUSTER), task_type=task_type, task_id=task_id)


@pytest.mark.parametrize(
    "task_type, task_id, rank",
    [("chief", 0, 0), ("worker", 0, 1), ("worker", 1, 2), ("worker", 2, 3)],
)
def test_seed_cluster_ranks_chief_first_then_workers(task_type, task_id, rank):
    config = {"cluster": SEED_CLUSTER, "task": {"type": task_type, "index": task_id}}
    rendezvous = TFConfigClusterResolver(tf_config=config).rendezvous()
    assert rendezvous == Rendezvous(
        rank=rank,
        world_size=4,
        local_rank=0,
        local_world_size=1,
        master_addr="chief.example.com",
        master_port=2222,
        store_is_external=False,
    )


@pytest.mark.parametrize("task_type, task_id", [("ps", 0), ("ps", 1), ("evaluator", 0)])
def test_ps_and_evaluator_tasks_have_no_rank(task_type, task_id):
    config = {"cluster": SEED_CLUSTER, "task": {"type": task_type, "index": task_id}}
    with pytest.raises(InvalidArgumentError, match="Only chief and worker tasks"):
        TFConfigClusterResolver(tf_config=config).rendezvous()


def test_rendezvous_without_a_task_is_an_error():
    resolver = SimpleClusterResolver(ClusterSpec(SEED_CLUSTER))
    with pytest.raises(InvalidArgumentError, match="no task.*task_type=None"):
        resolver.rendezvous()
    with pytest.raises(InvalidArgumentError, match="no task"):
        TFConfigClusterResolver(tf_config="{}").rendezvous()


def test_local_rank_counts_earlier_tasks_on_the_same_host():
    cluster = {
        "chief": ["hostA:2000"],
        "worker": ["hostA:2001", "hostB:2000", "HOSTA:2002", "hostB:2001"],
    }
    expected = {  # task -> (rank, local_rank, local_world_size)
        ("chief", 0): (0, 0, 3),
        ("worker", 0): (1, 1, 3),
        ("worker", 1): (2, 0, 2),
        ("worker", 2): (3, 2, 3),
        ("worker", 3): (4, 1, 2),
    }
    for (task_type, task_id), (rank, local_rank, local_world_size) in expected.items():
        resolver = SimpleClusterResolver(cluster, task_type=task_type, task_id=task_id)
        rendezvous = resolver.rendezvous()
        assert (rendezvous.rank, rendezvous.local_rank) == (rank, local_rank)
        assert rendezvous.local_world_size == local_world_size
        assert (rendezvous.master_addr, rendezvous.master_port) == ("hostA", 2000)
        assert rendezvous.world_size == 5


def test_local_rank_on_different_hosts_is_zero():
    cluster = {"worker": ["h0:2222", "h1:2222", "h2:2222"]}
    for task_id in range(3):
        resolver = SimpleClusterResolver(cluster, task_type="worker", task_id=task_id)
        rendezvous = resolver.rendezvous()
        assert (rendezvous.rank, rendezvous.local_rank, rendezvous.local_world_size) == (
            task_id,
            0,
            1,
        )


def test_sparse_workers_get_contiguous_ranks():
    cluster = {"chief": ["c:1"], "worker": {1: "w1:1", 4: "w4:1"}}
    resolver = SimpleClusterResolver(cluster, task_type="worker", task_id=4)
    assert (resolver.rendezvous().rank, resolver.rendezvous().world_size) == (2, 3)


def test_ipv6_rendezvous_point_has_no_brackets():
    cluster = {"worker": ["[::1]:2222", "[::1]:2223"]}
    rendezvous = SimpleClusterResolver(cluster, task_type="worker", task_id=1).rendezvous()
    assert (rendezvous.master_addr, rendezvous.master_port) == ("::1", 2222)
    assert (rendezvous.local_rank, rendezvous.local_world_size) == (1, 2)


def test_rendezvous_needs_host_port_addresses():
    resolver = SimpleClusterResolver({"worker": ["w0", "w1:1"]}, task_type="worker", task_id=1)
    with pytest.raises(InvalidArgumentError, match=r'no port\. Received: cluster\["worker"\]\[0\]'):
        resolver.rendezvous()


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"rank": 2}, "rank=2"),
        ({"world_size": 0}, "world_size=0"),
        ({"local_rank": 1}, "local_rank=1"),
        ({"local_world_size": 3}, "local_world_size=3"),
        ({"master_port": 0}, "master_port=0"),
        ({"master_port": 70000}, "master_port=70000"),
        ({"master_addr": ""}, "master_addr=''"),
        ({"rank": True}, "rank=True"),
    ],
)
def test_inconsistent_rendezvous_is_rejected(fields, match):
    values = dict(rank=1, world_size=2, local_rank=0, local_world_size=1)
    values.update(master_addr="h", master_port=1, store_is_external=False)
    values.update(fields)
    with pytest.raises(InvalidArgumentError, match=match):
        Rendezvous(**values)


def test_simple_resolver_returns_what_it_was_given():
    resolver = SimpleClusterResolver(
        ClusterSpec(SEED_CLUSTER),
        master="chief.example.com:2222",
        task_type="worker",
        task_id=1,
        environment="cloud",
        num_accelerators={"GPU": 2},
        rpc_layer="grpc",
    )
    assert resolver.cluster_spec() == ClusterSpec(SEED_CLUSTER)
    assert resolver.master() == "grpc://chief.example.com:2222"
    assert resolver.master("ps", 1, rpc_layer="tcp") == "tcp://ps1.example.com:2222"
    assert resolver.num_accelerators() == {"GPU": 2}
    assert (resolver.task_type, resolver.task_id, resolver.environment) == ("worker", 1, "cloud")
    assert not resolver.is_chief
    assert "task_type='worker'" in repr(resolver)
    with pytest.raises(AttributeError):
        resolver.task_id = 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"task_type": "master", "task_id": 0}, r"task_type='master'.*\['chief', 'ps', 'worker'\]"),
        ({"task_type": "worker", "task_id": 3}, r"task_id=3.*\[0, 1, 2\]"),
        ({"task_type": "worker", "task_id": "1"}, r"task_id='1'"),
        ({"task_type": "worker", "task_id": False}, r"task_id=False"),
        ({"num_accelerators": {"GPU": -1}}, r"num_accelerators="),
        ({"rpc_layer": 3}, r"rpc_layer=3"),
    ],
)
def test_simple_resolver_validates_its_task(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        SimpleClusterResolver(ClusterSpec(SEED_CLUSTER), **kwargs)


def test_default_num_accelerators_counts_local_cuda_devices():
    import torch

    count = torch.cuda.device_count()
    expected = {"GPU": count} if count else {}
    assert SimpleClusterResolver(ClusterSpec({})).num_accelerators() == expected


def test_is_chief_rules():
    assert seed_resolver("chief", 0).is_chief
    assert not seed_resolver("worker", 0).is_chief
    assert SimpleClusterResolver({"worker": ["a:1", "b:1"]}, task_type="worker", task_id=0).is_chief
    assert not SimpleClusterResolver({"worker": ["a:1"]}).is_chief
    assert SimpleClusterResolver(ClusterSpec({})).is_chief


def test_resolve_cluster_prefers_torchrun_over_tf_config(monkeypatch):
    environ = dict(TORCHRUN_ENV, TF_CONFIG=json.dumps({"cluster": SEED_CLUSTER}))
    assert isinstance(resolve_cluster(environ=environ), TorchrunClusterResolver)
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    assert resolve_cluster().rendezvous().rank == 1


def test_resolve_cluster_uses_a_non_empty_tf_config(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    config = {"cluster": SEED_CLUSTER, "task": {"type": "worker", "index": 2}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    resolver = resolve_cluster()
    assert isinstance(resolver, TFConfigClusterResolver)
    assert resolver.rendezvous().rank == 3


@pytest.mark.parametrize("environ", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "{}"}, {"RANK": "0"}])
def test_resolve_cluster_falls_back_to_one_local_process(environ):
    resolver = resolve_cluster(environ=environ)
    assert resolver.is_chief
    assert resolver.rendezvous() == Rendezvous(0, 1, 0, 1, "127.0.0.1", 0, False)
    assert is_local_cluster(resolver)


def test_a_cluster_of_one_named_by_the_environment_is_not_the_local_fallback():
    one_rank = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    one_worker = {
        "TF_CONFIG": json.dumps(
            {"cluster": {"worker": ["127.0.0.1:2222"]}, "task": {"type": "worker", "index": 0}}
        )
    }
    for environ in (one_rank, one_worker):
        assert resolve_cluster(environ=environ).rendezvous().world_size == 1
        assert not is_local_cluster(resolve_cluster(environ=environ))
    assert not is_local_cluster(SimpleClusterResolver({"worker": ["127.0.0.1:2222"]}))
    assert is_local_cluster(local_cluster_resolver())


def test_resolve_cluster_reports_a_malformed_tf_config():
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        resolve_cluster(environ={"TF_CONFIG": "{"})


def test_resolve_cluster_returns_a_given_resolver_and_rejects_other_objects():
    resolver = seed_resolver("worker", 0)
    assert resolve_cluster(resolver, environ=TORCHRUN_ENV) is resolver
    with pytest.raises(InvalidArgumentError, match=r"Received: cluster_resolver=\{"):
        resolve_cluster({"worker": ["a:1"]})


def test_cluster_resolver_is_abstract():
    with pytest.raises(TypeError):
        ClusterResolver()

    class Minimal(ClusterResolver):
        def cluster_spec(self):
            return ClusterSpec({"worker": ["a:1"]})

        def master(self, task_type=None, task_id=None, rpc_layer=None):
            return ""

    minimal = Minimal()
    assert (minimal.task_type, minimal.task_id, minimal.environment) == (None, None, "")
    assert minimal.rpc_layer is None and not minimal.is_chief
