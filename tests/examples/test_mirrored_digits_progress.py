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
EPOCHS = 4
EPOCH_LINE = re.compile(r"^(\d+)/\1 - \d+s - \d+(ms|s|us)/step( - \w+: [-+.\de]+)+$")


def test_small_run_prints_one_line_per_epoch_before_the_json_summary(tmp_path):
    # Four epochs show the progress as twenty do; the CI run of the example (.ci/run)
    # checks that its twenty reach the accuracy, so this one does not ask for it.
    argv = (sys.executable, str(EXAMPLE), "--small", "--epochs", str(EPOCHS), "--min-accuracy", "0",
            "--out-dir", str(tmp_path / "out"))
    # Without PYTHONUNBUFFERED, as a user's `python examples/mirrored_digits.py | tee log`:
    # the progress must still arrive while it trains (Keras flushes each line).
    spec = harness.ProcessSpec("digits", argv, {"PYTHONUNBUFFERED": None})
    with harness.start([spec]) as processes:
        arrived_while_running = processes.wait_for_output("digits", f"Epoch 2/{EPOCHS}\n", timeout=240)
        still_running = processes.returncodes["digits"] is None
        result = harness.wait(processes, timeout=240)
    result.check()
    assert arrived_while_running and still_running, harness.format_outputs(processes)

    stdout = result.output("digits", "stdout")
    assert "\r" not in stdout and "\x08" not in stdout, repr(stdout[:500])
    *progress, last = stdout.splitlines()
    summary = json.loads(last)
    assert summary["example"] == "mirrored_digits" and 0 <= summary["test_accuracy"] <= 1, summary
    epochs = [line for line in progress if line.startswith("Epoch ")]
    lines = [line for line in progress if EPOCH_LINE.match(line)]
    assert epochs[:2] == [f"Epoch 1/{EPOCHS}", f"Epoch 2/{EPOCHS}"]
    assert len(epochs) == len(lines) == summary["epochs_run"], stdout
    assert " - val_loss: " in lines[0] and " - accuracy: " in lines[0], lines[0]
    # Nothing else on stdout: the progress lines, then the JSON line.
    assert len(progress) == 2 * summary["epochs_run"], stdout
