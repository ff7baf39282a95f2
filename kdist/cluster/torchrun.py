"""`TorchrunClusterResolver`: the cluster torchrun describes in environment variables.

torchrun (and `torch.distributed.launch`) starts one process per rank and sets
`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
`MASTER_PORT`. Every rank is a `"worker"` task; rank 0 is the chief. torchrun's
agent already hosts the TCPStore when it sets
`TORCHELASTIC_USE_AGENT_STORE=True`.
"""

import os
import re

from kdist.cluster.address import MAX_PORT, format_address
from kdist.cluster.rendezvous import Rendezvous
from kdist.cluster.resolvers import ClusterResolver, format_master_url
from kdist.cluster.spec import ClusterSpec
from kdist.errors import ClusterEnvironmentError
from kdist.types import TaskType

REQUIRED_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_INTEGER_PATTERN = re.compile(r"[0-9]+")
# torch itself compares the variable with str(True); "true" or "1" do not count.
_AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"
# Set by torchrun's agent: 0 at the first start, then one more per restart.
_RESTART_COUNT_VARIABLE = "TORCHELASTIC_RESTART_COUNT"


def require_all(environ, names, launcher, how):
    """Raises `ClusterEnvironmentError` naming the first of `names` unset in `environ`.

    Args:
        environ: the environment (read only).
        names: the variables the launcher always sets, in order.
        launcher: its name in the message, e.g. `"torchrun"`.
        how: the sentence's ending: how the variables get set.
    """
    for name in names:
        if name not in environ:
            raise ClusterEnvironmentError(
                f"A {launcher} environment variable is missing. Received: {name} unset "
                f"(set: {[key for key in names if key in environ]}). Expected all of "
                f"{list(names)}; {how}",
                name,
                None,
            )


def read_integer(environ, name, lowest, highest, expected, launcher="torchrun"):
    """Returns environment variable `name` as an int in `lowest..highest`.

    Raises:
        kdist.errors.ClusterEnvironmentError: `name` is unset, not a decimal
            integer, or out of range; the message names `launcher`, `name`,
            its value and `expected`.
    """
    if name not in environ:
        raise ClusterEnvironmentError(
            f"A {launcher} environment variable is missing. Received: {name} unset. "
            f"Expected {expected}.",
            name,
            None,
        )
    text = str(environ[name])
    value = int(text.strip()) if _INTEGER_PATTERN.fullmatch(text.strip()) else None
    if value is None or not lowest <= value <= highest:
        raise ClusterEnvironmentError(
            f"Malformed {launcher} environment variable. Received: {name}={text!r}. "
            f"Expected {expected}.",
            name,
            text,
        )
    return value


def read_host(environ, name, expected, launcher="torchrun"):
    """Returns environment variable `name` as a host name (IPv6 without brackets).

    Raises:
        kdist.errors.ClusterEnvironmentError: `name` is unset, empty or holds whitespace.
    """
    text = environ.get(name)
    host = None if text is None else str(text).strip()
    if not host or any(character.isspace() for character in host):
        problem = "missing" if text is None else "malformed"
        raise ClusterEnvironmentError(
            f"A {launcher} environment variable is {problem}. "
            f"Received: {name}={text!r}. Expected {expected}.",
            name,
            text,
        )
    return host.strip("[]")


