"""Chief-only side effects, collective saves, and surviving a killed worker (real processes)."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

from kdist import atomic_files
from tests import harness
from tests.keras.replica.test_multi_worker import assert_matches, assert_ranks_identical, load_ranks
from tests.keras.workers import checkpointing, failing_saves, fit_equivalence

WORKER = Path(checkpointing.__file__)
COLLECTIVE_TIMEOUT = 20.0

_LOAD_WITHOUT_KDIST = """
import os, sys
os.environ["KERAS_BACKEND"] = "torch"
import keras, numpy as np
sys.path.insert(0, sys.argv[3])
from tests.keras.workers.fit_equivalence import SampleCount  # the user's own metric, not kdist
model = keras.saving.load_model(sys.argv[1], custom_objects={"SampleCount": SampleCount})
assert "kdist" not in sys.modules, "the checkpoint needed kdist to load"
x, _ = (np.random.default_rng(0).normal(size=(1000, 12)).astype("float32"), None)
np.save(sys.argv[2], model.predict(x[:333], batch_size=64, verbose=0))
"""


def test_only_the_chief_writes_and_the_checkpoint_loads_in_plain_keras(tmp_path):
    specs = harness.python_specs(harness.torchrun_envs(2), WORKER, "--mode", "chief_only", "--dir", str(tmp_path))
    harness.run(specs, timeout=150).check()

    checkpoints = sorted(os.listdir(tmp_path / "checkpoints"))
    logs = sorted(os.listdir(tmp_path / "logs"))
    assert checkpoints == ["model.keras"], checkpoints  # no second copy, no stray temporary file
    assert logs == ["training.csv"], logs
    rows = (tmp_path / "logs" / "training.csv").read_text().strip().splitlines()
    assert rows[0].startswith("epoch") and len(rows) == 1 + 2, rows  # header + one row per epoch

    ranks = load_ranks(tmp_path, 2)
    assert_ranks_identical(ranks)
    # A process that never imports kdist loads the checkpoint and predicts what rank 0 predicted.
    predictions = tmp_path / "plain_predictions.npy"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_KDIST, str(tmp_path / "checkpoints" / "model.keras"), str(predictions),
         str(harness.REPO_ROOT)],
        check=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    np.testing.assert_allclose(np.load(predictions), ranks[0]["predict"], atol=1e-6)


def test_a_rank_saving_to_a_path_of_its_own_writes_it_as_the_tensorflow_tutorial_expects(tmp_path):
    # tf.distribute's multi-worker tutorial: the chief saves to the real path, every other
    # worker to a temporary directory of its own, which it then removes (and which must exist).
    specs = harness.python_specs(harness.torchrun_envs(2), WORKER, "--mode", "own_paths", "--dir", str(tmp_path))
    harness.run(specs, timeout=150).check()
    assert sorted(os.listdir(tmp_path)) == ["model.keras", "model.weights.h5", "rank0.npz", "rank1.npz"]
    ranks = [dict(np.load(tmp_path / f"rank{rank}.npz")) for rank in range(2)]
    for results in ranks:
        np.testing.assert_array_equal(results["reloaded_predict"], results["predict"])
        np.testing.assert_array_equal(results["weights_predict"], results["predict"])
    np.testing.assert_array_equal(ranks[0]["predict"], ranks[1]["predict"])


@pytest.fixture(scope="module")
def uninterrupted_reference():
    return fit_equivalence.train(epochs=4)


def test_killed_worker_fails_the_survivor_and_backup_resumes_to_the_same_result(tmp_path, uninterrupted_reference):
    arguments = ("--mode", "backup", "--dir", str(tmp_path), "--epochs", "4", "--timeout", str(COLLECTIVE_TIMEOUT))
    specs = harness.python_specs(harness.torchrun_envs(2), WORKER, *arguments, "--slow")
    # A long grace: the survivor must stop on its own, through kdist's error.
    with harness.start(specs, grace=COLLECTIVE_TIMEOUT + 60) as processes:
        assert processes.wait_for_output("worker-0", "epoch_end=1", timeout=150), processes.output("worker-0")
        assert processes.wait_for_output("worker-0", "epoch=2 batch=3", timeout=60)
        processes.send_signal("worker-1", signal.SIGKILL)
        killed_at = time.monotonic()
        result = harness.wait(processes, timeout=COLLECTIVE_TIMEOUT + 90)
        survivor_seconds = time.monotonic() - killed_at  # an upper bound: every process has ended

    survivor = result.output("worker-0")
    assert result.returncodes["worker-1"] == -signal.SIGKILL
    assert result.returncodes["worker-0"] not in (0, None), survivor
    assert "CollectiveTimeoutError" in survivor, survivor
    assert "Missing rank(s): [1]" in survivor, survivor
    assert survivor_seconds < COLLECTIVE_TIMEOUT + 30, survivor_seconds

    metadata = json.loads((tmp_path / "backup" / "training_metadata.json").read_text())
    assert metadata["epoch"] == 2  # epochs 0 and 1 completed before the kill
    assert not [name for name in os.listdir(tmp_path / "backup") if name.startswith(".kdist-tmp")]

    # The restarted job resumes at epoch 2 and ends where an uninterrupted run ends.
    specs = harness.python_specs(harness.torchrun_envs(2), WORKER, *arguments)
    harness.run(specs, timeout=150).check()
    ranks = load_ranks(tmp_path, 2)
    assert_ranks_identical(ranks)
    assert len(ranks[0]["history/loss"]) == 2  # only epochs 2 and 3 ran
    resumed = {key: value for key, value in ranks[0].items() if not key.startswith("history/")}
    expected = {key: value for key, value in uninterrupted_reference.items() if not key.startswith("history/")}
    assert_matches(expected, resumed)
    assert not (tmp_path / "backup").exists()  # deleted by the chief once training finished



def test_a_collective_save_that_fails_partway_keeps_the_previous_file(tmp_path):
    """The chief's write fails a third of the way (RLIMIT_FSIZE, EFBIG): every rank raises, the old file stays."""
    specs = harness.python_specs(harness.torchrun_envs(2), Path(failing_saves.__file__),
                                 "--mode", "multi_worker_save", "--dir", str(tmp_path))
    harness.run(specs, timeout=240).check()
    chief = json.loads((tmp_path / "multi_worker_save0.json").read_text())
    other = json.loads((tmp_path / "multi_worker_save1.json").read_text())
    assert chief["errors"]["save"] == ["OSError", errno.EFBIG], chief
    assert other["errors"]["save"] == ["KdistError", None], other  # told that the chief failed
    assert chief["after"] == chief["before"] == other["after"]
    assert not [name for name in os.listdir(tmp_path) if name.startswith(atomic_files.TEMPORARY_PREFIX)]
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    with np.load(tmp_path / "first.npz") as first:
        expected = [first[f"arr_{index}"] for index in range(len(first.files))]
    for value, reference in zip(loaded.get_weights(), expected, strict=True):
        np.testing.assert_array_equal(value, reference)
