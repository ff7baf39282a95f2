"""The Strategy API and the process collectives of MultiWorkerMirroredStrategy, in real processes."""

from pathlib import Path

import pytest

from tests import harness
from tests.distribute.workers import strategy_api

WORKER = Path(strategy_api.__file__)


@pytest.mark.parametrize("num_processes", [2, 3])
def test_strategy_api_and_collectives_across_processes(num_processes):
    result = harness.run(harness.python_specs(harness.torchrun_envs(num_processes), WORKER), timeout=120)
    result.check()
    for rank in range(num_processes):
        assert "CHECKS PASSED" in result.output(f"worker-{rank}")


def test_a_stalled_rank_is_named_within_the_timeout():
    result = harness.run(harness.python_specs(harness.torchrun_envs(2), WORKER, "--stall"), timeout=120)
    result.check()
    survivor = result.output("worker-0")
    assert "DIAGNOSED missing=[1]" in survivor, survivor
    assert "rank 1 is alive but stalled" in survivor, survivor
    seconds = float(survivor.split(" after ")[1].split("s:")[0])
    assert seconds < 4 + 30, seconds


def test_tf_config_cluster_with_a_chief_maps_chief_to_rank_0():
    envs = harness.tf_config_envs(workers=1, chief=True)
    result = harness.run(harness.python_specs(envs, WORKER), timeout=120)
    result.check()
    assert {name for name, _ in envs} == {"chief-0", "worker-0"}
