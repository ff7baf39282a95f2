"""Reductions between devices of one process.

All functions take torch tensors. Copies between devices are coalesced: the
tensors of one dtype are flattened into one buffer, copied once and split
again, so N small gradients cost one transfer instead of N. Nothing here
synchronises with the host (no `.item()`, no `.cpu()` on the result path), so
GPU replicas keep overlapping through asynchronous kernel launches.
"""

import abc

import torch

from kdist.errors import InvalidArgumentError
from kdist.types import ReduceOp


def copy_to_device(tensors, device):
    """Returns copies of `tensors` on `device`, one transfer per source device and dtype.

    Tensors already on `device` are returned as they are (no copy). Sparse
    tensors travel one by one (they cannot be flattened into a shared buffer).
    Copies to a GPU are asynchronous; copies to the host are not, so the
    result can be read at once.
    """
    device = torch.device(device)
    non_blocking = device.type != "cpu"
    result = list(tensors)
    groups = {}
    for position, tensor in enumerate(result):
        if tensor.device == device:
            continue
        if tensor.layout != torch.strided:
            result[position] = tensor.to(device, non_blocking=non_blocking)
            continue
        groups.setdefault((tensor.device, tensor.dtype), []).append(position)
    for positions in groups.values():
        if len(positions) == 1:
            position = positions[0]
            result[position] = result[position].to(device, non_blocking=non_blocking)
            continue
        flat = torch.cat([result[p].reshape(-1) for p in positions])
        moved = flat.to(device, non_blocking=non_blocking)
        offset = 0
        for p in positions:
            count = result[p].numel()
            result[p] = moved[offset : offset + count].view(result[p].shape)
            offset += count
    return result


def weighted_sum(tensor_lists, weights, device):
    """Returns `[Σ_k weights[k] * tensor_lists[k][i] for i]` on `device`.

    Args:
        tensor_lists: one list of tensors per contributor, all lists aligned.
        weights: one Python float per contributor.
        device: where the result lives.
    """
    if len(tensor_lists) != len(weights):
        raise InvalidArgumentError(
            f"Expected one weight per contributor. Received {len(weights)} weights "
            f"for {len(tensor_lists)} contributors."
        )
    total = None
    for tensors, weight in zip(tensor_lists, weights):
        tensors = copy_to_device(tensors, device)
        if total is None:
            total = _scaled_copies(tensors, weight)
        elif weight == 1.0:
            torch._foreach_add_(total, tensors)
        else:
            torch._foreach_add_(total, tensors, alpha=weight)
    return total


def _scaled_copies(tensors, weight):
    """`[t * weight for t in tensors]` (copies where weight is 1), dense floating-point ones in one torch call."""
    if weight == 1.0:
        return [t.clone() for t in tensors]
    if tensors and all(t.layout == torch.strided and t.is_floating_point() for t in tensors):
        # The same element-wise product, one dispatch for the list instead of one per tensor.
        return list(torch._foreach_mul(tensors, weight))
    return [t * weight for t in tensors]


def reduce_tensors(reduce_op, tensors, device):
    """Sums (or averages) one tensor per contributor onto `device`.

    Raises:
        kdist.errors.InvalidArgumentError: the shapes differ.
    """
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise InvalidArgumentError(
            "Cannot reduce values of different shapes across replicas. Received shapes "
            f"{[tuple(t.shape) for t in tensors]}. Pass axis=0 to Strategy.reduce to "
            "reduce along the batch dimension first (needed for a partial last batch)."
        )
    (total,) = weighted_sum([[tensor] for tensor in tensors], [1.0] * len(tensors), device)
    if ReduceOp.from_value(reduce_op) is ReduceOp.MEAN:
        total = divide(total, len(tensors))
    return total


def divide(total, count):
    """`total / count`, truncating for integer tensors so the dtype is kept."""
    if total.dtype.is_floating_point or total.dtype.is_complex:
        return total / count
    return torch.div(total, count, rounding_mode="trunc")


class CrossDeviceOps(abc.ABC):
    """How a strategy combines values held on several devices of one process.

    Subclasses implement `reduce_to_device`; the other methods build on it.
    Pass an instance as `MirroredStrategy(cross_device_ops=...)`.
    """

    @abc.abstractmethod
    def reduce_to_device(self, reduce_op, tensors, device):
        """Returns the reduction of `tensors` (one per replica) on `device`."""

    def reduce(self, reduce_op, tensors, destinations):
        """Reduces onto the first destination, then copies to the others.

        Returns:
            A list with one tensor per destination device.
        """
        reduced = self.reduce_to_device(reduce_op, tensors, destinations[0])
        return self.broadcast(reduced, destinations)

    def broadcast(self, tensor, destinations):
        """Returns one copy of `tensor` per destination device.

        The first destination on `tensor`'s own device gets `tensor` itself;
        every other destination gets a tensor of its own, even where logical
        CPU replicas share one torch device, so an in-place op on one
        replica's copy never changes another's.
        """
        copies = []
        for destination in destinations:
            if tensor.device != torch.device(destination):
                copies.append(tensor.to(destination))
            elif any(copy is tensor for copy in copies):
                copies.append(tensor.clone())
            else:
                copies.append(tensor)
        return copies


class ReductionToOneDevice(CrossDeviceOps):
    """Copies every replica's value to one device, reduces there, copies back.

    Args:
        reduce_to_device: where the reduction happens; `None` means the first
            destination (for gradients: the canonical replica's device).

    Example:

    ```python
    strategy = kdist.MirroredStrategy(
        devices=["cuda:0", "cuda:1"],
        cross_device_ops=kdist.ReductionToOneDevice(reduce_to_device="cuda:0"))
    ```
    """

    def __init__(self, reduce_to_device=None):
        self.reduce_to_device_name = reduce_to_device

    def reduce_to_device(self, reduce_op, tensors, device):
        target = self.reduce_to_device_name or device
        reduced = reduce_tensors(reduce_op, tensors, target)
        return reduced if torch.device(target) == torch.device(device) else reduced.to(device)
