"""TensorFlow's parameter-server tutorial, renamed to kdist (`examples/ps_tutorial.py`), end to end.

In process (the tutorial's own in-process cluster: kdist `Server` objects the
program drops, a resolver that names no task) and under `kdist launch --ps 1
--workers 2 --chief`. Each checks that it trains, that `ModelCheckpoint`,
`BackupAndRestore` and the custom loop's checkpoint are written on the
coordinator, that `optimizer.iterations` equals the steps run, and that a
preempted run resumes from the saved epoch (the tutorial's two recipes).
"""

import json
import sys

import pytest

from tests import harness

pytestmark = pytest.mark.timeout(600)

SCRIPT = harness.REPO_ROOT / "examples" / "ps_tutorial.py"
PREEMPTED = 3
FIT_EPOCHS, FIT_STEPS_PER_EPOCH = 5, 20
LOOP_EPOCHS, LOOP_STEPS_PER_EPOCH = 4, 5
PREEMPT_AFTER = 2


def _run(name, argv, expected_code, timeout):
    result = harness.run([harness.ProcessSpec(name, tuple(argv), {"GRPC_ENABLE_FORK_SUPPORT": "0"})],
                         timeout=timeout)
    output = result.output(name)
    assert result.returncodes[name] == expected_code, harness.format_outputs(result.processes)
    return output


def _result(output):
    lines = [line for line in output.splitlines() if "result {" in line]
    assert len(lines) == 1, output
    return json.loads(lines[0].split("result ", 1)[1])


def _in_process(working_dir, *args, expected_code=0):
    argv = [sys.executable, str(SCRIPT), "--working-dir", str(working_dir), *args]
    return _run("tutorial", argv, expected_code, timeout=240)


def _launched(working_dir, *args, expected_code=0):
    argv = [sys.executable, "-m", "kdist", "launch", "--ps", "1", "--workers", "2", "--chief",
            "--timeout", "400", str(SCRIPT), "--working-dir", str(working_dir), *args]
    return _run("launch", argv, expected_code, timeout=480)


def check_preempted_fit_wrote_its_files(working_dir):
    """After a fit preempted at epoch 2: the coordinator's checkpoint and backup are on disk."""
    assert (working_dir / "ckpt.keras").is_file()
    assert (working_dir / "backup" / "latest.weights.h5").is_file()
    metadata = json.loads((working_dir / "backup" / "training_metadata.json").read_text())
    assert metadata["epoch"] == PREEMPT_AFTER
    # The tutorial's unchanged TensorBoard callback: Keras' own where TensorFlow and
    # tensorboard are installed, kdist's tensorboardX writer where they are not.
    assert list((working_dir / "log" / "train").glob("events.out.tfevents.*"))


def check_resumed_run(result, working_dir, loop_resumed):
    assert result["is_chief"] is True
    # Model.fit: BackupAndRestore resumed after epoch 2, and the count of steps
    # applied covers both runs.
    assert result["fit_epochs"] == list(range(PREEMPT_AFTER, FIT_EPOCHS))
    assert result["fit_iterations"] == FIT_EPOCHS * FIT_STEPS_PER_EPOCH
    assert result["fit_checkpoint"] is True
    # The tutorial fits random targets in [0, 1): the loss need not fall epoch by
    # epoch, but a run that trains stays well below what diverging would give.
    assert all(0.0 <= loss < 1.0 for loss in result["fit_loss"]), result["fit_loss"]
    assert not (working_dir / "backup").exists()  # removed after a completed fit, as in Keras
    # Custom loop: `optimizer.iterations` restored from the checkpoint says where to start.
    assert result["loop_starting_epoch"] == (PREEMPT_AFTER if loop_resumed else 0)
    assert len(result["loop_accuracies"]) == LOOP_EPOCHS - result["loop_starting_epoch"]
    assert result["loop_iterations"] == LOOP_EPOCHS * LOOP_STEPS_PER_EPOCH
    assert (working_dir / "loop_checkpoints" / "ckpt.weights.h5").is_file()
    for key in ("loop_direct_eval_accuracy", "loop_distributed_eval_accuracy"):
        assert 0.0 <= result[key] <= 1.0
    assert result["loop_final_loss"] == result["loop_final_loss"]  # not NaN


def test_tutorial_in_process_trains_checkpoints_and_resumes(tmp_path):
    # 1. Model.fit, preempted after epoch 2.
    output = _in_process(tmp_path, "--part", "fit", "--preempt-after-epoch", str(PREEMPT_AFTER),
                         expected_code=PREEMPTED)
    assert "preempted after epoch 2" in output
    check_preempted_fit_wrote_its_files(tmp_path)
    # 2. The custom loop, preempted after epoch 2 (it saves a checkpoint per epoch).
    output = _in_process(tmp_path, "--part", "loop", "--preempt-after-epoch", str(PREEMPT_AFTER),
                         expected_code=PREEMPTED)
    assert "Finished epoch 1," in output and "Finished epoch 2," not in output
    # 3. The whole tutorial again: both parts resume where they stopped.
    output = _in_process(tmp_path, "--part", "all")
    check_resumed_run(_result(output), tmp_path, loop_resumed=True)
    assert "Finished epoch 0," not in output and "Finished epoch 3," in output


def test_tutorial_under_kdist_launch_trains_checkpoints_and_resumes(tmp_path):
    output = _launched(tmp_path, "--part", "fit", "--preempt-after-epoch", str(PREEMPT_AFTER),
                       expected_code=PREEMPTED)
    assert "[chief-0] preempted: preempted after epoch 2" in output
    check_preempted_fit_wrote_its_files(tmp_path)
    output = _launched(tmp_path, "--part", "all")
    check_resumed_run(_result(output), tmp_path, loop_resumed=False)
