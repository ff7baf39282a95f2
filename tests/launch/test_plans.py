"""Tests for kdist.launch.plans' worker restarts, and `kdist launch --chief` surviving a worker.

The last tests are the acceptance test of coordinator training under the real
launcher: a worker killed with SIGKILL mid-training is restarted on its port,
the chief finishes, and the launcher exits with the chief's code (0).
"""

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from kdist.launch import cli, plans
from kdist.launch.spec import RestartPolicy
from kdist.ps import autosave
from tests import harness

SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = str(SCRIPTS / "report_env.py")
COORDINATOR_SCRIPT = str(SCRIPTS / "coordinator_restart.py")
TIMEOUT = 90.0


def specs_for(*argv):
    args = cli.build_parser().parse_args(["launch", *argv, SCRIPT])
    return {spec.name: spec for spec in plans.build_specs(args)}


def test_coordinator_workers_get_a_bounded_restart_policy_and_nothing_else_does():
    specs = specs_for("--workers", "2", "--ps", "1", "--chief")

    default = RestartPolicy(plans.DEFAULT_MAX_WORKER_RESTARTS, plans.RESTART_BACKOFF_SECONDS)
    ps_default = RestartPolicy(plans.DEFAULT_MAX_PS_RESTARTS, plans.RESTART_BACKOFF_SECONDS)
    assert {name: spec.restart for name, spec in specs.items()} == {
        "ps-0": ps_default,
        "worker-0": default,
        "worker-1": default,
        "chief-0": None,
    }
    specs = specs_for("--workers", "1", "--ps", "1", "--chief", "--max-worker-restarts", "5")
    assert specs["worker-0"].restart == RestartPolicy(5, plans.RESTART_BACKOFF_SECONDS)
    specs = specs_for("--workers", "1", "--ps", "1", "--chief", "--max-worker-restarts", "0")
    assert specs["worker-0"].restart is None


@pytest.mark.parametrize(
    "argv",
    [
        ("--workers", "2", "--ps", "1"),  # Asynchronous PS: workers train themselves.
        ("--workers", "2", "--chief"),  # MultiWorkerMirroredStrategy.
        ("--workers", "2", "--ps", "1", "--chief", "--daemon-jobs", "ps"),
    ],
    ids=["async-ps", "multi-worker", "workers-not-serving"],
)
def test_workers_that_train_themselves_keep_fail_fast(argv):
    workers = {name: spec for name, spec in specs_for(*argv).items() if name != "ps-0"}
    assert any(name.startswith("worker-") for name in workers), sorted(workers)
    assert all(spec.restart is None for spec in workers.values())


def test_parameter_servers_restart_and_checkpoint_by_default():
    specs = specs_for("--workers", "1", "--ps", "2", "--chief")
    every = autosave.CHECKPOINT_EVERY_VARIABLE
    assert [specs[f"ps-{i}"].env[every] for i in range(2)] == [plans.DEFAULT_PS_CHECKPOINT_EVERY] * 2
    assert autosave.CHECKPOINT_EVERY_VARIABLE not in specs["worker-0"].env
    placed = plans.with_ps_checkpoint_dir(list(specs.values()), "/logs/ps-checkpoints")
    directories = {s.name: s.env.get(autosave.CHECKPOINT_DIR_VARIABLE) for s in placed}
    assert directories == {"chief-0": None, "worker-0": None, "ps-0": "/logs/ps-checkpoints/ps-0",
                           "ps-1": "/logs/ps-checkpoints/ps-1"}


def test_ps_checkpoint_flags():
    specs = specs_for("--workers", "1", "--ps", "1", "--chief", "--ps-checkpoint-every", "1",
                      "--ps-checkpoint-dir", "/ckpt", "--max-ps-restarts", "5")
    assert specs["ps-0"].restart == RestartPolicy(5, plans.RESTART_BACKOFF_SECONDS)
    assert specs["ps-0"].env[autosave.CHECKPOINT_EVERY_VARIABLE] == "1"
    assert specs["ps-0"].env[autosave.CHECKPOINT_DIR_VARIABLE] == "/ckpt/ps-0"
    # The user's directory is kept by with_ps_checkpoint_dir.
    (placed,) = [s for s in plans.with_ps_checkpoint_dir(list(specs.values()), "/x") if s.name == "ps-0"]
    assert placed.env[autosave.CHECKPOINT_DIR_VARIABLE] == "/ckpt/ps-0"
    specs = specs_for("--workers", "1", "--ps", "1", "--max-ps-restarts", "0")
    assert specs["ps-0"].restart is None
    assert autosave.CHECKPOINT_EVERY_VARIABLE not in specs["ps-0"].env


@pytest.mark.parametrize(
    "argv, message",
    [(["--workers", "1", "--ps", "1", "--ps-checkpoint-every", "0"], "argument --ps-checkpoint-every"),
     (["--workers", "1", "--ps", "1", "--ps-checkpoint-every", "1.5"], "Received: '1.5'"),
     (["--workers", "1", "--ps-checkpoint-every", "1"], "needs --ps K"),
     (["--nproc", "2", "--max-ps-restarts", "1"], "only allowed with --workers")],
)
def test_bad_ps_checkpoint_flags_are_usage_errors(argv, message, capsys):
    assert cli.main(["launch", *argv, SCRIPT]) == 2
    assert message in capsys.readouterr().err


def test_max_worker_restarts_outside_coordinator_training_is_a_usage_error(capsys):
    code = cli.main(["launch", "--workers", "2", "--max-worker-restarts", "2", SCRIPT, "x"])

    assert code == 2
    assert "argument --max-worker-restarts: applies to coordinator training only" in (
        capsys.readouterr().err
    )


def _launch_coordinator(out_dir, *options):
    argv = [sys.executable, "-m", "kdist", "launch", "--ps", "1", "--workers", "2", "--chief"]
    argv += ["--grace", "2", *options, COORDINATOR_SCRIPT, str(out_dir)]
    spec = harness.ProcessSpec("launcher", argv, cwd=str(harness.REPO_ROOT))
    return harness.start([spec])


def _kill_worker_mid_training(processes, out_dir):
    assert processes.wait_for_output(
        "launcher", "[chief-0] epoch 0 done", TIMEOUT
    ), processes.output("launcher")
    (pid_file,) = Path(out_dir).glob("worker-1.*.pid")
    os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_worker_killed_mid_training_is_restarted_and_the_chief_finishes(tmp_path):
    with _launch_coordinator(tmp_path) as processes:
        _kill_worker_mid_training(processes, tmp_path)
        result = harness.wait(processes, TIMEOUT)

    output = result.output("launcher")
    assert result.returncodes == {"launcher": 0}, output
    assert "[kdist] worker-1 (pid" in output
    assert "was killed by SIGKILL; restarting it (1 of 3) in 0s" in output
    assert "[kdist] restarted worker-1 (pid" in output
    assert output.count("[worker-1] serving") == 2
    (report,) = [line for line in output.splitlines() if line.startswith("[chief-0] {")]
    report = json.loads(report.split(" ", 1)[1])
    assert report["restarted"] == ["worker-1"]
    assert report["closures"] == 4 * 20  # Every scheduled step ran exactly once.


def test_control_without_restarts_the_killed_worker_fails_the_job(tmp_path):
    with _launch_coordinator(tmp_path, "--max-worker-restarts", "0") as processes:
        _kill_worker_mid_training(processes, tmp_path)
        result = harness.wait(processes, TIMEOUT)

    output = result.output("launcher")
    assert result.returncodes == {"launcher": 128 + signal.SIGKILL}, output
    assert "worker-1 failed first" in output and "restarting" not in output
