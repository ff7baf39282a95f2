"""Mirrored equivalence on every backend: 2 replicas match plain single-device Keras.

`equivalence_worker.py` trains the same model, weights and global batches
under `kdist.MirroredStrategy(["cpu:0", "cpu:1"])` and with plain Keras, and
reports the largest difference of weights, optimizer variables, History,
`evaluate` and `predict`. A negative control (plain Keras at half the batch
size, the classic per-replica/global mix-up) must differ, so the comparison
can fail.
"""

from pathlib import Path

import pytest

from tests.backends import _matrix

WORKER = Path(__file__).with_name("equivalence_worker.py")
TOLERANCE = 1e-5
# A real difference in what was trained: well above float noise.
NEGATIVE_CONTROL_MINIMUM = 1e-2

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("backend", _matrix.BACKENDS)
def test_two_replicas_match_plain_keras(backend):
    _matrix.require_installed(backend)
    output = _matrix.run_worker(WORKER, backend)
    [result] = _matrix.lines(output, "RESULT")
    assert result["backend"] == backend and result["num_replicas_in_sync"] == 2
    assert result["iterations"][0] == result["iterations"][1] > 0, result
    compared = {"weights": result["weights"], "optimizer_variables": result["optimizer_variables"],
                "evaluate": result["evaluate"], "predict": result["predict"],
                **{f"history/{key}": value for key, value in result["history"].items()}}
    assert {"history/loss", "history/accuracy", "history/val_loss", "history/val_accuracy"} <= set(compared)
    too_far = {name: value for name, value in compared.items() if value > TOLERANCE}
    assert not too_far, f"{backend}: differences above {TOLERANCE}: {too_far}"
    assert result["negative_control_weights"] > NEGATIVE_CONTROL_MINIMUM, result
