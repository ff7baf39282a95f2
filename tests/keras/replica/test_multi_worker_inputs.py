"""Ranks whose inputs differ in length agree on the number of steps instead of hanging."""

from pathlib import Path

from tests import harness
from tests.keras.workers import uneven_inputs

WORKER = Path(uneven_inputs.__file__)


def test_uneven_generators_and_datasets_stop_together():
    result = harness.run(harness.python_specs(harness.torchrun_envs(2), WORKER), timeout=120)
    result.check()
    outputs = [result.output(f"worker-{rank}") for rank in range(2)]
    for output in outputs:
        assert "UNEVEN OK" in output, output
    digests = [line for output in outputs for line in output.splitlines() if line.startswith("DIGEST")]
    assert len(digests) == 2 and digests[0] == digests[1], digests  # identical weights and logs
