"""One rank running each kind of collective once, then printing its `statistics` as JSON.

Prints `STATS {json}` with `{operation: [calls, payload_bytes, wire_bytes]}`.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import torch  # noqa: E402

from kdist.cluster import resolve_cluster  # noqa: E402
from kdist.collectives.process import CommunicationOptions, ProcessCollectives  # noqa: E402


def main():
    rendezvous = resolve_cluster().rendezvous()
    collectives = ProcessCollectives(rendezvous, CommunicationOptions(timeout_seconds=30, bucket_bytes=1024), "cpu")
    rank, world = collectives.rank, collectives.world_size
    # float32 1200 + 2800 bytes (two buckets at a 1 KiB cap) and int64 40 bytes (a third).
    gradients = [torch.full((300,), 1.0), torch.full((700,), 1.0), torch.ones(5, dtype=torch.int64)]
    summed = collectives.all_reduce_sum(gradients, name="gradients")
    assert torch.equal(summed[0], torch.full((300,), float(world)))
    buffers = collectives.reduction_buffers(gradients, key="kept")
    buffers.fill(gradients)
    collectives.wait(collectives.start_all_reduce(buffers, name="gradients"))
    collectives.broadcast([torch.zeros(4)], source_rank=1, name="weights")
    rows = collectives.all_gather_rows(torch.ones(rank + 1, 3), list(range(1, world + 1)), name="rows")
    assert rows.shape == (sum(range(1, world + 1)), 3)
    collectives.all_reduce_min([torch.ones(2), torch.ones(3)], name="limits")
    assert collectives.all_true(True, name="ok")
    collectives.broadcast_object({"seed": 1}, name="state")
    collectives.barrier()
    statistics = {name: list(dataclass_values(s)) for name, s in collectives.statistics.items()}
    print("STATS " + json.dumps(statistics, sort_keys=True), flush=True)
    collectives.shutdown()
    return 0


def dataclass_values(stats):
    return stats.calls, stats.payload_bytes, stats.wire_bytes


if __name__ == "__main__":
    sys.exit(main())
