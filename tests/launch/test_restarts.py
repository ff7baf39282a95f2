"""`kdist launch --max-restarts K`: a synchronous job restarts itself after a process dies.

Real processes throughout. The light tests run `cli.main` in this process with
scripts that import neither Keras nor torch (tests/launch/scripts/restart_job.py);
the last one runs the real launcher (`python -m kdist launch`) through the test
harness on a MultiWorkerMirroredStrategy job with `BackupAndRestore(save_freq=4)`,
SIGKILLs rank 0 after a step drawn by a seeded RNG, and compares the restarted
job's results (step-level resume, kdist/keras/step_resume.py) with an uninterrupted run.
"""

import os
import random
import re
import signal
import sys
from pathlib import Path

import pytest

from kdist.launch import cli, output, plans
from kdist.launch.spec import RestartPolicy
from tests import harness

SCRIPTS = Path(__file__).parent / "scripts"
RESTART_JOB = str(SCRIPTS / "restart_job.py")
BACKUP_FIT = SCRIPTS / "backup_fit.py"
TIMEOUT = "60"  # The launcher's own --timeout for the light jobs: nothing here may hang.


def launch(*argv):
    return cli.main(["launch", "--timeout", TIMEOUT, *argv])


def runs(out, name):
    """`[(pid, rendezvous), ...]`, one per run of process `name`."""
    lines = (out / f"runs-{name}.txt").read_text().splitlines()
    return [tuple(line.split()) for line in lines]


def recorded_pids(out):
    return [int(path.read_text()) for path in out.glob("*.pid")]


def test_a_failed_process_restarts_the_whole_job_on_a_fresh_rendezvous(tmp_path, capsys):
    # Runs 0 and 1: rank 1 kills itself (SIGKILL) once all 3 started; run 2 succeeds.
    code = launch("--nproc", "3", "--max-restarts", "2", RESTART_JOB, str(tmp_path), "1", "2", "kill9")

    err = capsys.readouterr().err
    assert code == 0, err
    assert "worker-1 (pid " in err and ") was killed by SIGKILL; restarting the job (1 of 2)" in err
    assert "stopping worker-0, worker-2 (SIGTERM, SIGKILL after 10s)" in err
    assert "restarting the job (2 of 2): started worker-0 (pid " in err
    assert "job restarts used" not in err
    per_process = [runs(tmp_path, f"worker-{rank}") for rank in range(3)]
    assert [len(r) for r in per_process] == [3, 3, 3]
    # Every run of the job shares one rendezvous port; each run has its own.
    ports = [{r[run][1] for r in per_process} for run in range(3)]
    assert all(len(port) == 1 for port in ports), ports
    assert len(set.union(*ports)) == 3, ports
    assert harness.wait_until_gone(recorded_pids(tmp_path), timeout=10) == []


