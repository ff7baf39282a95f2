"""benchmarks/embedding_scale.py: its arithmetic (targets, timing windows, per-step counters) on made-up results.

The benchmark itself starts about ten processes even for `--quick` (1-2 minutes on
this machine), so these tests check the parts that turn measurements into the
reported figures and pass/fail verdicts, with cases that must fail.
"""

import os
from unittest import mock

import pytest

from tests import harness

SCRIPT = harness.REPO_ROOT / "benchmarks" / "embedding_scale.py"


@pytest.fixture
def bench(monkeypatch):
    # The benchmarks import each other by file name, as when run as scripts. Importing
    # the module sets defaults in os.environ (backend, cluster secret): undone afterwards.
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    with mock.patch.dict(os.environ):
        import embedding_scale

        yield embedding_scale


def _line(config, rows, optimizer, ms_per_step, rss=None, ratio_vs_tf=None):
    line = {"config": config, "rows": rows, "optimizer": optimizer, "steps_per_sec": 1000 / ms_per_step,
            "ms_per_step": ms_per_step, "peak_rss_mb": rss or {}}
    if ratio_vs_tf is not None:
        line["ratio_vs_tf_ps"] = ratio_vs_tf
    return line


def _targets(summary):
    return {target["name"]: target for target in summary["targets"]}


def test_step_time_growth_target_passes_at_1_3_and_fails_above(bench):
    lines = [_line("coordinator_1", 10**4, "sgd", 10.0), _line("coordinator_1", 10**7, "sgd", 13.0),
             _line("between_graph_1", 10**4, "sgd", 10.0), _line("between_graph_1", 10**7, "sgd", 13.1)]
    targets = _targets(bench.summary(lines, [10**4, 10**7]))
    assert targets["step_time_coordinator_1_sgd_rows_10000000_vs_10000"]["met"] is True
    assert targets["step_time_coordinator_1_sgd_rows_10000000_vs_10000"]["value"] == 1.3
    failed = targets["step_time_between_graph_1_sgd_rows_10000000_vs_10000"]
    assert failed["met"] is False and failed["value"] == 1.31
    # Not measured is neither a pass nor a fail.
    assert targets["step_time_coordinator_2_adagrad_rows_10000000_vs_10000"]["met"] is None
    assert bench.summary(lines, [10**4, 10**7])["all_measured_targets_met"] is False


def test_rss_growth_target_is_checked_per_chief_and_worker(bench):
    lines = [_line("coordinator_1", 10**4, "adam", 20.0, {"chief": 800.0, "worker-0": 900.0, "ps-0": 100.0}),
             _line("coordinator_1", 10**7, "adam", 25.0, {"chief": 1000.0, "worker-0": 1100.5, "ps-0": 9000.0})]
    targets = _targets(bench.summary(lines, [10**4, 10**7]))
    assert targets["peak_rss_growth_mb_coordinator_1_adam_chief_rows_10000000_vs_10000"]["met"] is True
    worker = targets["peak_rss_growth_mb_coordinator_1_adam_worker-0_rows_10000000_vs_10000"]
    assert worker["met"] is False and worker["value"] == 200.5
    # The servers hold the table: their growth is expected and not a target.
    assert not any("ps-0" in name for name in targets)


def test_tf_ratio_target_reads_the_coordinator_at_a_million_rows(bench):
    lines = [_line("coordinator_1", 10**6, "sgd", 10.0, ratio_vs_tf=1.0),
             _line("coordinator_1", 10**6, "adagrad", 10.0, ratio_vs_tf=0.99),
             _line("between_graph_1", 10**6, "sgd", 10.0, ratio_vs_tf=0.5)]
    summary = bench.summary(lines, [10**6])
    targets = _targets(summary)
    assert targets["coordinator_1_vs_tf_ps_1_sgd_rows_1000000"]["met"] is True
    assert targets["coordinator_1_vs_tf_ps_1_adagrad_rows_1000000"]["met"] is False
    assert targets["coordinator_2_vs_tf_ps_2_sgd_rows_1000000"]["met"] is None
    assert not any(name.startswith("between_graph_1_vs_tf") for name in targets)
    assert summary["targets_measured"] == 2


