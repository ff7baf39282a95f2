"""`ParameterServerStrategy`: variables on parameter servers, asynchronous training.

Between-graph mode (TensorFlow 1's contrib strategy): every worker runs the
same script. Variables created in `strategy.scope()` live on the cluster's `ps`
tasks — placed round-robin in creation order, or split along axis 0 by a
`variable_partitioner` — and each worker keeps a local copy to compute with.
`model.fit` on a worker pulls the latest values, runs the model's own
`train_step`, and pushes the gradients; the parameter servers apply them with
the model's optimizer, each variable under its own lock. Workers never wait
for each other. A worker with several local devices trains them
synchronously (the `MirroredStrategy` engine) and pushes one combined update.
See `docs/parameter_server.md`.
"""

import contextlib
import weakref

from kdist import faults
from kdist._backend import STRATEGY_BACKENDS, require_backend
from kdist.cluster import resolve_cluster
from kdist.distribute.devices import resolve_devices
from kdist.distribute.extended import ChiefRoles
from kdist.distribute.mirrored import MirroredExtended
from kdist.distribute.parameter_server.partitioners import Partitioner
from kdist.distribute.parameter_server.placement import RoundRobinPlacer, device_string
from kdist.distribute.parameter_server.router import VariableRouter
from kdist.distribute.parameter_server.sharded_variable import RemoteVariable, ShardedVariable
from kdist.distribute.strategy import Strategy
from kdist.errors import InvalidArgumentError
from kdist.ps import Security
from kdist.ps.wire.conventions import check_sparse_updates

PS_JOB = "ps"
WORKER_JOB = "worker"



