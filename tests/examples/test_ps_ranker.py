"""`examples/ps_ranker.py`: keras-rs rankers on 2 parameter servers, tables split by rows (issue 36 item 7).

With one worker, asynchronous training is sequential, so a DCN and a DLRM ranker
built from `keras_rs.layers` under `kdist launch --ps 2 --workers 1` end equal to
plain Keras on the same batches (every weight, tables included; measured 0.0).
With two workers the run is asynchronous: both train, the chief reports rows
updated on both servers, and the weights differ from the one-worker run (the
control that the comparison can fail).
"""

import sys

import numpy as np
import pytest

from tests import harness

pytest.importorskip("keras_rs", reason="keras-rs is a test extra: pip install -e '.[test]'")
sys.path.insert(0, str(harness.REPO_ROOT / "examples"))
import ps_ranker as example  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
SCRIPT = harness.REPO_ROOT / "examples" / "ps_ranker.py"
TOLERANCE = 1e-6


def _launch(tmp_path, num_workers, model):
    out = tmp_path / f"{model}_{num_workers}.npz"
    argv = (sys.executable, "-m", "kdist", "launch", "--ps", "2", "--workers", str(num_workers), "--timeout", "300",
            str(SCRIPT), "--small", "--model", model, "--verbose", "0", "--out", str(out))
    result = harness.run([harness.ProcessSpec("launch", argv, {})], timeout=300)
    assert result.returncodes["launch"] == 0, harness.format_outputs(result.processes)
    saved = np.load(out)
    return [saved[f"arr_{index}"] for index in range(len(saved.files))], result.output("launch")


def _difference(weights, reference):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference, strict=True))


@pytest.mark.parametrize("model", ["dcn", "dlrm"])
def test_one_worker_on_two_parameter_servers_equals_plain_keras(model, tmp_path):
    plain, _ = example.train(example.parse_args(["--small", "--model", model, "--verbose", "0"]))
    weights, output = _launch(tmp_path, 1, model)
    assert '"num_ps": 2' in output
    assert _difference(weights, plain.get_weights()) < TOLERANCE


def test_two_asynchronous_workers_train_on_both_servers(tmp_path):
    one, _ = _launch(tmp_path, 1, "dcn")
    two, output = _launch(tmp_path, 2, "dcn")
    report = next(line for line in output.splitlines() if '"example": "ps_ranker"' in line)
    rows = [int(n) for n in report.split('"rows_updated": [')[1].split("]")[0].split(",")]
    assert len(rows) == 2 and all(n > 0 for n in rows), report  # every table's rows live on both servers
    assert _difference(two, one) > 1e-3
