"""Tests for kdist.cluster.kubeflow: Kubeflow Trainer v2's PET_* variables, and real processes under them."""

import pytest

from kdist.cluster import ClusterSpec, KubeflowTrainerClusterResolver, Rendezvous, TorchrunClusterResolver
from kdist.errors import ClusterEnvironmentError, InvalidArgumentError
from tests import harness
from tests.cluster import _launcher_env

# What a TrainJob "job" of the torch runtime with numNodes: 3, numProcPerNode: 1 sets in pod 1.
TRAINJOB = {
    "PET_NNODES": "3",
    "PET_NPROC_PER_NODE": "1",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "job-node-0-0.job",
    "PET_MASTER_PORT": "29400",
}


def trainjob(**changes):
    return _launcher_env.changed(TRAINJOB, **changes)


def test_one_process_per_node_is_rank_node_rank():
    resolver = KubeflowTrainerClusterResolver(TRAINJOB)
    assert resolver.rendezvous() == Rendezvous(
        rank=1, world_size=3, local_rank=0, local_world_size=1,
        master_addr="job-node-0-0.job", master_port=29400, store_is_external=False,
    )
    assert (resolver.task_type, resolver.task_id, resolver.is_chief) == ("worker", 1, False)
    assert resolver.master() == "job-node-0-0.job:29400"
    assert resolver.master(rpc_layer="tcp") == "tcp://job-node-0-0.job:29400"
    assert resolver.cluster_spec() == ClusterSpec(
        {"worker": ["job-node-0-0.job:29400", "trainjob-node-1", "trainjob-node-2"]}
    )
    assert KubeflowTrainerClusterResolver(trainjob(PET_NODE_RANK="0")).is_chief
    # The TensorFlow backend refuses torchrun-style resolvers (they name only the rendezvous).
    assert isinstance(resolver, TorchrunClusterResolver)


def test_is_available_when_any_pet_variable_is_set():
    assert KubeflowTrainerClusterResolver.is_available(TRAINJOB)
    assert KubeflowTrainerClusterResolver.is_available({"PET_MASTER_PORT": "29400"})
    assert not KubeflowTrainerClusterResolver.is_available({"PET_OTHER": "1", "RANK": "0"})


# Ids that are not "gpu": the conftest skips tests with a "gpu" keyword on machines without CUDA.
@pytest.mark.parametrize("value", ["2", "8", "auto", "gpu", "cpu"], ids=lambda value: f"nproc_{value}")
def test_several_processes_per_node_need_torchrun(value):
    with pytest.raises(ClusterEnvironmentError, match="under torchrun") as raised:
        KubeflowTrainerClusterResolver(trainjob(PET_NPROC_PER_NODE=value))
    assert (raised.value.variable, raised.value.value) == ("PET_NPROC_PER_NODE", value)
    assert f"PET_NPROC_PER_NODE={value!r}" in str(raised.value)


@pytest.mark.parametrize(
    "changes, variable, value",
    [
        ({"PET_NODE_RANK": "3"}, "PET_NODE_RANK", "3"),  # not below PET_NNODES
        ({"PET_NODE_RANK": "-1"}, "PET_NODE_RANK", "-1"),
        ({"PET_NODE_RANK": "one"}, "PET_NODE_RANK", "one"),
        ({"PET_NNODES": "0"}, "PET_NNODES", "0"),
        ({"PET_NNODES": "1:4"}, "PET_NNODES", "1:4"),  # torchrun's elastic range
        ({"PET_NPROC_PER_NODE": "0"}, "PET_NPROC_PER_NODE", "0"),
        ({"PET_NPROC_PER_NODE": "one"}, "PET_NPROC_PER_NODE", "one"),
        ({"PET_MASTER_PORT": "70000"}, "PET_MASTER_PORT", "70000"),
        ({"PET_MASTER_PORT": "http"}, "PET_MASTER_PORT", "http"),
        ({"PET_MASTER_ADDR": " "}, "PET_MASTER_ADDR", " "),
        ({"PET_MASTER_ADDR": "a b"}, "PET_MASTER_ADDR", "a b"),
        ({"PET_NODE_RANK": None}, "PET_NODE_RANK", None),
        ({"PET_MASTER_ADDR": None}, "PET_MASTER_ADDR", None),
        ({"RANK": "4"}, "RANK", "4"),  # a partial torchrun environment: whose rank is it?
        ({"LOCAL_RANK": "0"}, "LOCAL_RANK", "0"),
        ({"WORLD_SIZE": "3"}, "WORLD_SIZE", "3"),
    ],
)
def test_bad_or_inconsistent_variables_name_the_variable_and_value(changes, variable, value):
    with pytest.raises(ClusterEnvironmentError) as raised:
        KubeflowTrainerClusterResolver(trainjob(**changes))
    assert (raised.value.variable, raised.value.value) == (variable, value)
    assert variable in str(raised.value)
    if value is not None:
        assert repr(value) in str(raised.value)
    assert isinstance(raised.value, InvalidArgumentError)


def test_reads_the_environment_once(monkeypatch):
    for name, value in TRAINJOB.items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    resolver = KubeflowTrainerClusterResolver()
    monkeypatch.setenv("PET_NODE_RANK", "2")
    assert resolver.task_id == 1


def test_trainjob_pods_train_as_one_job_with_a_no_argument_strategy():
    port = str(harness.free_port("127.0.0.1"))
    envs = [
        (f"node-{rank}", {
            "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port,
        })
        for rank in range(2)
    ]
    reports = _launcher_env.run_worker(envs + [("alone", {})])
    reference = reports.pop("alone")
    assert reference[1:5] == (0, 1, "worker:0", 1.0)  # negative control: no launcher, no group
    assert {name: report[:5] for name, report in reports.items()} == {
        "node-0": ("KubeflowTrainerClusterResolver", 0, 2, "worker:0", 3.0),
        "node-1": ("KubeflowTrainerClusterResolver", 1, 2, "worker:1", 3.0),
    }
    _launcher_env.assert_same_weights(reports, reference)
