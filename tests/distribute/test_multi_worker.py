"""The Strategy API and the process collectives of MultiWorkerMirroredStrategy, in real processes."""

import sys
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


def test_a_stalled_rank_is_named_within_the_timeout(tmp_path):
    done = tmp_path / "diagnosed"
    result = harness.run(harness.python_specs(harness.torchrun_envs(2), WORKER, "--stall", done), timeout=120)
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


SINGLE_WORKER = Path(__file__).parent / "workers" / "single_worker.py"
NO_CLUSTER = {name: None for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def test_no_cluster_in_the_environment_warns_once_how_to_launch_several():
    warned_line = next(
        number
        for number, line in enumerate(SINGLE_WORKER.read_text().splitlines(), start=1)
        if line.endswith("# WARNED LINE")
    )
    argv = (sys.executable, str(SINGLE_WORKER))
    (_, torchrun_env), (_, tf_config_env) = harness.torchrun_envs(1)[0], harness.tf_config_envs(1)[0]
    specs = [
        harness.ProcessSpec("plain", argv, NO_CLUSTER),
        harness.ProcessSpec("explicit", (*argv, "--explicit"), NO_CLUSTER),
        harness.ProcessSpec("torchrun", argv, {**NO_CLUSTER, **torchrun_env}),
        harness.ProcessSpec("tf-config", argv, {**NO_CLUSTER, **tf_config_env}),
    ]
    result = harness.run(specs, timeout=120).check()

    plain = result.output("plain", "stderr")
    assert plain.count("runs as a single worker") == 1, plain
    assert f"single_worker.py:{warned_line}: UserWarning" in plain, plain  # The user's line.
    for advice in ("kdist launch --nproc N script.py", "torchrun", "TF_CONFIG", "local_cluster_resolver()"):
        assert advice in plain, plain
    # A cluster named on purpose, even of one process, is not warned about.
    for name in ("explicit", "torchrun", "tf-config"):
        assert "single worker" not in result.output(name), result.output(name)
    for name in ("plain", "explicit", "torchrun", "tf-config"):
        assert "REPLICAS 1" in result.output(name, "stdout")