class TorchrunClusterResolver(ClusterResolver):
    """Reads this process's rank and rendezvous point from the torchrun environment.

    The variables are read and validated once, at construction. torchrun does
    not tell a process where the other ranks listen, so `cluster_spec()` holds
    pseudo-addresses: `{"worker": ["MASTER_ADDR:MASTER_PORT",
    "torchrun-rank-1", ...]}`. Only worker 0's entry is a real endpoint (the
    rendezvous point); do not dial the others.

    Defaults when a variable is absent: `LOCAL_WORLD_SIZE` = `WORLD_SIZE` (all
    ranks on this host, as a single-node launch without torchrun usually
    means), `LOCAL_RANK` = `RANK % LOCAL_WORLD_SIZE` (torchrun numbers ranks
    host by host).

    Args:
        environ: a mapping to read the variables from; None reads `os.environ`.

    Raises:
        kdist.errors.ClusterEnvironmentError: a variable is missing or
            malformed (an `InvalidArgumentError`); the message and its
            `variable` name it (e.g. `RANK` not below `WORLD_SIZE`, a
            non-integer, `MASTER_PORT` out of range).

    Example:

    >>> resolver = TorchrunClusterResolver({"RANK": "1", "WORLD_SIZE": "2",
    ...     "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    >>> resolver.task_type, resolver.task_id, resolver.is_chief
    ('worker', 1, False)
    """

    # What `cluster_spec()` lists for rank i >= 1: nobody dials these.
    _PSEUDO_ADDRESS = "torchrun-rank-{index}"

    def __init__(self, environ=None):
        environ = os.environ if environ is None else environ
        require_all(environ, REQUIRED_VARIABLES, "torchrun", "launch with torchrun or set them yourself.")
        world_size = read_integer(environ, "WORLD_SIZE", 1, 2**31, "a positive integer")
        rank = read_integer(
            environ, "RANK", 0, world_size - 1, f"an integer in 0..WORLD_SIZE-1={world_size - 1}"
        )
        if "LOCAL_WORLD_SIZE" in environ:
            local_world_size = read_integer(
                environ,
                "LOCAL_WORLD_SIZE",
                1,
                world_size,
                f"an integer in 1..WORLD_SIZE={world_size}",
            )
        else:
            local_world_size = world_size
        if "LOCAL_RANK" in environ:
            local_rank = read_integer(
                environ,
                "LOCAL_RANK",
                0,
                local_world_size - 1,
                f"an integer in 0..LOCAL_WORLD_SIZE-1={local_world_size - 1}",
            )
        else:
            local_rank = rank % local_world_size
        master_port = read_integer(environ, "MASTER_PORT", 1, MAX_PORT, f"a port in 1..{MAX_PORT}")
        master_addr = read_host(environ, "MASTER_ADDR", "the host name or IP address of rank 0")
        self._set_rendezvous(
            Rendezvous(
                rank=rank,
                world_size=world_size,
                local_rank=local_rank,
                local_world_size=local_world_size,
                master_addr=master_addr,
                master_port=master_port,
                store_is_external=environ.get(_AGENT_STORE_VARIABLE) == str(True),
                attempt=read_integer(environ, _RESTART_COUNT_VARIABLE, 0, 2**31,
                                     "a restart count >= 0")
                if _RESTART_COUNT_VARIABLE in environ else 0,
            )
        )

    def _set_rendezvous(self, rendezvous):
        """Records the validated `rendezvous` and the cluster spec it implies."""
        self._rendezvous = rendezvous
        self._master_address = format_address(rendezvous.master_addr, rendezvous.master_port)
        self._cluster_spec = ClusterSpec(
            {
                TaskType.WORKER.value: [self._master_address]
                + [
                    self._PSEUDO_ADDRESS.format(index=index)
                    for index in range(1, rendezvous.world_size)
                ]
            }
        )

    @staticmethod
    def is_available(environ=None):
        """Returns True when `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` are set.

        Args:
            environ: the mapping to look in; None looks in `os.environ`.

        Example:

        >>> TorchrunClusterResolver.is_available({"RANK": "0"})
        False
        """
        environ = os.environ if environ is None else environ
        return all(name in environ for name in REQUIRED_VARIABLES)

    def cluster_spec(self):
        """Returns `{"worker": [...]}` with one entry per rank (pseudo-addresses but rank 0)."""
        return self._cluster_spec

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """Returns the rendezvous point `"MASTER_ADDR:MASTER_PORT"`.

        Args:
            task_type: unused: torchrun only tells where rank 0 listens.
            task_id: unused.
            rpc_layer: optional protocol prefix, e.g. `"tcp"`.
        """
        del task_type, task_id
        return format_master_url(self._master_address, rpc_layer)

    @property
    def task_type(self):
        """Always `"worker"`."""
        return TaskType.WORKER.value

    @property
    def task_id(self):
        """This process's `RANK`."""
        return self._rendezvous.rank

    @property
    def is_chief(self):
        """True for rank 0."""
        return self._rendezvous.rank == 0

    def rendezvous(self):
        """Returns the `Rendezvous` the torchrun variables describe.

        `store_is_external` is True when `TORCHELASTIC_USE_AGENT_STORE=True`
        (torchrun's agent hosts the store: use `init_method="env://"`).
        """
        return self._rendezvous
