"""A `MultiWorkerMirroredStrategy` job resumed from its backup on another number of processes.

Real processes under the real launcher (`python -m kdist launch`): a job of N
processes with `BackupAndRestore(save_freq=4)` loses a rank (SIGKILL after a
step drawn by a seeded RNG; no `--max-restarts`, so the job ends), and the user
relaunches the same command with another `--nproc` (3 -> 2, and 2 -> 3 from a
`--workers 2 --chief` TF_CONFIG cluster). The resumed job trains the same global
batches (64 samples, the order rank 0's random state drew), so it ends equal to
the job that was never interrupted: weights, optimizer slots and iterations,
metrics, the History of the epochs after the restart, evaluate and predict, to
float32 tolerance. Negative control: the same relaunch with a resume that
trains the backup's steps of the epoch again fails the comparison.
"""

import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import harness

pytestmark = pytest.mark.timeout(900)

SCRIPT = Path(__file__).parent / "scripts" / "world_size_fit.py"
STEPS_PER_EPOCH = 16  # tests.keras.workers.fit_equivalence: 1000 samples, global batch 64.
EPOCHS = 3
SAVE_FREQ = 4
JOB_TIMEOUT = 300.0
RESUMED = re.compile(r"\[(?:worker|chief)-0\] \[kdist\] resumed from backup (\S+): epoch (\d+), step (\d+)")


@pytest.fixture(scope="module")
def reference():
    """Plain Keras in this process on the global batches: what any uninterrupted job equals."""
    from tests.keras.workers import fit_equivalence

    return fit_equivalence.train(epochs=EPOCHS)


def launcher(layout, out, *extra):
    argv = [sys.executable, "-m", "kdist", "launch", *layout, "--timeout", str(int(JOB_TIMEOUT - 30)),
            str(SCRIPT), str(out), "--epochs", str(EPOCHS), "--save-freq", str(SAVE_FREQ), *extra]
    return harness.ProcessSpec("launcher", argv, cwd=str(harness.REPO_ROOT))


def run_job(layout, out, *extra):
    """Runs a whole job to its end; returns the launcher's output."""
    result = harness.run([launcher(layout, out, "--pause", "0", *extra)], timeout=JOB_TIMEOUT)
    output = result.output("launcher")
    assert result.returncodes == {"launcher": 0}, output
    return output


def kill_after(layout, out, victim_name, step):
    """Runs a job until `victim_name` reports global step `step` (counted from 1), then SIGKILLs it."""
    epoch, batch = divmod(step - 1, STEPS_PER_EPOCH)
    progress = f"[{victim_name}] epoch={epoch} batch={batch} pid="
    with harness.start([launcher(layout, out, "--pause", "0.03")]) as processes:
        assert processes.wait_for_output("launcher", progress, timeout=JOB_TIMEOUT / 2), processes.output("launcher")
        line = next(line for line in processes.output("launcher").splitlines() if line.startswith(progress))
        os.kill(int(line.rsplit("pid=", 1)[1]), signal.SIGKILL)
        result = harness.wait(processes, timeout=JOB_TIMEOUT)
    output = result.output("launcher")
    assert result.returncodes["launcher"] != 0, output  # no --max-restarts: the job ends
    assert "was killed by SIGKILL" in output, output
    return output


def resumed_position(output, out):
    resumed = RESUMED.findall(output)
    assert len(resumed) == 1 and resumed[0][0] == str(out / "backup"), output
    return int(resumed[0][1]), int(resumed[0][2])


def results(out, num_processes):
    ranks = [dict(np.load(out / f"rank{rank}.npz")) for rank in range(num_processes)]
    for rank, values in enumerate(ranks[1:], start=1):
        assert all(np.array_equal(ranks[0][key], values[key]) for key in ranks[0]), f"rank {rank} differs"
    return ranks[0]


