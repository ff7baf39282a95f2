"""Cluster descriptions and resolvers: which tasks exist and which one this process is.

Glossary (the TensorFlow terms):

- **job**: a named group of tasks with one role: `"chief"`, `"worker"`, `"ps"`
  (parameter server) or `"evaluator"`.
- **task**: one process of a job, named by job and index (`worker:1`) and
  reachable at an address `"host:port"`.
- **chief**: the task that does chief-only work (checkpoints, logs, the
  coordinator in ParameterServerStrategy): the `"chief"` task, or worker 0
  when the cluster has no chief.
- **rank**: a process's position among the processes that train
  synchronously: the chief first, then workers in index order.
- **rendezvous**: the point (rank 0's address) where those processes meet to
  form a `torch.distributed` group; see `Rendezvous`.

This package reads the environment (`TF_CONFIG`, torchrun's variables,
Slurm's `SLURM_*`, Kubeflow Trainer's `PET_*`) and
imports neither Keras nor, except inside `num_accelerators()`, torch.
"""

from kdist.cluster.address import parse_address
from kdist.cluster.hostlist import expand_hostlist
from kdist.cluster.kubeflow import KubeflowTrainerClusterResolver
from kdist.cluster.rendezvous import Rendezvous
from kdist.cluster.resolve import local_cluster_resolver, resolve_cluster
from kdist.cluster.resolvers import ClusterResolver, SimpleClusterResolver
from kdist.cluster.slurm import SlurmClusterResolver
from kdist.cluster.spec import ClusterSpec
from kdist.cluster.tf_config import TFConfigClusterResolver
from kdist.cluster.torchrun import TorchrunClusterResolver

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "KubeflowTrainerClusterResolver",
    "Rendezvous",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "expand_hostlist",
    "local_cluster_resolver",
    "parse_address",
    "resolve_cluster",
]
