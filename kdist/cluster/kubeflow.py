"""`KubeflowTrainerClusterResolver`: a process per node under Kubeflow Trainer v2's `PET_*` variables.

Kubeflow Trainer v2 (a `TrainJob` on the `torch-distributed` runtime) starts
one pod per node and sets, in the trainer container, the arguments of
torchrun as environment variables (torchrun reads `PET_<OPTION>` for its
`--<option>`):

- `PET_NNODES`: the number of nodes (pods), an integer;
- `PET_NPROC_PER_NODE`: processes per node: an integer, or `auto`, `cpu`,
  `gpu`, which torchrun resolves by counting devices;
- `PET_NODE_RANK`: this pod's index (its Job completion index);
- `PET_MASTER_ADDR`, `PET_MASTER_PORT`: where node 0 listens
  (`<trainjob>-node-0-0.<trainjob>`, port 29400).

When the container runs `torchrun train.py` (the runtime's usual command),
torchrun reads these and sets `RANK`, `WORLD_SIZE`, ... in each process it
starts: `TorchrunClusterResolver` applies. When the container runs the
script directly (`python train.py`), nothing but the `PET_*` variables
describes the job, and this resolver maps them, for one process per node
only: rank = `PET_NODE_RANK`, world size = `PET_NNODES`.
"""

import os

from kdist.cluster.address import MAX_PORT
from kdist.cluster.rendezvous import Rendezvous
from kdist.cluster.torchrun import TorchrunClusterResolver, read_host, read_integer, require_all
from kdist.errors import ClusterEnvironmentError

PET_VARIABLES = (
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
)
# Variables a launcher that numbers processes itself sets. With them present,
# PET_NODE_RANK is not this process's rank; refuse instead of guessing.
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_LAUNCHER = "Kubeflow Trainer"


def _run_under_torchrun(variable, value, why):
    return ClusterEnvironmentError(
        f"{why} Received: {variable}={value!r}. Expected PET_NPROC_PER_NODE=1 for a script "
        "started directly (one process per node). Run the script under torchrun (the "
        "TrainJob command `torchrun train.py`), which reads the PET_* variables and starts "
        "PET_NPROC_PER_NODE processes per node, or set the TrainJob's numProcPerNode to 1.",
        variable,
        value,
    )


class KubeflowTrainerClusterResolver(TorchrunClusterResolver):
    """Reads this process's rank from Kubeflow Trainer v2's `PET_*` variables.

    Accepted: all five `PET_*` variables set, `PET_NPROC_PER_NODE=1`, and none
    of `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`. Then this
    process is rank `PET_NODE_RANK` of `PET_NNODES`, alone on its node
    (`local_rank` 0 of 1), and rank 0 opens the rendezvous store at
    `PET_MASTER_ADDR:PET_MASTER_PORT`, the port Trainer exposes on node 0.

    Like torchrun's, this cluster spec lists only rank 0's real address:
    `{"worker": ["PET_MASTER_ADDR:PET_MASTER_PORT", "trainjob-node-1", ...]}`.
    Under torchrun (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` set),
    use `TorchrunClusterResolver`; `resolve_cluster()` prefers it.

    Args:
        environ: a mapping to read the variables from; None reads `os.environ`.

    Raises:
        kdist.errors.ClusterEnvironmentError: a `PET_*` variable is missing
            or malformed (`PET_NNODES` not a positive integer, e.g. torchrun's
            elastic `1:4`; `PET_NODE_RANK` not below `PET_NNODES`; a port out
            of range); `PET_NPROC_PER_NODE` is not 1 (an integer above 1, or
            `auto`/`cpu`/`gpu`: only torchrun can start several processes per
            node); or a torchrun rank variable is also set. The error's
            `variable` and message name the variable and its value.

    Example:

    >>> resolver = KubeflowTrainerClusterResolver({
    ...     "PET_NNODES": "4", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "2",
    ...     "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"})
    >>> resolver.rendezvous().rank, resolver.rendezvous().world_size
    (2, 4)
    """

    _PSEUDO_ADDRESS = "trainjob-node-{index}"

    def __init__(self, environ=None):
        # Not super().__init__(): that reads torchrun's variables, which are unset here.
        environ = os.environ if environ is None else environ
        require_all(environ, PET_VARIABLES, _LAUNCHER, "a TrainJob of the torch runtime sets them.")
        for name in _RANK_VARIABLES:
            if name in environ:
                raise ClusterEnvironmentError(
                    "Both a torchrun rank variable and Kubeflow Trainer's PET_* variables are "
                    f"set, but not all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Received: "
                    f"{name}={environ[name]!r}. Expected either torchrun's complete set (launch "
                    "with torchrun, which reads PET_*) or none of them (one process per node).",
                    name,
                    environ[name],
                )
        num_nodes = read_integer(
            environ, "PET_NNODES", 1, 2**31, "a positive integer (the TrainJob's numNodes)", _LAUNCHER
        )
        per_node = str(environ["PET_NPROC_PER_NODE"]).strip()
        if per_node in ("auto", "cpu", "gpu"):
            raise _run_under_torchrun(
                "PET_NPROC_PER_NODE",
                environ["PET_NPROC_PER_NODE"],
                f"torchrun decides how many processes '{per_node}' means by counting devices; "
                "a script started directly is one process.",
            )
        per_node = read_integer(
            environ, "PET_NPROC_PER_NODE", 1, 2**31, "a positive integer", _LAUNCHER
        )
        if per_node != 1:
            raise _run_under_torchrun(
                "PET_NPROC_PER_NODE",
                environ["PET_NPROC_PER_NODE"],
                f"Each node should run {per_node} processes, but this script was started "
                "directly, as one process.",
            )
        node_rank = read_integer(
            environ,
            "PET_NODE_RANK",
            0,
            num_nodes - 1,
            f"an integer in 0..PET_NNODES-1={num_nodes - 1}",
            _LAUNCHER,
        )
        master_port = read_integer(
            environ, "PET_MASTER_PORT", 1, MAX_PORT, f"a port in 1..{MAX_PORT}", _LAUNCHER
        )
        master_addr = read_host(
            environ, "PET_MASTER_ADDR", "the host name or IP address of node 0", _LAUNCHER
        )
        self._set_rendezvous(
            Rendezvous(
                rank=node_rank,
                world_size=num_nodes,
                local_rank=0,
                local_world_size=1,
                master_addr=master_addr,
                master_port=master_port,
                store_is_external=False,
            )
        )

    @staticmethod
    def is_available(environ=None):
        """Returns True when any `PET_*` variable of Kubeflow Trainer's torch runtime is set.

        Any one suffices, so that an incomplete set is refused by the
        constructor (naming what is missing) rather than ignored.

        Args:
            environ: the mapping to look in; None looks in `os.environ`.

        Example:

        >>> KubeflowTrainerClusterResolver.is_available({"PET_NNODES": "2"})
        True
        """
        environ = os.environ if environ is None else environ
        return any(name in environ for name in PET_VARIABLES)

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """Returns the rendezvous point `"PET_MASTER_ADDR:PET_MASTER_PORT"`.

        Args:
            task_type: unused: the `PET_*` variables only tell where node 0 listens.
            task_id: unused.
            rpc_layer: optional protocol prefix, e.g. `"tcp"`.
        """
        return super().master(task_type, task_id, rpc_layer)

    @property
    def task_id(self):
        """This process's `PET_NODE_RANK`."""
        return self._rendezvous.rank

    def rendezvous(self):
        """Returns the `Rendezvous` the `PET_*` variables describe (rank 0 hosts the store)."""
        return self._rendezvous