def mismatches(expected, resumed):
    """Keys beyond float32 tolerance (relative for accumulating metric states; History: the resumed epochs)."""
    assert set(expected) == set(resumed)
    differing = []
    for key, value in resumed.items():
        wanted = expected[key][-len(value):] if key.startswith("history/") else expected[key]
        if wanted.shape != value.shape or not np.allclose(wanted, value, rtol=2e-5, atol=2e-6):
            differing.append(key)
    return differing


def drawn_mid_epoch_step(seed):
    """A kill step drawn by a seeded RNG whose last backup falls inside an epoch (steps of it to skip)."""
    rng = random.Random(seed)
    while True:
        step = rng.randrange(SAVE_FREQ + 1, (EPOCHS - 1) * STEPS_PER_EPOCH)
        if step % STEPS_PER_EPOCH >= SAVE_FREQ:
            return step


CASES = {
    # name: (first layout, name of the process killed, relaunch layout, processes after)
    "3_to_2": (["--nproc", "3"], "worker-1", ["--nproc", "2"], 2),
    "2_to_3": (["--nproc", "2"], "worker-0", ["--workers", "2", "--chief"], 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_job_relaunched_on_another_number_of_processes_equals_the_uninterrupted_job(tmp_path, reference, case):
    first, victim, relaunch, num_after = CASES[case]
    step = drawn_mid_epoch_step(24 + num_after)
    out = tmp_path / "job"
    out.mkdir()
    kill_after(first, out, victim, step)
    control = tmp_path / "control"
    shutil.copytree(out, control)

    output = run_job(relaunch, out)
    epoch, steps = resumed_position(output, out)
    # The backup means the step it names: at most SAVE_FREQ steps before the kill, inside an epoch.
    assert step - SAVE_FREQ <= epoch * STEPS_PER_EPOCH + steps <= step and steps > 0, (step, epoch, steps)
    resumed = results(out, num_after)
    assert len(resumed["history/loss"]) == EPOCHS - epoch
    assert int(resumed["optimizer/0"]) == EPOCHS * STEPS_PER_EPOCH  # iterations
    assert mismatches(reference, resumed) == []

    if case == "3_to_2":
        # The uninterrupted job itself (3 processes), not only plain Keras.
        uninterrupted = tmp_path / "uninterrupted"
        uninterrupted.mkdir()
        run_job(first, uninterrupted)
        assert mismatches(results(uninterrupted, 3), resumed) == []

    # Negative control: the same relaunch, but the resumed epoch trains the backup's steps again.
    output = run_job(relaunch, control, "--fault", "unskipped_resume_steps")
    assert resumed_position(output, control) == (epoch, 0)
    assert "weight/0" in mismatches(reference, results(control, num_after))


PER_RANK_SCRIPT = str(Path(__file__).parent / "scripts" / "per_rank_resume.py")


def _launch_per_rank(nproc, out_dir, stop_at):
    argv = [sys.executable, "-m", "kdist", "launch", "--nproc", str(nproc), "--grace", "2",
            PER_RANK_SCRIPT, str(out_dir), str(stop_at)]
    return subprocess.run(argv, cwd=str(harness.REPO_ROOT), capture_output=True, text=True,
                          timeout=240)


@pytest.mark.timeout(400)
def test_a_mid_epoch_backup_of_input_split_per_rank_is_refused_on_another_world_size(tmp_path):
    # The first job stops in epoch 0 right after its backup of step 4 (save_freq=2).
    first = _launch_per_rank(2, tmp_path, stop_at=3)
    assert first.returncode == 3, first.stderr[-3000:]

    resumed = _launch_per_rank(3, tmp_path, stop_at=-1)

    assert resumed.returncode != 0, resumed.stderr[-3000:]
    assert "InvalidArgumentError" in resumed.stderr, resumed.stderr[-3000:]
    assert "by a job of 2 processes; this job has 3, and its input is split per rank" in resumed.stderr
    # Control: the same backup on the same number of processes resumes.
    same = _launch_per_rank(2, tmp_path, stop_at=-1)
    assert same.returncode == 0, same.stderr[-3000:]
    assert "resumed from backup" in same.stderr and "epoch 0, step 4" in same.stderr, same.stderr[-3000:]
