"""`examples/ps_async_digits.py` under `kdist launch --ps 2 --workers 2`: one list of callbacks, the chief writes.

Every worker passes the same `ModelCheckpoint` (the example filters nothing
by hand); `kdist.keras.chief_only` drops it, and the progress bar, on worker 1.
The shared `--out-dir` then holds exactly the chief's files, and worker 1's
output shows no progress and no skipped save. The chief's lines are the
control: the same check finds its progress, its checkpoints and its report.
"""

import sys

import pytest

from tests import harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

SCRIPT = harness.REPO_ROOT / "examples" / "ps_async_digits.py"
EPOCHS = 2


def test_every_worker_passes_the_same_callbacks_and_only_the_chief_writes(tmp_path):
    out_dir = tmp_path / "out"
    argv = (sys.executable, "-m", "kdist", "launch", "--ps", "2", "--workers", "2", "--timeout", "300",
            str(SCRIPT), "--small", "--epochs", str(EPOCHS), "--min-accuracy", "0", "--out-dir", str(out_dir))
    result = harness.run([harness.ProcessSpec("launch", argv, {"GRPC_ENABLE_FORK_SUPPORT": "0"})], timeout=360)
    output = result.output("launch")
    assert result.returncodes["launch"] == 0, harness.format_outputs(result.processes)

    assert sorted(path.name for path in out_dir.iterdir()) == ["digits_mlp.keras", "epoch01.keras", "epoch02.keras"]
    chief = [line for line in output.splitlines() if line.startswith("[worker-0]")]
    other = [line for line in output.splitlines() if line.startswith("[worker-1]")]
    assert any(f"Epoch {EPOCHS}/{EPOCHS}" in line for line in chief), output  # the control
    assert any('"example": "ps_async_digits"' in line for line in chief), output
    assert any("worker 1: test accuracy" in line for line in other), output  # worker 1 trained
    assert not any("Epoch " in line or "was skipped" in line for line in other), output
