"""benchmarks/zero_memory.py: its quick size runs both configurations in real processes, and its figures add up."""

import json
import os
import subprocess
import sys

from tests import harness

SCRIPT = harness.REPO_ROOT / "benchmarks" / "zero_memory.py"


def test_quick_run_reports_half_the_optimizer_state_per_rank_of_two():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--size", "quick", "--processes", "2", "--steps", "1", "--warmup", "1"],
        capture_output=True, text=True, timeout=240, cwd=harness.REPO_ROOT,
        env=dict(os.environ, KERAS_BACKEND="torch"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [json.loads(text) for text in done.stdout.splitlines() if text.startswith("{")]
    assert line["what"] == "zero_memory" and line["processes"] == 2
    whole, sharded = line["whole"]["optimizer_state_bytes"], line["sharded"]["optimizer_state_bytes"]
    # AdamW: two float32 moments per parameter, whole on every rank; half of them on each when sharded.
    assert whole == [8 * line["parameters"]] * 2
    assert sum(sharded) == whole[0] and line["state_within_one_unit"] is True
    assert 0.99 <= line["state_ratio"] <= 1.01
    assert all(value > 0 for value in line["whole"]["peak_rss_bytes"] + line["sharded"]["peak_rss_bytes"])
    assert line["step_seconds"]["whole"] > 0 and line["step_seconds"]["sharded"] > 0
