"""What the replica engine does between processes in a multi-worker job.

Every rank receives the same global batch (the same data, the same shuffle:
see `kdist.keras.replica.multi_worker`), splits it over all replicas of the job
exactly as one process would split it over its devices, and runs only its own
replicas' contiguous shards. Then, per step:

- gradients: each rank sums `n_k / N · g_k` over its replicas, written
  straight into reusable communication buckets; one bucketed all-reduce per
  `optimizer.apply` call adds the ranks' sums, so every rank applies
  `Σ n_k g_k / N` over the whole job (N is the global batch size, known to
  every rank, so no count needs sending);
- state (metric deltas, BatchNorm statistics, seed state): one float64
  all-reduce of every variable's contribution (`state_sync`), started right
  after the gradients' so both travel together; nothing is assigned until
  both have arrived;
- predict: each rank's outputs are gathered in rank order, so every rank
  returns the whole batch's predictions.

All ranks make the same collectives in the same order, which keeps them
bitwise identical: they start from rank 0's variables (broadcast at the first
step of every fit/evaluate/predict call) and apply the same all-reduced values.
"""

import keras
import torch

from kdist.distribute.batching import batch_size_of, slice_batch, split_sizes
from kdist.keras import _compat


def for_strategy(strategy):
    """A `ProcessSync` when `strategy` spans several processes, else None."""
    collectives = strategy.extended.collectives
    if collectives is None:
        return None
    return ProcessSync(strategy, collectives)


class ProcessSync:
    """Cross-process reductions for one model's replica engine. Not thread-safe."""

    def __init__(self, strategy, collectives):
        self._strategy = strategy
        self._collectives = collectives
        self.rank = collectives.rank
        self.world_size = collectives.world_size
        self.holds_first_replica = strategy.extended.first_replica_id == 0

    # ----- splitting -----------------------------------------------------------
    def local_shards(self, batch, num_local):
        """This rank's `(local id, shard, size)` list and the global batch size."""
        total = batch_size_of(batch)
        sizes = split_sizes(total, num_local * self.world_size)
        first = self.rank * num_local
        start = sum(sizes[:first])
        active = []
        for k, size in enumerate(sizes[first : first + num_local]):
            if size:
                active.append((k, slice_batch(batch, start, start + size), size))
            start += size
        if not active:
            # A stand-in sample keeps this rank in the collectives; weight 0.
            active = [(0, slice_batch(batch, 0, 1), 0)]
        return active, total

    def rows_per_rank(self, total, num_local):
        sizes = split_sizes(total, num_local * self.world_size)
        return [sum(sizes[r * num_local : (r + 1) * num_local]) for r in range(self.world_size)]

    # ----- reductions ------------------------------------------------------------
    @property
    def options(self):
        """The job's `CommunicationOptions`."""
        return self._collectives.options

    @property
    def device(self):
        """Where communication buffers live."""
        return self._collectives.device

    def buffers(self, like, key, compressed=False, order=None):
        """Communication buckets shaped like `like`, reused from step to step.

        `compressed` for gradients (the job's `Compression`); `order` buckets
        in the order backward produces the tensors (see `gradient_overlap`).
        """
        return self._collectives.reduction_buffers(like, key, compressed=compressed, order=order)

    def start(self, buffers, name):
        """Starts summing `buffers` over ranks; results land in `buffers.outputs` after `wait`."""
        return self._collectives.start_all_reduce(buffers, name)

    def start_bucket(self, flat, name):
        """Starts summing one flat bucket over ranks, in place."""
        return self._collectives.start_bucket(flat, name)

    def start_reduction(self, tensors, key):
        """Copies `tensors` into reusable buckets and starts summing them; returns `(views, works)`."""
        buffers = self._collectives.reduction_buffers(tensors, key)
        buffers.fill(tensors)
        return buffers.views, self.start(buffers, name=key)

    def wait(self, works):
        self._collectives.wait(works)

    def sum_tensors(self, tensors, name, compressed=False):
        """Element-wise sums of `tensors` over ranks (bucketed, blocking; exact unless `compressed`)."""
        return self._collectives.all_reduce_sum(tensors, name=name, compressed=compressed)

    def sum_over_ranks(self, values):
        """Sums a few Python floats over ranks (one small blocking all-reduce); returns floats."""
        summed = self._collectives.all_reduce_sum([torch.tensor(values, dtype=torch.float64)], name="loss_denominators")
        return summed[0].tolist()

    def maximum_over_ranks(self, tensors):
        """Element-wise maxima over ranks (float8 scales and amax histories; blocking)."""
        minima = self._collectives.all_reduce_min([-t for t in tensors], name="float8_maximum")
        return [-t for t in minima]

    def ddp_average(self, gradients):
        """Test-only (`FaultInjection.ddp_averaged_gradients`): the unweighted mean over ranks."""
        present = [g for g in gradients if g is not None]
        summed = iter(self._collectives.all_reduce_sum(present, name="ddp_fault"))
        return [None if g is None else next(summed) / self.world_size for g in gradients]

    def merge_extra_logs(self, logs, canonical):
        """Sums the batch-weighted values of logs that are not compiled metrics over ranks."""
        keys = [
            key
            for key in sorted(logs)
            if key not in canonical and isinstance(logs[key], torch.Tensor) and logs[key].dtype == torch.float64
        ]
        if not keys:
            return logs
        summed = self._collectives.all_reduce_sum([logs[key] for key in keys], name="logs")
        merged = dict(logs)
        merged.update(zip(keys, summed))
        return merged

    def gather_outputs(self, local_outputs, batch):
        """Every rank's predictions for `batch`, concatenated in rank order."""
        num_local = len(self._strategy.extended.replica_devices)
        rows = self.rows_per_rank(batch_size_of(batch), num_local)
        return keras.tree.map_structure(
            lambda leaf: self._collectives.all_gather_rows(leaf, rows, name="predictions").to(leaf.device),
            local_outputs,
        )

    def broadcast_variables(self, model):
        """Copies rank 0's model and optimizer variables to every rank."""
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", False):
            variables.extend(optimizer.variables)
        seen, tensors = set(), []
        for variable in variables:
            tensor = _compat.torch_tensor_of(variable)
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
        self._collectives.broadcast(tensors, source_rank=0, name="variables")