def test_restarts_used_up_fail_the_job_with_the_typed_summary_and_no_orphans(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    code = launch(
        "--nproc", "2", "--max-restarts", "1", "--grace", "2", "--log-dir", str(log_dir),
        RESTART_JOB, str(tmp_path), "1", "99", "exit3",
    )

    err = capsys.readouterr().err
    assert code == 3, err
    assert "exited with code 3; restarting the job (1 of 1)" in err
    assert "exited with code 3; all 1 job restarts used, so the job fails" in err
    assert "worker-1 failed first: it exited with code 3; exit code 3" in err
    assert len(runs(tmp_path, "worker-0")) == len(runs(tmp_path, "worker-1")) == 2
    # One log file per process holds every run, in order.
    log = (log_dir / "worker-1.log").read_text()
    assert log.index("run 0: failing") < log.index("run 1: failing"), log
    assert harness.wait_until_gone(recorded_pids(tmp_path), timeout=10) == []


def test_without_max_restarts_the_first_failure_ends_the_job_as_before(tmp_path, capsys):
    # The negative control: the same job fails at once when restarts are not asked for.
    code = launch("--nproc", "2", "--grace", "2", RESTART_JOB, str(tmp_path), "1", "1", "kill9")

    err = capsys.readouterr().err
    assert code == 128 + signal.SIGKILL, err
    assert "restarting the job" not in err
    assert len(runs(tmp_path, "worker-1")) == 1
    assert harness.wait_until_gone(recorded_pids(tmp_path), timeout=10) == []


def test_the_timeout_bounds_the_whole_job_restarts_included(tmp_path, capsys):
    # Rank 1 fails every run; restarts come at once, then after 1 s, 2 s, 4 s: the 4 s
    # timeout falls during one. The launcher ends it (exit 124), starting nothing more.
    code = cli.main(
        ["launch", "--nproc", "2", "--max-restarts", "5", "--timeout", "4", "--grace", "1",
         RESTART_JOB, str(tmp_path), "1", "99", "exit3"]
    )

    err = capsys.readouterr().err
    assert code == cli.EXIT_TIMEOUT, err
    assert "timed out after 4s" in err
    assert "started" not in err.split("timed out after 4s")[1], err
    assert 3 <= len(runs(tmp_path, "worker-1")) <= 4
    assert harness.wait_until_gone(recorded_pids(tmp_path), timeout=10) == []


def test_a_stop_signal_during_a_restart_cancels_it(tmp_path):
    argv = [sys.executable, "-m", "kdist", "launch", "--nproc", "2", "--max-restarts", "3",
            RESTART_JOB, str(tmp_path), "1", "99", "kill9"]
    spec = harness.ProcessSpec("launcher", argv, cwd=str(harness.REPO_ROOT))
    with harness.start([spec]) as processes:
        # The first restart is immediate; the second waits its 1 s backoff.
        assert processes.wait_for_output("launcher", "restarting the job (2 of 3): stopping", timeout=60)
        processes.send_signal("launcher", signal.SIGTERM)
        result = harness.wait(processes, timeout=60)

    launcher = result.output("launcher")
    assert result.returncodes == {"launcher": 128 + signal.SIGTERM}, launcher
    assert "received SIGTERM" in launcher
    assert "restarting the job (1 of 3): started" in launcher
    assert "restarting the job (2 of 3): started" not in launcher
    assert len(runs(tmp_path, "worker-0")) == 2
    assert harness.wait_until_gone(recorded_pids(tmp_path), timeout=10) == []


def test_a_survivor_that_ignores_sigterm_is_killed_before_the_restart(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "KILL_AFTER_SECONDS", 1.0)
    code = launch(
        "--nproc", "2", "--max-restarts", "1", RESTART_JOB, str(tmp_path), "1", "1", "exit5",
        "--ignore-term",
    )

    err = capsys.readouterr().err
    assert code == 0, err
    assert "stopping worker-0 (SIGTERM, SIGKILL after 1s)" in err
    first_run_pid = int(runs(tmp_path, "worker-0")[0][0])
    assert len(runs(tmp_path, "worker-0")) == 2
    assert harness.wait_until_gone([first_run_pid], timeout=10) == []


def test_a_tf_config_cluster_restarts_on_a_new_local_cluster(tmp_path, capsys):
    code = launch(
        "--workers", "2", "--chief", "--max-restarts", "1", RESTART_JOB, str(tmp_path), "2", "1", "kill9"
    )

    err = capsys.readouterr().err
    assert code == 0, err
    assert "was killed by SIGKILL; restarting the job (1 of 1)" in err
    clusters = [{runs(tmp_path, name)[run][1] for name in ("chief-0", "worker-0", "worker-1")} for run in (0, 1)]
    assert [len(cluster) for cluster in clusters] == [1, 1], clusters  # one cluster per run
    assert clusters[0] != clusters[1]
    assert harness.wait_until_gone(recorded_pids(tmp_path), timeout=10) == []


def test_max_restarts_is_refused_with_part_of_a_cluster(tmp_path, capsys):
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"worker": ["127.0.0.1:1111"]}')

    code = cli.main(["launch", "--cluster", str(cluster), "--task", "worker:0", "--max-restarts", "2",
                     RESTART_JOB, str(tmp_path), "0", "1", "exit1"])

    assert code == 2
    assert "argument --max-restarts: only allowed with --nproc" in capsys.readouterr().err
    assert list(tmp_path.glob("runs-*")) == []


@pytest.mark.parametrize(
    "argv, trainers",
    [(["--workers", "2", "--ps", "1", "--chief"], ["chief-0"]),
     (["--workers", "2", "--ps", "1"], ["worker-0", "worker-1"])],
    ids=["coordinator", "between-graph-ps"],
)
def test_with_ps_max_restarts_restarts_the_trainers_one_at_a_time(argv, trainers):
    args = cli.build_parser().parse_args(["launch", *argv, "--max-restarts", "2", RESTART_JOB])
    specs = {spec.name: spec for spec in plans.build_specs(args)}

    assert plans.job_restart(args, lambda: []) is None  # The servers' state is never restarted.
    for name in trainers:
        assert specs[name].restart == RestartPolicy(2, plans.RESTART_BACKOFF_SECONDS)
    assert specs["ps-0"].restart == RestartPolicy(plans.DEFAULT_MAX_PS_RESTARTS,
                                                  plans.RESTART_BACKOFF_SECONDS)


def test_a_negative_max_restarts_is_a_usage_error(tmp_path, capsys):
    assert cli.main(["launch", "--nproc", "1", "--max-restarts", "-1", RESTART_JOB]) == 2
    assert "argument --max-restarts: must be at least 0" in capsys.readouterr().err