class ParameterServerExtended(ChiefRoles, MirroredExtended):
    """`StrategyExtended` of `ParameterServerStrategy`.

    Attributes:
        cluster_resolver: the resolver the job's layout came from.
        variable_router: the `VariableRouter` store holding every placed variable.
        options: the `kdist.ps.ServiceOptions` given (None: defaults).
        security: the `kdist.ps.Security` presented to parameter servers and workers.
    """

    def __init__(self, container_strategy, cluster_resolver, variable_partitioner, devices, options, security,
                 sparse_updates="exact"):
        check_sparse_updates(sparse_updates)
        resolver = resolve_cluster(cluster_resolver)
        spec = resolver.cluster_spec()
        if not spec or PS_JOB not in spec.jobs or spec.num_tasks(PS_JOB) == 0:
            raise InvalidArgumentError(
                "ParameterServerStrategy needs a cluster with at least one 'ps' task. Received: "
                f"cluster_spec={spec.as_dict() if spec else {}}. Describe the cluster in TF_CONFIG "
                "(or a cluster resolver) with a 'ps' job, e.g. start it with "
                "`kdist launch --workers 2 --ps 1 train.py`."
            )
        if resolver.task_type == PS_JOB:
            raise InvalidArgumentError(
                "This process is a 'ps' task: it serves variables and does not train. Received: "
                f"task_type={resolver.task_type!r}, task_id={resolver.task_id!r}. Branch on the "
                "role and run `kdist.distribute.Server(resolver.cluster_spec(), 'ps', "
                "resolver.task_id).join()` (or `kdist server`) in ps tasks."
            )
        if variable_partitioner is not None and not (
            isinstance(variable_partitioner, Partitioner) or callable(variable_partitioner)
        ):
            raise InvalidArgumentError(
                "Expected a partitioner such as kdist.partitioners.MinSizePartitioner(...). "
                f"Received: variable_partitioner={variable_partitioner!r}."
            )
        super().__init__(container_strategy, resolve_devices(devices), None)
        addresses = spec.job_tasks(PS_JOB)
        if any(address is None for address in addresses):
            raise InvalidArgumentError(
                "The 'ps' job must list tasks 0..K-1 without gaps. Received: "
                f"ps={addresses}."
            )
        self.cluster_resolver = resolver
        self._partitioner = variable_partitioner
        self._placer = RoundRobinPlacer(len(addresses))
        self.variable_router = VariableRouter(addresses, options=options, security=security)
        self.variable_router.sparse_updates = sparse_updates
        self.sparse_updates = sparse_updates
        self.options = options
        self.security = Security() if security is None else security
        # The `kdist.coordinator.ClusterCoordinator` of this strategy, once one exists.
        self._cluster_coordinator = None
        self._creation_paused = 0
        self._adopted_tables = frozenset()  # see `adopting_tables`
        weakref.finalize(container_strategy, self.variable_router.close)

    # ----- the coordinator (kdist.coordinator attaches itself) ------------------------
    @property
    def cluster_coordinator(self):
        """The `kdist.coordinator.ClusterCoordinator` of this strategy, or None before one exists."""
        return self._cluster_coordinator

    def attach_coordinator(self, coordinator):
        """Records `coordinator` as this strategy's one `ClusterCoordinator` (its constructor calls this).

        Raises:
            kdist.errors.InvalidArgumentError: another coordinator is attached;
                `shutdown()` it first.
        """
        if self._cluster_coordinator is not None and self._cluster_coordinator is not coordinator:
            raise InvalidArgumentError(
                "A strategy has one ClusterCoordinator. Received: a second one while "
                f"{self._cluster_coordinator!r} is attached. Use the attached one "
                "(`ClusterCoordinator(strategy)` returns it) or shutdown() it first."
            )
        self._cluster_coordinator = coordinator

    def detach_coordinator(self, coordinator):
        """Forgets `coordinator` when it is the attached one (its `shutdown()` calls this)."""
        if self._cluster_coordinator is coordinator:
            self._cluster_coordinator = None

    # ----- roles (TensorFlow's names) -------------------------------------------------
    @property
    def is_coordinator(self):
        """True for the process that drives the workers (TensorFlow 2's coordinator).

        That is the process that created a `kdist.coordinator.ClusterCoordinator`
        for this strategy, or, in a cluster with `worker` tasks, the `chief`
        task or a process whose resolver names no task (as in TensorFlow's
        in-process cluster). Its `model.fit` schedules closures onto the workers.
        """
        if self._cluster_coordinator is not None:
            return True
        resolver = self.cluster_resolver
        spec = resolver.cluster_spec()
        has_workers = WORKER_JOB in spec.jobs and spec.num_tasks(WORKER_JOB) > 0
        return has_workers and resolver.task_type in (None, "chief")

    @property
    def drives_workers(self):
        """The coordinator (`is_coordinator`): its `model.fit` drives the workers instead of training."""
        return self.is_coordinator

    @property
    def is_chief(self):
        """True for the task that writes checkpoints and summaries.

        The coordinator (see `is_coordinator`), a process whose resolver names
        no task, the `chief` task, or worker 0 when the cluster has no chief
        (between-graph training).
        """
        if faults.ACTIVE.coordinator_not_chief:
            return self.cluster_resolver.is_chief
        return self.is_coordinator or self.cluster_resolver.task_type is None or self.cluster_resolver.is_chief


    @property
    def num_ps(self):
        """Number of parameter servers."""
        return len(self.variable_router.clients)

    @property
    def parameter_devices(self):
        """The devices variables live on: one per `ps` task, in TensorFlow's spelling."""
        return tuple(device_string(index) for index in range(self.num_ps))

    # ----- variable placement ---------------------------------------------------------
    def _on_variable_created(self, variable, shape=None, initializer_json=None):
        """Places a variable just created in scope and creates it on its servers.

        With `initializer_json`, before its local initialisation: a table the
        servers hold and initialise (`VariableRouter.register`).
        """
        if self._creation_paused or self.variable_router.route(variable) is not None:
            return None
        target = self.colocation_target
        colocate_with = None
        if target is not None:
            target_route = self.variable_router.route(target)
            colocate_with = None if target_route is None else target_route.placement
        placement = self._placer.place(
            variable.name,
            # From the value: Keras sets `variable.shape` only after initialising it.
            tuple(variable.value.shape) if shape is None else tuple(shape),
            str(variable.dtype),
            partitioner=None if colocate_with is not None else self._partitioner,
            colocate_with=colocate_with,
        )
        return self.variable_router.register(variable, placement, initializer_json)

    def create_remote_table(self, variable, shape, initializer_json):
        """Creates, before its local initialisation, a table the servers hold and initialise (its `Route`)."""
        return self._on_variable_created(variable, shape, initializer_json)

    def partitions_rows(self, shape, dtype):
        """True when a variable of `shape` created in scope now would be split into several shards."""
        if self._creation_paused or self._partitioner is None or self.colocation_target is not None or not shape:
            return False
        try:
            return int(self._partitioner(tuple(shape), dtype)[0]) > 1
        except Exception:  # placing it raises the partitioner's error, with its explanation
            return False

    @contextlib.contextmanager
    def adopting_tables(self, paths):
        """Variables created inside whose path is in `paths` are tables the servers already hold (no local value)."""
        outer, self._adopted_tables = self._adopted_tables, frozenset(paths)
        try:
            yield
        finally:
            self._adopted_tables = outer

    def adopts_table(self, path):
        return path in self._adopted_tables

    @contextlib.contextmanager
    def local_variable_creation(self):
        """Variables created inside stay on this worker (kdist uses it for scratch state)."""
        self._creation_paused += 1
        try:
            yield
        finally:
            self._creation_paused -= 1

    def placement(self, variable):
        """The `VariablePlacement` of `variable`, or None when it is a local variable."""
        route = self.variable_router.route(variable)
        return None if route is None else route.placement

    def variable_device(self, variable):
        """Where `variable` lives, e.g. `"/job:ps/replica:0/task:1/device:CPU:0"` (its first shard)."""
        placement = self.placement(variable)
        if placement is None:
            raise InvalidArgumentError(
                "The variable does not live on a parameter server. Received: variable="
                f"{getattr(variable, 'path', variable)!r}. Create it inside strategy.scope()."
            )
        return placement.device

    def remote_view(self, variable):
        """The server-side view of `variable`: a `ShardedVariable` when partitioned, else a `RemoteVariable`."""
        placement = self.placement(variable)
        if placement is None:
            self.variable_device(variable)  # raises the explanatory error
        reader = self.variable_router.reader(self.variable_router.route(variable))
        if placement.is_partitioned:
            return ShardedVariable(placement, reader)
        return RemoteVariable(placement, reader)


