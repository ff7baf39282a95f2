"""A fit resumed from a mid-epoch `BackupAndRestore(save_freq=S)` backup ends equal to an uninterrupted one.

One process (one device, two logical replicas; shuffled arrays and a
`PyDataset`) and two real gloo processes (a rank killed with SIGKILL
mid-epoch, then the job relaunched). Interruptions fall at steps drawn by a
seeded RNG; step 14 always resumes an epoch whose steps were all saved.
Negative controls: a resume that trains the saved steps again, and one that
restores the optimizer without its iterations, fail the comparison.
"""

import json
import re
import signal
from pathlib import Path

import numpy as np
import pytest

import kdist
from kdist import faults
from kdist.errors import KdistError
from tests import harness
from tests.keras import step_resume_run as run

TOTAL_STEPS = run.EPOCHS * run.STEPS_PER_EPOCH
DRAWN_STEPS = sorted(int(s) for s in np.random.default_rng(24).choice(np.arange(5, TOTAL_STEPS), 2, replace=False))
STRATEGIES = {
    "one_device": lambda: kdist.MirroredStrategy(["cpu:0"]),
    "two_replicas": lambda: kdist.MirroredStrategy(["cpu:0", "cpu:1"]),
}
_references = {}


def reference(strategy_name, input_kind):
    key = (strategy_name, input_kind)
    if key not in _references:
        _references[key] = run.train(STRATEGIES[strategy_name](), input_kind, seed=0)
    return _references[key]


def mismatches(expected, resumed):
    """Keys whose values differ beyond float32 tolerance (History: the epochs the resumed fit ran)."""
    assert set(expected) == set(resumed)
    differing = []
    for key, value in resumed.items():
        wanted = expected[key]
        if key.startswith("history/"):
            wanted = wanted[len(wanted) - len(value):]
        if wanted.shape != value.shape or not np.allclose(wanted, value, rtol=2e-5, atol=2e-6):
            differing.append(key)
    return differing


def interrupt_and_resume(tmp_path, strategy_name, input_kind, stop):
    backup = str(tmp_path / "backup")
    with pytest.raises(run.Interrupted):
        run.train(STRATEGIES[strategy_name](), input_kind, backup_dir=backup, interrupt_at=stop, seed=0)
    metadata = json.loads((tmp_path / "backup" / "training_metadata.json").read_text())
    # Another seed: everything the resumed run depends on must come from the backup.
    resumed = run.train(STRATEGIES[strategy_name](), input_kind, backup_dir=backup, seed=99)
    return metadata, resumed


@pytest.mark.parametrize("stop", [*DRAWN_STEPS, 14])
@pytest.mark.parametrize("input_kind", ["arrays", "py_dataset"])
def test_one_device_resume_equals_the_uninterrupted_run(tmp_path, capfd, input_kind, stop):
    metadata, resumed = interrupt_and_resume(tmp_path, "one_device", input_kind, stop)
    epoch, steps = metadata["epoch"], metadata["kdist_step"]["steps"]
    saved = epoch * run.STEPS_PER_EPOCH + steps
    assert saved == stop // run.SAVE_FREQ * run.SAVE_FREQ  # the backup means exactly the step it names
    assert f"[kdist] resumed from backup {tmp_path / 'backup'}: epoch {epoch}, step {steps}" in capfd.readouterr().err
    assert len(resumed["history/loss"]) == run.EPOCHS - epoch
    assert mismatches(reference("one_device", input_kind), resumed) == []
    assert int(resumed["optimizer/0"]) == TOTAL_STEPS  # iterations


def test_two_replica_resume_equals_the_uninterrupted_run(tmp_path):
    _, resumed = interrupt_and_resume(tmp_path, "two_replicas", "arrays", DRAWN_STEPS[0])
    assert mismatches(reference("two_replicas", "arrays"), resumed) == []


@pytest.mark.parametrize("switch", ["unskipped_resume_steps", "resume_without_iterations"])
def test_negative_controls_fail_the_comparison(tmp_path, switch):
    with faults.injected(**{switch: True}):
        metadata, resumed = interrupt_and_resume(tmp_path, "one_device", "arrays", 10)
    assert metadata["kdist_step"]["steps"] == 2  # resumed mid-epoch
    differing = mismatches(reference("one_device", "arrays"), resumed)
    assert "weight/0" in differing and "predict" in differing
    assert "optimizer/0" in differing  # iterations: 2 steps too many, or counted from 0


def test_a_torn_backup_is_refused(tmp_path):
    backup = tmp_path / "backup"
    with pytest.raises(run.Interrupted):
        run.train(STRATEGIES["one_device"](), backup_dir=str(backup), interrupt_at=10, seed=0)
    metadata = json.loads((backup / "training_metadata.json").read_text())
    metadata["kdist_step"]["iterations"] = 4  # as if the metadata of the previous save survived a crash
    (backup / "training_metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(KdistError, match="inconsistent: its weights file holds an optimizer at iteration 8"):
        run.train(STRATEGIES["one_device"](), backup_dir=str(backup), seed=0)


def test_killed_rank_relaunched_job_equals_the_uninterrupted_run(tmp_path):
    script = Path(run.__file__)
    kill_after = DRAWN_STEPS[0]
    specs = harness.python_specs(harness.torchrun_envs(2), script, "--dir", str(tmp_path), "--pause", "0.3")
    with harness.start(specs, grace=5) as processes:
        assert processes.wait_for_output("worker-0", f"step={kill_after}", timeout=90), processes.output("worker-0")
        processes.send_signal("worker-1", signal.SIGKILL)
        processes.send_signal("worker-0", signal.SIGKILL)  # as a launcher restarting the whole job would
        result = harness.wait(processes, timeout=30)
    assert result.returncodes["worker-1"] == -signal.SIGKILL
    metadata = json.loads((tmp_path / "backup" / "training_metadata.json").read_text())
    saved = metadata["epoch"] * run.STEPS_PER_EPOCH + metadata["kdist_step"]["steps"]
    assert 0 < saved <= kill_after + 1 and metadata["kdist_step"]["steps"] > 0

    specs = harness.python_specs(harness.torchrun_envs(2), script, "--dir", str(tmp_path))
    relaunched = harness.run(specs, timeout=120)
    relaunched.check()
    resumed_line = re.findall(r"\[kdist\] resumed from backup .*", relaunched.output("worker-0"))
    assert resumed_line == [f"[kdist] resumed from backup {tmp_path / 'backup'}: epoch {metadata['epoch']}, "
                            f"step {metadata['kdist_step']['steps']}"]
    assert "resumed from backup" not in relaunched.output("worker-1")  # rank 0 only
    ranks = [dict(np.load(tmp_path / f"rank{rank}.npz")) for rank in range(2)]
    assert mismatches(ranks[0], ranks[1]) == []
    expected = run.train(STRATEGIES["one_device"](), seed=0, dropout=False)  # one process on the global batch
    assert mismatches(expected, ranks[0]) == []