def test_a_line_interrupted_by_another_process_ends_once():
    # A process's print comes as "text" then "\n" (unbuffered): when another
    # process writes in between, the sink ends the line; the late "\n" adds no
    # empty "[name] " line (it did, and restarted jobs showed them).
    target = _Collect()
    sink = output.PrefixedSink(output.STDOUT, target)
    sink.write("[a] ", "one")
    sink.write("[b] ", "two\n")
    sink.write("[a] ", "\n")
    sink.write("[a] ", "\n")  # A real empty line keeps its prefix.
    assert target.text == "[a] one\n[b] two\n[a] \n"


class _Collect:
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass


# -- A MultiWorkerMirroredStrategy job with BackupAndRestore(save_freq=S) ---------

KILL_SEED = 24
STEPS_PER_EPOCH = 16  # fit_equivalence: 1000 samples, global batch 64.
EPOCHS = 3
SAVE_FREQ = 4  # A backup every 4 steps: at most 4 steps of work are lost.
JOB_TIMEOUT = 240.0
RESUMED = re.compile(r"\[worker-0\] \[kdist\] resumed from backup (\S+): epoch (\d+), step (\d+)")


@pytest.fixture(scope="module")
def uninterrupted():
    from tests.keras.workers import fit_equivalence

    return fit_equivalence.train(epochs=EPOCHS)


def test_a_rank_killed_mid_training_restarts_the_job_and_fit_resumes_exactly(tmp_path, uninterrupted):
    import numpy as np

    from tests.keras.replica.test_multi_worker import assert_ranks_identical, load_ranks

    # Rank 0 dies: it hosts the rendezvous store, the harder loss (the light
    # tests above lose a rank k > 0). After which step is drawn, not chosen,
    # before the last epoch (so steps are left to train after the restart).
    step = random.Random(KILL_SEED).randrange(SAVE_FREQ + 1, (EPOCHS - 1) * STEPS_PER_EPOCH)
    epoch, batch = divmod(step - 1, STEPS_PER_EPOCH)
    argv = [
        sys.executable, "-m", "kdist", "launch", "--nproc", "2", "--max-restarts", "1",
        "--timeout", str(JOB_TIMEOUT - 30), str(BACKUP_FIT), str(tmp_path), "--epochs", str(EPOCHS),
        "--save-freq", str(SAVE_FREQ), "--pause", "0.03",
    ]
    spec = harness.ProcessSpec("launcher", argv, cwd=str(harness.REPO_ROOT))
    with harness.start([spec]) as processes:
        progress = f"[worker-0] epoch={epoch} batch={batch} pid="
        assert processes.wait_for_output("launcher", progress, timeout=JOB_TIMEOUT / 2), processes.output("launcher")
        line = next(line for line in processes.output("launcher").splitlines() if line.startswith(progress))
        victim = int(line.rsplit("pid=", 1)[1])
        os.kill(victim, signal.SIGKILL)  # The rank itself, not its launcher.
        result = harness.wait(processes, timeout=JOB_TIMEOUT)

    launcher = result.output("launcher")
    assert result.returncodes == {"launcher": 0}, launcher
    assert f"worker-0 (pid {victim}) was killed by SIGKILL; restarting the job (1 of 1)" in launcher
    assert "rank 0 finished" in launcher and "rank 1 finished" in launcher
    assert harness.wait_until_gone(recorded_pids(tmp_path), timeout=10) == []
    # The restarted rank 0 says where fit resumed: at most SAVE_FREQ steps before the kill.
    resumed = RESUMED.findall(launcher)
    assert len(resumed) == 1 and resumed[0][0] == str(tmp_path / "backup"), launcher
    resumed_epoch, resumed_step = int(resumed[0][1]), int(resumed[0][2])
    assert step - SAVE_FREQ <= resumed_epoch * STEPS_PER_EPOCH + resumed_step, (step, resumed)

    ranks = load_ranks(tmp_path, 2)
    assert_ranks_identical(ranks)
    # Weights, optimizer slots and iterations, metrics, evaluate, predict, and the
    # History of the epochs the restarted fit ran: as if never interrupted.
    assert len(ranks[0]["history/loss"]) == EPOCHS - resumed_epoch
    assert set(ranks[0]) == set(uninterrupted)
    differing = []
    for key, value in ranks[0].items():
        wanted = uninterrupted[key][-len(value):] if key.startswith("history/") else uninterrupted[key]
        if wanted.shape != value.shape or not np.allclose(wanted, value, rtol=2e-5, atol=2e-6):
            differing.append(key)
    assert differing == []