class ParameterServerStrategy(Strategy):
    """Asynchronous data parallelism with variables on parameter servers.

    Every worker runs the same script (between-graph replication). Variables
    created in `scope()` are placed on the `ps` tasks; `model.fit` on each
    worker pulls them, runs the model's `train_step` on the worker's own data,
    and pushes gradients that the parameter servers apply at once, without
    waiting for other workers. Optimizer slots live on the servers, next to
    their variables.

    Args:
        cluster_resolver: where the cluster comes from; `None` reads `TF_CONFIG`.
            The cluster needs a `ps` job and `worker` (optionally `chief`) tasks.
        variable_partitioner: a `kdist.partitioners.Partitioner` (or any
            callable `(shape, dtype) -> list of partitions per axis`) deciding how
            many shards each variable is split into along axis 0; `None` keeps
            every variable whole.
        devices: this worker's local devices (several train synchronously).
            `None` means the CPU, or every visible GPU.
        options: `kdist.ps.ServiceOptions` (deadlines, chunk and message sizes).
        security: `kdist.ps.Security` (the cluster secret, TLS), matching the
            servers'; None: the secret from the environment (`kdist launch` sets it),
            else this process's own.
        sparse_updates: how the servers apply the row gradients of embedding
            tables. "exact" (default): the same numbers as one device; SGD
            without momentum and Adagrad update only the touched rows, other
            optimizers run Keras' dense update over the whole shard. "lazy":
            SGD with momentum, Adam, AdamW and RMSprop also update only the
            touched rows and their slots (TensorFlow Addons' `LazyAdam`
            semantics: untouched rows' slots do not decay), which differs
            from one device. See "Large embedding tables" in
            `docs/parameter_server.md`.

    Raises:
        kdist.errors.InvalidArgumentError: the cluster has no `ps` job, this
            process is a `ps` task, or an argument is malformed (such as
            `sparse_updates` not one of "exact", "lazy").
        kdist.errors.ParameterServerUnavailableError: a parameter server could
            not be reached within `options.connect_timeout_seconds` (raised by
            the first variable creation).

    Example:

    ```python
    resolver = kdist.cluster.TFConfigClusterResolver()
    if resolver.task_type == "ps":
        kdist.distribute.Server(resolver.cluster_spec(), "ps", resolver.task_id).join()
    else:
        strategy = kdist.ParameterServerStrategy(
            resolver,
            variable_partitioner=kdist.partitioners.MinSizePartitioner(max_shards=2),
        )
        with strategy.scope():
            model = build_model()
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(x_shard, y_shard, epochs=3)
    ```
    """

    SUPPORTED_BACKENDS = STRATEGY_BACKENDS["ParameterServerStrategy"]

    def __init__(self, cluster_resolver=None, variable_partitioner=None, *, devices=None, options=None, security=None,
                 sparse_updates="exact"):
        require_backend("ParameterServerStrategy", self.SUPPORTED_BACKENDS)
        super().__init__(
            ParameterServerExtended(self, cluster_resolver, variable_partitioner, devices, options, security,
                                    sparse_updates)
        )

    @property
    def cluster_resolver(self):
        """The `kdist.cluster.ClusterResolver` describing the job."""
        return self._extended.cluster_resolver

    def __repr__(self):
        resolver = self._extended.cluster_resolver
        return (
            f"ParameterServerStrategy(task={resolver.task_type}:{resolver.task_id}, "
            f"num_ps={self._extended.num_ps}, devices={list(self._extended.worker_devices)})"
        )
