"""Tests for kdist.cluster.torchrun: reading torchrun's environment variables."""

import pytest

from kdist.cluster import ClusterSpec, Rendezvous, TorchrunClusterResolver
from kdist.errors import InvalidArgumentError
from tests.cluster import _launcher_env

TORCHRUN_ENV = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "node0.example.com",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


def environ_with(**changes):
    return _launcher_env.changed(TORCHRUN_ENV, **changes)


def test_reads_the_torchrun_variables():
    resolver = TorchrunClusterResolver(TORCHRUN_ENV)
    assert resolver.rendezvous() == Rendezvous(
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        master_addr="node0.example.com",
        master_port=29500,
        store_is_external=True,
    )
    assert (resolver.task_type, resolver.task_id, resolver.is_chief) == ("worker", 5, False)
    assert resolver.master() == "node0.example.com:29500"
    assert resolver.master(rpc_layer="tcp") == "tcp://node0.example.com:29500"
    assert resolver.environment == "" and resolver.rpc_layer is None


def test_cluster_spec_has_pseudo_addresses_except_rank_zero():
    spec = TorchrunClusterResolver(environ_with(WORLD_SIZE="3", RANK="0", LOCAL_WORLD_SIZE="3"))
    assert spec.cluster_spec() == ClusterSpec(
        {"worker": ["node0.example.com:29500", "torchrun-rank-1", "torchrun-rank-2"]}
    )
    assert spec.is_chief


def test_reads_os_environ_once(monkeypatch):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    assert TorchrunClusterResolver.is_available()
    resolver = TorchrunClusterResolver()
    monkeypatch.setenv("RANK", "6")
    assert resolver.task_id == 5


def test_store_is_external_only_for_the_exact_string_true():
    for value, expected in (("True", True), ("true", False), ("1", False), (None, False)):
        environ = environ_with(TORCHELASTIC_USE_AGENT_STORE=value)
        assert TorchrunClusterResolver(environ).rendezvous().store_is_external is expected


def test_each_torchrun_restart_is_its_own_attempt():
    # torchrun keeps its store across restarts: kdist's keys are scoped by the attempt.
    assert TorchrunClusterResolver(environ_with()).rendezvous().attempt == 0
    restarted = environ_with(TORCHELASTIC_RESTART_COUNT="2")
    assert TorchrunClusterResolver(restarted).rendezvous().attempt == 2


def test_local_defaults_when_launched_without_torchrun():
    environ = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    rendezvous = TorchrunClusterResolver(environ).rendezvous()
    assert (rendezvous.local_rank, rendezvous.local_world_size) == (2, 3)
    assert rendezvous.store_is_external is False
    environ["LOCAL_WORLD_SIZE"] = "2"
    assert TorchrunClusterResolver(environ).rendezvous().local_rank == 0


def test_ipv6_master_addr_is_bracketed_in_addresses():
    resolver = TorchrunClusterResolver(environ_with(MASTER_ADDR="::1"))
    assert resolver.master() == "[::1]:29500"
    assert resolver.rendezvous().master_addr == "::1"


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"RANK": None}, r"Received: RANK unset"),
        ({"MASTER_PORT": None}, r"Received: MASTER_PORT unset"),
        ({"RANK": "8"}, r"Received: RANK='8'.*0\.\.WORLD_SIZE-1=7"),
        ({"RANK": "-1"}, r"Received: RANK='-1'"),
        ({"RANK": "one"}, r"Received: RANK='one'"),
        ({"WORLD_SIZE": "0"}, r"Received: WORLD_SIZE='0'"),
        ({"WORLD_SIZE": "2.0"}, r"Received: WORLD_SIZE='2.0'"),
        ({"LOCAL_WORLD_SIZE": "9"}, r"Received: LOCAL_WORLD_SIZE='9'"),
        ({"LOCAL_RANK": "4"}, r"Received: LOCAL_RANK='4'.*LOCAL_WORLD_SIZE-1=3"),
        ({"MASTER_PORT": "65536"}, r"Received: MASTER_PORT='65536'"),
        ({"MASTER_PORT": "0"}, r"Received: MASTER_PORT='0'"),
        ({"MASTER_PORT": "http"}, r"Received: MASTER_PORT='http'"),
        ({"MASTER_ADDR": ""}, r"Received: MASTER_ADDR=''"),
        ({"TORCHELASTIC_RESTART_COUNT": "-1"}, r"Received: TORCHELASTIC_RESTART_COUNT='-1'"),
    ],
    ids=lambda value: str(value) if isinstance(value, dict) else None,
)
def test_malformed_variables_are_named(changes, match):
    with pytest.raises(InvalidArgumentError, match=match):
        TorchrunClusterResolver(environ_with(**changes))


@pytest.mark.parametrize(
    "environ, expected",
    [
        (TORCHRUN_ENV, True),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, True),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h"}, False),
        ({"LOCAL_RANK": "0"}, False),
        ({}, False),
    ],
)
def test_is_available(environ, expected):
    assert TorchrunClusterResolver.is_available(environ) is expected
