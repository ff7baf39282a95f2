"""`StrategyExtended`: the implementer-facing half of a strategy.

Devices, reductions between replicas, variable updates and colocation. Concrete
strategies subclass it (`MirroredExtended`, `MultiWorkerExtended`); users reach
it as `strategy.extended`.
"""

import contextlib

import keras
import torch

from kdist.distribute import context, nest, replica_runner
from kdist.distribute.values import DistributedValues, Mirrored, PerReplica, check_num_components
from kdist.errors import InvalidArgumentError, StrategyScopeError
from kdist.types import ReduceOp

# Results of `Strategy.reduce`/`gather` land on the host, as in TensorFlow, so
# they can be printed or logged without a further copy.
HOST_DEVICE = torch.device("cpu")


def to_tensor(value):
    """Converts a tensor, Keras variable, NumPy array or Python number to a torch tensor."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, keras.Variable):
        return value.value
    return torch.as_tensor(value)


def check_gather_shapes(components, axis):
    """Raises unless the components can be concatenated along `axis`."""
    shapes = [tuple(component.shape) for component in components]
    rank = len(shapes[0])
    if any(len(shape) != rank for shape in shapes) or not -rank <= axis < rank:
        raise InvalidArgumentError(
            "Cannot gather: every component needs the same rank and `axis` must lie in "
            f"[-rank, rank). Received: axis={axis} for component shapes {shapes}."
        )
    dim = axis % rank
    if len({shape[:dim] + shape[dim + 1 :] for shape in shapes}) != 1:
        raise InvalidArgumentError(
            "Cannot gather: components must have the same size in every dimension "
            f"except `axis`. Received: axis={axis} for component shapes {shapes}. "
            "Gather along the dimension in which they differ."
        )


class StrategyExtended:
    """Implementer-facing half of a strategy: devices, reductions, updates.

    Args:
        container_strategy: the `Strategy` this object belongs to.
        replica_devices: tuple of `kdist.distribute.devices.Device`, one per replica.
    """

    is_default = False

    def __init__(self, container_strategy, replica_devices):
        self._container_strategy = container_strategy
        self._replica_devices = tuple(replica_devices)
        self._colocation_stack = []
        self.default_replica_context = None

    @property
    def num_replicas_in_sync(self):
        """Replicas in every process together; `replica_devices` are this process's."""
        return len(self.replica_devices)

    def _sum_over_processes(self, total, count):
        """`(total, count)` summed over every process of the job; one process: unchanged."""
        return total, count

    # One input pipeline per process: `InputContext` fields for this process.
    num_input_pipelines = 1
    input_pipeline_id = 0

    # The job's `kdist.collectives.process.ProcessCollectives` when it spans
    # processes (`MultiWorkerExtended` sets it); None in one process.
    collectives = None

    # ----- roles (TensorFlow's names) -------------------------------------------
    # Computed once here (`is_chief`, `drives_workers`); everything else, the
    # Keras integration included, reads these instead of asking a rank itself.
    @property
    def is_chief(self):
        """True for the task that writes checkpoints and summaries; one process is its own chief."""
        return True

    @property
    def should_checkpoint(self):
        """Whether this task writes checkpoints: the chief only."""
        return self.is_chief

    @property
    def should_save_summary(self):
        """Whether this task writes logs and summaries: the chief only."""
        return self.is_chief

    @property
    def drives_workers(self):
        """True where `model.fit` schedules work onto other tasks instead of training here.

        Only a parameter-server strategy's coordinator does (TensorFlow 2's
        `ClusterCoordinator` mode); every other strategy trains in place.
        """
        return False

    should_init = True
    experimental_should_init = True
    experimental_between_graph = False

    @property
    def first_replica_id(self):
        """`replica_id_in_sync_group` of this process's first replica (0 in one process)."""
        return 0

    # ----- devices -------------------------------------------------------------
    # Every method below reads `self.replica_devices`, never the attribute:
    # the default strategy overrides the property to follow the current device.
    @property
    def replica_devices(self):
        """`Device` objects, one per replica, in replica order."""
        return self._replica_devices

    @property
    def worker_devices(self):
        """Device names used to run replica functions, one per replica."""
        return tuple(device.name for device in self.replica_devices)

    @property
    def parameter_devices(self):
        """Device names holding variables; the first replica's device for mirrored variables."""
        return (self.replica_devices[0].name,)

    def non_slot_devices(self, var_list):
        """Devices for variables that are not optimizer slots (e.g. step counters)."""
        del var_list  # every variable lives on the canonical device
        return self.parameter_devices

    def variable_device_scope(self):
        """Scope entered by `Strategy.scope()` so new variables land on the canonical device."""
        return contextlib.nullcontext()

    def replica_device_scope(self, replica_id):
        from kdist.distribute.devices import device_scope

        return device_scope(self.replica_devices[replica_id])

    # ----- running --------------------------------------------------------------
    def call_for_each_replica(self, fn, args=(), kwargs=None):
        """Runs `fn` once per replica in a replica context; see `Strategy.run`."""
        self._require_cross_replica("call_for_each_replica")
        strategy = self._container_strategy
        check_num_components((args, kwargs), len(self.replica_devices), "args/kwargs")
        with strategy.scope():
            if len(self.replica_devices) == 1:
                return replica_runner.run_single_replica(strategy, fn, args, kwargs)
            return replica_runner.run_per_replica(strategy, fn, args, kwargs)

    def _require_cross_replica(self, api):
        context.require_cross_replica(api)

    # ----- reductions -----------------------------------------------------------
    def _destination_devices(self, destinations):
        from kdist.distribute.devices import parse_device

        if destinations is None or isinstance(destinations, DistributedValues):
            return [device.torch_device for device in self.replica_devices]
        if isinstance(destinations, keras.Variable):
            return [destinations.value.device]
        if isinstance(destinations, (str, torch.device)):
            destinations = [destinations]
        return [parse_device(d, "destinations").torch_device for d in destinations]

    def _components(self, reduce_op, value):
        """Returns one tensor per replica; a plain value counts as mirrored."""
        if isinstance(value, DistributedValues):
            return [to_tensor(v) for v in value.values]
        tensor = to_tensor(value)
        num_replicas = len(self.replica_devices)
        if reduce_op is ReduceOp.SUM and num_replicas > 1:
            raise InvalidArgumentError(
                "A value that is not distributed cannot be summed across replicas: it "
                f"would count {num_replicas} times. Received a {type(value).__name__}. "
                "Pass the PerReplica result of strategy.run, or use ReduceOp.MEAN."
            )
        return [tensor]

    def reduce_to(self, reduce_op, value, destinations, options=None):
        """Reduces `value` across replicas and places the result on `destinations`.

        Args:
            reduce_op: `ReduceOp` or its name.
            value: a `PerReplica`/`Mirrored`, or a plain tensor (treated as mirrored).
            destinations: a device string, a list of them, a Keras variable (its
                device) or a distributed value (the replica devices).
            options: accepted for API compatibility; unused.

        Returns:
            A tensor for one destination, else a `Mirrored` with one copy per destination.
        """
        del options
        reduce_op = ReduceOp.from_value(reduce_op)
        devices = self._destination_devices(destinations)
        reduced = self._cross_device_ops().reduce(
            reduce_op, self._components(reduce_op, value), devices
        )
        return reduced[0] if len(reduced) == 1 else Mirrored(reduced)

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
        """`reduce_to` for several `(value, destinations)` pairs; returns a list."""
        return [
            self.reduce_to(reduce_op, value, destinations, options)
            for value, destinations in value_destination_pairs
        ]

    def broadcast_to(self, tensor, destinations):
        """Copies `tensor` to every destination device; a `Mirrored` for several."""
        copies = self._cross_device_ops().broadcast(
            to_tensor(tensor), self._destination_devices(destinations)
        )
        return copies[0] if len(copies) == 1 else Mirrored(copies)

    def gather_to(self, value, axis, destination):
        """Concatenates the replicas' components along `axis` on `destination`."""
        components = self._components(ReduceOp.MEAN, value)
        if not isinstance(value, DistributedValues):
            components = components * len(self.replica_devices)
        if any(component.dim() == 0 for component in components):
            raise InvalidArgumentError(
                "Cannot gather scalars: components must have rank >= 1. Received a "
                "rank-0 value. Add a dimension first (e.g. x[None])."
            )
        check_gather_shapes(components, axis)
        device = torch.device(destination) if not hasattr(destination, "torch_device") else destination.torch_device
        return torch.cat([c.to(device) for c in components], dim=axis)

    def update(self, var, fn, args=(), kwargs=None, group=True):
        """Runs `fn(var, *args, **kwargs)` to update `var` in the cross-replica context.

        Mirrored variables live once, on the canonical device (replicas read
        copies made at each step), so `fn` runs once. `Mirrored` arguments are
        unwrapped; `PerReplica` arguments are refused because the update would
        differ per replica.

        Returns:
            `fn`'s result (a one-element tuple when `group=False`).
        """
        kwargs = kwargs or {}

        def unwrap(leaf):
            if isinstance(leaf, PerReplica):
                raise InvalidArgumentError(
                    "update() received a PerReplica argument. Reduce it first "
                    "(extended.reduce_to) so every copy of the variable gets the same update."
                )
            if isinstance(leaf, Mirrored):
                return leaf.values[0]
            return leaf

        args, kwargs = nest.map_structure(unwrap, (tuple(args), kwargs))
        with torch.no_grad():
            result = fn(var, *args, **kwargs)
        return result if group else (result,)

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable):
        """Variables created inside are placed with `colocate_with_variable`.

        Only valid inside this strategy's scope. With mirrored variables every
        variable already lives on the canonical device; parameter-server
        strategies use this to place (and not partition) the new variables.
        """
        if context.get_strategy() is not self._container_strategy:
            raise StrategyScopeError(
                "colocate_vars_with may only be used inside the strategy's scope(). "
                "Enter `with strategy.scope():` first."
            )
        self._colocation_stack.append(colocate_with_variable)
        try:
            yield
        finally:
            self._colocation_stack.pop()

    @property
    def colocation_target(self):
        """The innermost `colocate_vars_with` variable, or None."""
        return self._colocation_stack[-1] if self._colocation_stack else None

    def _cross_device_ops(self):
        from kdist.collectives.local import ReductionToOneDevice

        return ReductionToOneDevice()


class ChiefRoles:
    """Roles of a strategy whose job has one chief among several tasks (between-graph).

    The class that mixes it in defines `is_chief`; `StrategyExtended` derives
    `should_checkpoint` and `should_save_summary` from it, and every task
    initialises its own state.
    """

    experimental_between_graph = True
