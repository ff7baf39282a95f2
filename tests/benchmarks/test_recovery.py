"""benchmarks/recovery.py: its quick mode runs a real killed-and-restarted job, and its figures add up.

The quick mode starts a 2-process job twice (about 30 s on this machine); the
arithmetic tests check the reported figures and verdicts on made-up timelines,
with cases that must fail.
"""

import json
import os
import subprocess
import sys
from unittest import mock

import pytest

from tests import harness

SCRIPT = harness.REPO_ROOT / "benchmarks" / "recovery.py"
QUICK_TIMEOUT_SECONDS = 240


@pytest.fixture
def bench(monkeypatch):
    # The benchmarks import each other by file name, as when run as scripts. Importing
    # the module sets KERAS_BACKEND in os.environ: undone afterwards.
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    with mock.patch.dict(os.environ):
        import recovery

        yield recovery


def _timeline(start, imports=3.0, rendezvous=0.5, restore=1.0, first_step=0.2, global_step=1):
    return {"process_started": start, "script_started": start + 0.1, "imported": start + 0.1 + imports,
            "rendezvous": start + 0.1 + imports + rendezvous,
            "train_begin": start + 0.1 + imports + rendezvous + restore,
            "first_step": start + 0.1 + imports + rendezvous + restore + first_step,
            "first_global_step": global_step}


def test_a_round_measures_from_the_kill_and_counts_the_steps_trained_again(bench, monkeypatch):
    launched, killed_at = 1000.0, 1010.0
    timelines = {"worker-0": [_timeline(1000.5), _timeline(1011.0, global_step=9)],
                 "worker-1": [_timeline(1000.6), _timeline(1011.1, global_step=9)]}
    monkeypatch.setattr(bench, "run_case", lambda case, step, directory: {
        "timelines": timelines, "killed": {"step": 10, "time": killed_at}, "launched": launched,
        "recovered": None, "log": ""})

    measured = bench.measure_round("mwms2_rank0", 10, "unused")

    # Backup at step 8, kill after step 10: steps 9 and 10 are trained again.
    assert measured["steps_lost"] == 2
    assert measured["recovery_seconds"] == pytest.approx(1011.0 + 4.8 - killed_at)
    assert measured["cold_start_seconds"] == pytest.approx(0.5 + 4.8)
    phases = measured["recovery_breakdown"]
    assert phases["detect_and_restart_or_launch"] == pytest.approx(1.0)
    assert phases["startup"] == pytest.approx(0.1 + 3.0 + 0.5)
    parts = ("detect_and_restart_or_launch", "interpreter", "imports", "rendezvous", "restore", "first_step")
    assert sum(phases[part] for part in parts) == pytest.approx(measured["recovery_seconds"])
    assert measured["restarted_processes"] == ["worker-0", "worker-1"]


def test_a_chief_that_ran_once_is_an_error_not_a_figure(bench, monkeypatch):
    monkeypatch.setattr(bench, "run_case", lambda case, step, directory: {
        "timelines": {"worker-0": [_timeline(1000.5)]}, "killed": {"step": 10, "time": 1010.0},
        "launched": 1000.0, "recovered": None, "log": ""})
    with pytest.raises(RuntimeError, match="expected 2 runs of worker-0, got 1"):
        bench.measure_round("mwms2_rank0", 10, "unused")


def test_a_killed_ps_counts_the_pushes_it_lost_and_waits_for_the_chiefs_next_step(bench, monkeypatch):
    log = ("[ps-0] ps-0 restored its checkpoint of push 9 (6 variables, versions 9-9) from /x; "
           "1 pushes applied after it are lost.\n")
    job = {"timelines": {"ps-0": [_timeline(1000.2), _timeline(1011.0)], "chief-0": [_timeline(1000.5)],
                         "worker-0": [_timeline(1000.3)]},
           "killed": {"step": 10, "time": 1010.0}, "launched": 1000.0, "recovered": {"first_step": 1016.0},
           "log": log}
    monkeypatch.setattr(bench, "run_case", lambda case, step, directory: job)

    measured = bench.measure_round("coordinator_ps", 10, "unused")
    assert measured["recovery_seconds"] == pytest.approx(6.0) and measured["steps_lost"] == 1
    assert measured["recovery_breakdown"]["startup"] == pytest.approx(3.6)
    assert measured["restarted_processes"] == ["ps-0"]
    job["log"] = ""  # a ps that did not say what it restored is an error
    with pytest.raises(RuntimeError, match="restore logged: False"):
        bench.measure_round("coordinator_ps", 10, "unused")


def test_the_target_is_met_under_15_seconds_only_for_the_target_case(bench):
    def rounds(recovery):
        return [{"kill_step": 10, "recovery_seconds": recovery, "cold_start_seconds": 10.0, "steps_lost": 2,
                 "recovery_breakdown": {"startup": 5.0}, "cold_start_breakdown": {"startup": 5.0},
                 "restarted_processes": ["worker-0", "worker-1"]}]

    met = bench.case_line("mwms2_rank0", rounds(14.9), {})
    missed = bench.case_line("mwms2_rank0", rounds(15.0), {})
    other = bench.case_line("mwms2_rank1", rounds(30.0), {})
    assert (met["meets_target"], missed["meets_target"], other["meets_target"]) == (True, False, None)
    assert met["recovery_vs_cold_start"] == 1.49
    summary = bench.summary_line([missed, other], {})
    assert summary["met"] is False and summary["recovery_seconds"] == 15.0


def test_the_kill_steps_are_seeded_and_fall_after_the_first_backup(bench):
    steps = bench.kill_steps("mwms2_rank0", 5)
    assert steps == bench.kill_steps("mwms2_rank0", 5)
    assert all(bench.SAVE_FREQ < step < bench.STEPS_PER_EPOCH for step in steps)
    # Cases that save every epoch are killed in the second one, after the first backup.
    epoch_steps = bench.kill_steps("coordinator_chief", 5)
    assert all(bench.STEPS_PER_EPOCH < step < 2 * bench.STEPS_PER_EPOCH for step in epoch_steps)


def test_quick_mode_prints_a_recovery_line_and_a_summary():
    environ = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=str(harness.REPO_ROOT))
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick"], env=environ, capture_output=True,
                            text=True, timeout=QUICK_TIMEOUT_SECONDS, cwd=str(harness.REPO_ROOT))
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["what"] for line in lines] == ["recovery", "recovery_summary"]
    case, summary = lines
    assert case["case"] == "mwms2_rank0" and case["rounds"] == 1
    assert case["restarted_processes"] == ["worker-0", "worker-1"]
    assert 0 <= case["steps_lost"] < case["save_freq"] == 4
    assert 0 < case["recovery_breakdown"]["startup"] < case["recovery_seconds"]
    assert 0 < case["cold_start_breakdown"]["startup"] < case["cold_start_seconds"]
    assert case["recovery_vs_cold_start"] == pytest.approx(
        case["recovery_seconds"] / case["cold_start_seconds"], abs=1e-3)
    assert isinstance(case["meets_target"], bool) and case["target_seconds"] == 15.0
    assert summary["recovery_seconds"] == case["recovery_seconds"] and summary["met"] == case["meets_target"]
    assert {"environment", "commit"} <= set(case)
