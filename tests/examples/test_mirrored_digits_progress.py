"""The quick start (`examples/mirrored_digits.py`) shows Keras' progress while it trains.

With stdout a pipe, as in a log or CI: "Epoch i/n" and Keras' one line per
epoch arrive while the program runs, without carriage returns, and the JSON
summary comes last.
"""

import json
import re
import sys

import pytest

from tests import harness

pytestmark = pytest.mark.timeout(300)

EXAMPLE = harness.REPO_ROOT / "examples" / "mirrored_digits.py"
# Keras' verbose=2 line: "16/16 - 1s - 63ms/step - accuracy: 0.93 - loss: 0.18 - val_accuracy: ...".
EPOCH_LINE = re.compile(r"^(\d+)/\1 - \d+s - \d+(ms|s|us)/step( - \w+: [-+.\de]+)+$")


def test_small_run_prints_one_line_per_epoch_before_the_json_summary(tmp_path):
    argv = (sys.executable, str(EXAMPLE), "--small", "--out-dir", str(tmp_path / "out"))
    # Without PYTHONUNBUFFERED, as a user's `python examples/mirrored_digits.py | tee log`:
    # the progress must still arrive while it trains (Keras flushes each line).
    spec = harness.ProcessSpec("digits", argv, {"PYTHONUNBUFFERED": None})
    with harness.start([spec]) as processes:
        arrived_while_running = processes.wait_for_output("digits", "Epoch 2/20\n", timeout=240)
        still_running = processes.returncodes["digits"] is None
        result = harness.wait(processes, timeout=240)
    result.check()
    assert arrived_while_running and still_running, harness.format_outputs(processes)

    stdout = result.output("digits", "stdout")
    assert "\r" not in stdout and "\x08" not in stdout, repr(stdout[:500])
    *progress, last = stdout.splitlines()
    summary = json.loads(last)
    assert summary["example"] == "mirrored_digits" and summary["test_accuracy"] >= 0.8, summary
    epochs = [line for line in progress if line.startswith("Epoch ")]
    lines = [line for line in progress if EPOCH_LINE.match(line)]
    assert epochs[:2] == ["Epoch 1/20", "Epoch 2/20"]
    assert len(epochs) == len(lines) == summary["epochs_run"], stdout
    assert " - val_loss: " in lines[0] and " - accuracy: " in lines[0], lines[0]
    # Nothing else on stdout: the progress lines, then the JSON line.
    assert len(progress) == 2 * summary["epochs_run"], stdout
