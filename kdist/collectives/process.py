"""Reductions between processes with `torch.distributed` (gloo on CPU, NCCL on GPUs).

Every rank must make the same calls in the same order with tensors of the same
shapes and dtypes; callers iterate in creation order, never over sets.

Small tensors are never sent one by one: `all_reduce_sum` and `broadcast`
flatten the tensors of one dtype into buckets of up to
`CommunicationOptions.bucket_bytes` and make one call per bucket (see
`kdist.collectives.buckets`).

`ProcessCollectives.statistics` counts every call and its bytes per operation
(see `kdist.collectives.statistics`).

Every call has a deadline (`CommunicationOptions.timeout_seconds`). When one
fails — a peer died, stalled, or the deadline passed — the survivors raise
`kdist.errors.CollectiveTimeoutError` naming the missing rank(s) (see
`kdist.collectives.heartbeat`).
"""

import atexit
from datetime import timedelta

import torch
import torch.distributed as dist

from kdist.collectives.buckets import ReductionBuffers, _bucket_positions, _layout
from kdist.collectives.options import (  # noqa: F401  (re-exported: kdist.collectives.process.CommunicationOptions)
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_SECONDS,
    CommunicationOptions,
)
from kdist.collectives.heartbeat import Heartbeat
from kdist.collectives.statistics import (
    CollectiveStatistics,
    all_gather_wire_bytes,
    all_reduce_wire_bytes,
    broadcast_wire_bytes,
)
from kdist.errors import CollectiveTimeoutError, InvalidArgumentError


