"""Which resolver `resolve_cluster()` picks when several launchers' variables are set.

The documented order: an explicit resolver, then torchrun's variables (all
four), then a TF_CONFIG with a cluster, then an srun step (SLURM_PROCID and
SLURM_STEP_NODELIST), then Kubeflow Trainer's PET_* variables, then one local
process.
"""

import json

import pytest

from kdist.cluster import (
    KubeflowTrainerClusterResolver,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    resolve_cluster,
)
from kdist.cluster.resolve import is_local_cluster
from kdist.errors import ClusterEnvironmentError

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
TF_CONFIG = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["w0:2222", "w1:2222"]}, "task": {"type": "worker", "index": 1}})}
SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
PET = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "29400"}


@pytest.mark.parametrize(
    "environments, expected",
    [
        ((TORCHRUN, TF_CONFIG, SLURM, PET), TorchrunClusterResolver),
        ((TORCHRUN, SLURM), TorchrunClusterResolver),  # `srun torchrun ...`: torchrun started this process
        ((TORCHRUN, PET), TorchrunClusterResolver),  # a TrainJob running torchrun, as the runtime does
        ((TF_CONFIG, SLURM, PET), TFConfigClusterResolver),
        ((TF_CONFIG, SLURM), TFConfigClusterResolver),
        ((SLURM, PET), SlurmClusterResolver),
        ((SLURM,), SlurmClusterResolver),
        ((PET,), KubeflowTrainerClusterResolver),
    ],
)
def test_precedence(environments, expected):
    environ = {}
    for environment in environments:
        environ.update(environment)
    resolver = resolve_cluster(environ=environ)
    assert type(resolver) is expected
    assert resolver.rendezvous().rank == (5 if expected is TorchrunClusterResolver else 1)


def test_nothing_set_is_one_local_process():
    resolver = resolve_cluster(environ={})
    assert is_local_cluster(resolver) and resolver.rendezvous().world_size == 1


def test_an_empty_tf_config_cluster_gives_way_to_slurm():
    environ = {**SLURM, "TF_CONFIG": json.dumps({"cluster": {}, "task": {}})}
    assert isinstance(resolve_cluster(environ=environ), SlurmClusterResolver)


def test_an_explicit_resolver_wins_over_every_variable():
    explicit = SimpleClusterResolver({"worker": ["a:1"]}, task_type="worker", task_id=0)
    environ = {**TORCHRUN, **TF_CONFIG, **SLURM, **PET}
    assert resolve_cluster(explicit, environ=environ) is explicit


def test_a_partial_torchrun_environment_with_pet_is_refused():
    # RANK without MASTER_ADDR/MASTER_PORT is no torchrun launch; PET_NODE_RANK may not be this rank.
    with pytest.raises(ClusterEnvironmentError) as raised:
        resolve_cluster(environ={**PET, "RANK": "3"})
    assert raised.value.variable == "RANK"


def test_an_incomplete_pet_environment_is_refused_not_ignored():
    with pytest.raises(ClusterEnvironmentError) as raised:
        resolve_cluster(environ={"PET_NNODES": "2"})
    assert (raised.value.variable, raised.value.value) == ("PET_NPROC_PER_NODE", None)