def test_timed_rate_counts_only_steps_inside_every_trainers_window(bench):
    one = {"step_ends": [0.0, 0.5, 1.0, 1.5, 2.0]}
    assert bench._timed_rate([one]) == 2.0  # 4 steps after the first timed end, in 2 s
    # Two workers: the window both were timing is (0.5, 2.0]; 3 + 2 steps end inside it.
    two = {"step_ends": [0.5, 1.25, 2.0, 2.75]}
    assert bench._timed_rate([one, two]) == pytest.approx(5 / 1.5)
    # Windows that do not overlap: each worker's own rate, added.
    late = {"step_ends": [3.0, 4.0, 5.0]}
    assert bench._timed_rate([one, late]) == 2.0 + 1.0
    assert bench._timed_rate([{"timed_steps": 17, "seconds": 0.5}]) == 34.0


def test_per_step_counters_are_the_difference_of_a_round_and_the_short_fit(bench):
    keys = ("bytes_to_servers", "bytes_from_servers", "sparse_applies", "dense_applies", "rows_updated", "requests")
    short = {"steps": 3, "cpu_seconds": 1.0, "counters": dict.fromkeys(keys, 0) | {"bytes_to_servers": 1300}}
    # A fit's fixed traffic (1000 bytes, e.g. reading the state at its end) cancels: 100 bytes per step.
    round_ = {"steps": 13, "cpu_seconds": 2.0, "counters": dict.fromkeys(keys, 0) | {"bytes_to_servers": 2300}}
    counters, cpu = bench._per_step(round_, short)
    assert counters["bytes_to_servers"] == 100.0 and cpu == pytest.approx(0.1)


def test_counter_totals_add_up_servers_and_leave_out_the_benchmarks_own_requests(bench):
    server = {"bytes_received": 10, "bytes_sent": 20, "requests": {"push": 2, "pull": 3, "counters": 7},
              "update_counts": {"v0/part_0": {"sparse_applies": 1, "dense_applies": 0, "rows_updated": 40},
                                "v1": {"sparse_applies": 0, "dense_applies": 1, "rows_updated": 0}}}
    totals = bench._counter_totals([server, server])
    assert totals == {"bytes_to_servers": 20, "bytes_from_servers": 40, "sparse_applies": 2, "dense_applies": 2,
                      "rows_updated": 80, "requests": 10}


def test_arguments_quick_defaults_and_refusals(bench):
    args = bench.parse_args(["--quick"])
    assert (args.sizes, args.optimizers, args.workers, args.modes) == ([10**4], ["sgd"], [1],
                                                                        ["coordinator", "between_graph"])
    full = bench.parse_args([])
    assert full.sizes == [10**4, 10**5, 10**6, 10**7] and full.optimizers == ["sgd", "adagrad", "adam", "adam_lazy"]
    assert bench.parse_args(["--sizes", "10000,100000", "--optimizers", "adam_lazy"]).sizes == [10**4, 10**5]
    with pytest.raises(SystemExit):
        bench.parse_args(["--optimizers", "rmsprop"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "3", "--warmup-steps", "2"])


def test_lazy_adam_is_the_lazy_mode_and_the_others_exact(bench):
    assert {name: spec[2] for name, spec in bench.OPTIMIZERS.items()} == {
        "sgd": "exact", "adagrad": "exact", "adam": "exact", "adam_lazy": "lazy"}


def test_a_child_that_dies_fails_the_benchmark_with_its_output(bench):
    import sys

    child = bench.Child("doomed", [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"])
    with pytest.raises(bench.BenchmarkError, match=r"(?s)doomed exited with code 3.*boom"):
        child.receive(60)
    assert child not in bench._children  # killed and forgotten: nothing outlives the benchmark