class ProcessCollectives:
    """Collectives across the ranks of one job, over an initialised process group.

    Not thread-safe: one training thread per process calls it, and every rank
    calls the same methods in the same order. `statistics` may be read from
    any thread.

    Args:
        rendezvous: a `kdist.cluster.Rendezvous` (rank, world size, store address).
        options: a `CommunicationOptions`.
        device: the torch device communication buffers live on (`cpu` for gloo,
            this process's `cuda:i` for NCCL).
    """

    def __init__(self, rendezvous, options, device):
        self.rank = rendezvous.rank
        self.world_size = rendezvous.world_size
        self.options = options
        self.device = torch.device(device)
        self._store_host_rank = None if rendezvous.store_is_external else 0
        self._heartbeat = None
        self._buffers = {}
        self._statistics = CollectiveStatistics()
        self._owns_group = False
        if dist.is_initialized():
            _check_existing_group(rendezvous)
        else:
            self._init_group(rendezvous)
            self._owns_group = True
        if self.world_size > 1:
            self._heartbeat = Heartbeat(
                rendezvous.master_addr, rendezvous.master_port, self.rank, self.world_size,
                attempt=rendezvous.attempt,
            )
        # Before interpreter teardown: a heartbeat thread still inside a store
        # call, or a process group destroyed by garbage collection in arbitrary
        # order, aborts the process ("terminate called without an active exception").
        atexit.register(self.shutdown)

    def _init_group(self, rendezvous):
        timeout = timedelta(seconds=self.options.timeout_seconds)
        backend = self.options.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self._store = dist.TCPStore(
            rendezvous.master_addr,
            rendezvous.master_port,
            rendezvous.world_size,
            is_master=rendezvous.rank == 0 and not rendezvous.store_is_external,
            timeout=timeout,
            wait_for_workers=False,
        )
        try:
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(f"kdist/{rendezvous.attempt}/process_group", self._store),
                rank=rendezvous.rank,
                world_size=rendezvous.world_size,
                timeout=timeout,
            )
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveTimeoutError(
                f"Rank {rendezvous.rank} could not join the job of {rendezvous.world_size} "
                f"processes at {rendezvous.master_addr}:{rendezvous.master_port} within "
                f"{self.options.timeout_seconds:g} s ({type(error).__name__}). Check that "
                "every process was started and that the address is reachable.",
                operation="init_process_group",
                timeout_seconds=self.options.timeout_seconds,
            ) from error

    @property
    def statistics(self):
        """`{operation: CollectiveStats}`: the calls this rank made and their bytes.

        Keys are the operation names of error messages, e.g.
        `"all_reduce(gradients)"`; a bucketed reduction counts one call per
        bucket. Nothing is counted when `world_size == 1` (no call is made).
        Object broadcasts count calls only (torch pickles the payload).
        Returns a new dict each time.
        """
        return self._statistics.snapshot()

    # ----- collectives -----------------------------------------------------
    def all_reduce_sum(self, tensors, name="tensors", compressed=False):
        """Returns the element-wise sums over ranks of `tensors` (new tensors, same order).

        Tensors are bucketed per dtype; the results are views of fresh buckets.

        Args:
            compressed: send in `options.compression`'s dtype (gradients only).
        """
        tensors = list(tensors)
        if self.world_size == 1 or not tensors:
            return tensors
        compression = self.options.compression if compressed else None
        buffers = ReductionBuffers(tensors, self.options.bucket_bytes, self.device, compression=compression)
        buffers.fill(tensors)
        self.wait(self.start_all_reduce(buffers, name))
        return buffers.outputs

    def reduction_buffers(self, like, key, compressed=False, order=None):
        """Bucket buffers shaped like `like`, kept between calls with the same `key` and layout.

        Write into `.views` (e.g. with `fill_weighted`), then `start_all_reduce`:
        the sums arrive in the same views, with no copy (`.decompress()` casts
        them back when compressed). The views are overwritten by the next use
        of the same key.

        Args:
            compressed: the buckets hold `options.compression`'s wire dtype
                (for gradients; everything else travels exactly).
            order: bucket in this order of positions, with a small first
                bucket (`options.first_bucket_bytes`), for reducing during backward.
        """
        buffers = self._buffers.get(key)
        if buffers is None or not buffers.matches(like):
            buffers = ReductionBuffers(
                like,
                self.options.bucket_bytes,
                self.device,
                compression=self.options.compression if compressed else None,
                order=order,
                first_bucket_bytes=self.options.first_bucket_bytes,
            )
            self._buffers[key] = buffers
        return buffers

    def start_all_reduce(self, buffers, name="tensors"):
        """Starts summing every bucket of `buffers` over ranks; pass the result to `wait`.

        After `wait` the sums are in `buffers.outputs` (cast back from the
        wire dtype when compressed).
        """
        works = [work for flat in buffers.flats for work in self.start_bucket(flat, name)]
        if buffers.compressed:
            works.append((f"all_reduce({name})", _Decompression(buffers)))
        return works

    def start_bucket(self, flat, name="tensors"):
        """Starts summing one flat bucket over ranks in place; returns works for `wait`."""
        if self.world_size == 1:
            return []
        operation = f"all_reduce({name})"
        self._record_all_reduce(operation, flat)
        return [(operation, self._run(operation, lambda: dist.all_reduce(flat, async_op=True)))]

    def wait(self, works):
        """Waits for collectives started with `start_all_reduce` (in order)."""
        for operation, work in works:
            self._run(operation, work.wait, counts=False)

    def broadcast(self, tensors, source_rank=0, name="tensors"):
        """Overwrites `tensors` in place with rank `source_rank`'s values (bucketed)."""
        tensors = list(tensors)
        if self.world_size == 1 or not tensors:
            return
        for positions in _bucket_positions(_layout(tensors), self.options.bucket_bytes):
            flat = torch.cat([tensors[p].detach().reshape(-1).to(self.device) for p in positions])
            payload = _nbytes(flat)
            self._statistics.record(
                f"broadcast({name})", payload, broadcast_wire_bytes(payload, self.rank == source_rank)
            )
            self._run(f"broadcast({name})", lambda flat=flat: dist.broadcast(flat, source_rank))
            offset = 0
            with torch.no_grad():
                for p in positions:
                    count = tensors[p].numel()
                    tensors[p].copy_(flat[offset : offset + count].view(tensors[p].shape))
                    offset += count

    def all_gather_rows(self, tensor, rows_per_rank, name="tensor"):
        """Concatenates every rank's `tensor` along dim 0, in rank order.

        Args:
            tensor: this rank's rows; every rank's tensor has the same trailing shape.
            rows_per_rank: how many rows each rank contributes (known to every rank).
        """
        if self.world_size == 1:
            return tensor
        largest = max(rows_per_rank)
        padded = torch.zeros((largest,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=self.device)
        padded[: tensor.shape[0]] = tensor.to(self.device)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        payload = _nbytes(padded)
        self._statistics.record(f"all_gather({name})", payload, all_gather_wire_bytes(payload, self.world_size))
        self._run(f"all_gather({name})", lambda: dist.all_gather(gathered, padded))
        return torch.cat([part[:rows] for part, rows in zip(gathered, rows_per_rank)])

    def all_gather_flat(self, tensor, name="tensor", out=None):
        """Every rank's 1-D `tensor` (all of one length), end to end in rank order: one call, no copies.

        Args:
            out: where to gather (`world_size * len(tensor)` elements, on
                `self.device`), or None for a new tensor.
        """
        tensor = tensor.reshape(-1).to(self.device)
        if out is None:
            out = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=self.device)
        if self.world_size == 1:
            out.copy_(tensor)
            return out
        payload = _nbytes(tensor)
        self._statistics.record(f"all_gather({name})", payload, all_gather_wire_bytes(payload, self.world_size))
        self._run(f"all_gather({name})", lambda: dist.all_gather_into_tensor(out, tensor))
        return out

    def all_reduce_min(self, tensors, name="tensors"):
        """Element-wise minima over ranks, one call per tensor (for small control values)."""
        tensors = [t.clone().to(self.device) for t in tensors]
        if self.world_size == 1:
            return tensors
        for tensor in tensors:
            self._record_all_reduce(f"all_reduce_min({name})", tensor)
            self._run(f"all_reduce_min({name})", lambda tensor=tensor: dist.all_reduce(tensor, op=dist.ReduceOp.MIN))
        return tensors

    def all_true(self, flag, name="flag"):
        """True when `flag` is true on every rank (one small all-reduce)."""
        if self.world_size == 1:
            return bool(flag)
        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        self._record_all_reduce(f"all_reduce({name})", value)
        self._run(f"all_reduce({name})", lambda: dist.all_reduce(value, op=dist.ReduceOp.MIN))
        return bool(value.item())

    def broadcast_object(self, obj, source_rank=0, name="object"):
        """Returns rank `source_rank`'s `obj` on every rank (pickled; for small control data)."""
        if self.world_size == 1:
            return obj
        holder = [obj]
        self._statistics.record(f"broadcast({name})", 0, 0)
        self._run(f"broadcast({name})", lambda: dist.broadcast_object_list(holder, source_rank, device=self.device))
        return holder[0]

    def barrier(self, name="barrier"):
        """Returns once every rank has called `barrier` with the same name."""
        if self.world_size == 1:
            return
        token = torch.zeros(1, device=self.device)
        self._record_all_reduce(name, token)
        self._run(name, lambda: dist.all_reduce(token))

    def shutdown(self):
        """Stops the heartbeat and, if kdist created it, the process group. Idempotent."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    # ----- internals -------------------------------------------------------
    def _record_all_reduce(self, operation, tensor):
        payload = _nbytes(tensor)
        self._statistics.record(operation, payload, all_reduce_wire_bytes(payload, self.world_size))

    def _run(self, operation, call, counts=True):
        heartbeat = self._heartbeat
        if heartbeat is None:
            sequence = None
        elif counts:
            sequence = heartbeat.enter_collective()
        else:
            sequence = heartbeat.sequence
        try:
            return call()
        except (RuntimeError, dist.DistError) as error:
            raise self._failure(operation, sequence, error) from error

    def _failure(self, operation, sequence, error):
        timeout = self.options.timeout_seconds
        if self._heartbeat is None:
            return CollectiveTimeoutError(
                f"{operation} failed on rank {self.rank} ({type(error).__name__}); the "
                "missing rank cannot be named because the process group was created "
                "outside kdist.",
                operation=operation,
                timeout_seconds=timeout,
            )
        diagnosis = self._heartbeat.diagnose()
        missing = diagnosis.missing_ranks
        if diagnosis.store_unreachable and self._store_host_rank is not None:
            missing = tuple(sorted(set(missing) | {self._store_host_rank}))
        return CollectiveTimeoutError(
            f"Collective #{sequence} {operation} failed on rank {self.rank} of "
            f"{self.world_size} (timeout {timeout:g} s, {type(error).__name__}). Missing "
            f"rank(s): {list(missing) if missing else 'unknown'}: "
            f"{diagnosis.describe(self._store_host_rank)}. The job cannot continue; "
            "restart every process (keras.callbacks.BackupAndRestore resumes from the "
            "last completed epoch).",
            operation=operation,
            missing_ranks=missing,
            timeout_seconds=timeout,
        )


def _check_existing_group(rendezvous):
    if dist.get_rank() != rendezvous.rank or dist.get_world_size() != rendezvous.world_size:
        raise InvalidArgumentError(
            "torch.distributed is already initialised with a different layout. Received: "
            f"rank={dist.get_rank()}, world_size={dist.get_world_size()} from the existing "
            f"process group, but the cluster resolver says rank={rendezvous.rank}, "
            f"world_size={rendezvous.world_size}."
        )


class _Decompression:
    """A step of `wait`: casts compressed sums back once the buckets before it have arrived."""

    def __init__(self, buffers):
        self._buffers = buffers

    def wait(self):
        self._buffers.decompress()


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()
