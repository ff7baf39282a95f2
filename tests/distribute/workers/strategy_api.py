"""One rank exercising the Strategy API and the collectives across processes.

Prints `CHECKS PASSED` when every assertion held. With `--stall`, rank 1
sleeps instead of joining a barrier and rank 0 prints the diagnosis it got.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import torch  # noqa: E402

import kdist  # noqa: E402
from kdist.collectives.process import CommunicationOptions, ProcessCollectives  # noqa: E402


def check_strategy(strategy, rank, world):
    assert strategy.num_replicas_in_sync == world
    assert strategy.extended.should_checkpoint == (rank == 0)
    assert strategy.extended.is_chief == (rank == 0)

    def step(value):
        context = kdist.get_replica_context()
        replica = context.replica_id_in_sync_group
        summed = context.all_reduce("sum", torch.tensor([float(replica + 1)]))
        return value * (replica + 1), summed

    per_replica, summed = strategy.run(step, args=(torch.tensor([1.0, 2.0]),))
    expected_sum = sum(range(1, world + 1))
    assert torch.equal(summed, torch.tensor([float(expected_sum)])), summed
    total = strategy.reduce("sum", strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([float(ctx.replica_id_in_sync_group)])), axis=None)
    assert total.item() == sum(range(world)), total
    mean = strategy.reduce("mean", torch.tensor([3.0]), axis=None)
    assert mean.item() == 3.0

    # Rank r holds r + 1 rows: reduce along the batch and gather respect the real counts.
    rows = torch.arange(rank + 1, dtype=torch.float32).reshape(-1, 1) + 10 * rank
    values = strategy.experimental_distribute_values_from_function(lambda ctx: rows)
    gathered = strategy.gather(values, axis=0)
    expected = torch.cat([torch.arange(r + 1, dtype=torch.float32).reshape(-1, 1) + 10 * r for r in range(world)])
    assert torch.equal(gathered, expected), gathered
    mean_rows = strategy.reduce("mean", values, axis=0)
    assert torch.allclose(mean_rows, expected.mean(dim=0, keepdim=False)), (mean_rows, expected.mean(0))


def check_distributed_dataset(strategy, rank, world):
    # Every rank reads the same global batch of 2 * world + 1 rows and keeps its own slice.
    batch = torch.arange(2 * world + 1, dtype=torch.float32)
    (element,) = list(strategy.experimental_distribute_dataset([batch]))
    sizes = [3 if r == 0 else 2 for r in range(world)]
    start = sum(sizes[:rank])
    assert torch.equal(element, batch[start : start + sizes[rank]]), (rank, element)
    total = strategy.reduce("sum", strategy.run(lambda x: x.sum(), args=(element,)), axis=None)
    assert total.item() == batch.sum().item(), total


def check_collectives(collectives, rank, world):
    # A 1 KiB bucket limit forces many buckets and both dtypes.
    tensors = [
        torch.full((300,), float(rank + 1)),
        torch.arange(5, dtype=torch.int64) * (rank + 1),
        torch.full((2, 3), 0.5 * (rank + 1), dtype=torch.float64),
        torch.full((700,), float(rank)),
    ]
    summed = collectives.all_reduce_sum(tensors)
    factor = sum(range(1, world + 1))
    assert torch.equal(summed[0], torch.full((300,), float(factor)))
    assert torch.equal(summed[1], torch.arange(5, dtype=torch.int64) * factor)
    assert torch.equal(summed[2], torch.full((2, 3), 0.5 * factor, dtype=torch.float64))
    assert torch.equal(summed[3], torch.full((700,), float(sum(range(world)))))
    assert torch.equal(tensors[0], torch.full((300,), float(rank + 1))), "inputs must stay unchanged"

    targets = [torch.full((4,), float(rank)), torch.full((1,), rank, dtype=torch.int32)]
    collectives.broadcast(targets, source_rank=world - 1)
    assert torch.equal(targets[0], torch.full((4,), float(world - 1)))
    assert targets[1].item() == world - 1
    assert collectives.all_true(True) is True
    assert collectives.all_true(rank != 0) is False
    assert collectives.broadcast_object({"from": rank}) == {"from": 0}
    collectives.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stall", metavar="DONE_FILE", help="rank 1 stalls until rank 0 writes DONE_FILE")
    args = parser.parse_args()
    if args.stall:
        return stall(args.stall)
    strategy = kdist.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30, bucket_bytes=1024)
    )
    collectives = strategy.extended.collectives
    check_strategy(strategy, collectives.rank, collectives.world_size)
    check_distributed_dataset(strategy, collectives.rank, collectives.world_size)
    check_collectives(collectives, collectives.rank, collectives.world_size)
    print("CHECKS PASSED", flush=True)
    return 0


def stall(done_file):
    from kdist.cluster import resolve_cluster
    from kdist.errors import CollectiveTimeoutError

    rendezvous = resolve_cluster().rendezvous()
    collectives = ProcessCollectives(rendezvous, CommunicationOptions(timeout_seconds=4), "cpu")
    collectives.barrier()
    if collectives.rank == 1:
        # Alive (heartbeat running) but never reaches the next barrier: it waits for
        # rank 0 to have diagnosed it, not for a time.
        deadline = time.monotonic() + 60
        while not os.path.exists(done_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        return 0
    started = time.monotonic()
    try:
        collectives.barrier(name="barrier(after stall)")
    except CollectiveTimeoutError as error:
        print(f"DIAGNOSED missing={list(error.missing_ranks)} after {time.monotonic() - started:.1f}s: {error}", flush=True)
        return 0
    else:
        print("NO ERROR", flush=True)
        return 1
    finally:
        open(done_file, "w").close()


if __name__ == "__main__":
    sys.exit(main())
