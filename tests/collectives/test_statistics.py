"""Tests for kdist.collectives.statistics: the tally, its formulas, and real counts across processes."""

import json
import threading
from pathlib import Path

from kdist.collectives.statistics import (
    CollectiveStatistics,
    CollectiveStats,
    all_gather_wire_bytes,
    all_reduce_wire_bytes,
    broadcast_wire_bytes,
)
from tests import harness
from tests.collectives.workers import statistics as statistics_worker

WORKER = Path(statistics_worker.__file__)


def test_wire_bytes_follow_the_standard_formulas():
    assert all_reduce_wire_bytes(1000, 1) == 0
    assert all_reduce_wire_bytes(1000, 2) == 1000
    assert all_reduce_wire_bytes(1000, 4) == 1500
    assert all_gather_wire_bytes(1000, 4) == 3000
    assert broadcast_wire_bytes(1000, is_source=True) == 1000
    assert broadcast_wire_bytes(1000, is_source=False) == 0


def test_record_accumulates_per_operation_and_snapshots_are_copies():
    statistics = CollectiveStatistics()
    statistics.record("all_reduce(gradients)", 100, 50)
    statistics.record("all_reduce(gradients)", 20, 10)
    statistics.record("barrier", 4, 2)
    snapshot = statistics.snapshot()
    assert snapshot == {
        "all_reduce(gradients)": CollectiveStats(calls=2, payload_bytes=120, wire_bytes=60),
        "barrier": CollectiveStats(calls=1, payload_bytes=4, wire_bytes=2),
    }
    statistics.record("barrier", 4, 2)
    assert snapshot["barrier"].calls == 1
    assert statistics.snapshot()["barrier"].calls == 2


def test_record_from_several_threads_loses_no_update():
    statistics = CollectiveStatistics()

    def record_many():
        for _ in range(2000):
            statistics.record("all_reduce(gradients)", 3, 1)

    threads = [threading.Thread(target=record_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert statistics.snapshot() == {"all_reduce(gradients)": CollectiveStats(8000, 24000, 8000)}


def _expected(rank, world):
    def all_reduce(*buckets):
        return [len(buckets), sum(buckets), sum(2 * (world - 1) * n // world for n in buckets)]

    gradients = all_reduce(1200, 2800, 40)
    rows = 4 * 3 * world  # every rank sends its rows padded to the largest count (world rows of 3 floats)
    return {
        # all_reduce_sum, then the same layout through reduction_buffers/start_all_reduce: 3 buckets each.
        "all_reduce(gradients)": [2 * value for value in gradients],
        "broadcast(weights)": [1, 16, 16 if rank == 1 else 0],
        "all_gather(rows)": [1, rows, (world - 1) * rows],
        "all_reduce_min(limits)": all_reduce(8, 12),
        "all_reduce(ok)": all_reduce(4),
        "broadcast(state)": [1, 0, 0],
        "barrier": all_reduce(4),
    }


def test_statistics_count_calls_and_bytes_of_every_collective():
    num_processes = 3  # with 2, all-reduce wire bytes equal the payload and would not test the formula
    result = harness.run(harness.python_specs(harness.torchrun_envs(num_processes), WORKER), timeout=120)
    result.check()
    for rank in range(num_processes):
        output = result.output(f"worker-{rank}")
        (line,) = [line for line in output.splitlines() if line.startswith("STATS ")]
        assert json.loads(line[len("STATS "):]) == _expected(rank, num_processes), output
