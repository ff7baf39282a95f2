"""The same training script, unchanged, under each way of starting a job.

`kdist launch --nproc 2`, `torchrun --standalone --nproc_per_node 2` (whose agent
hosts the rendezvous store), and hand-written `TF_CONFIG` per process. Each
run must match one-process plain Keras (see test_multi_worker.py).
"""

import sys

from tests import harness
from tests.keras.replica.test_multi_worker import WORKER, assert_matches, assert_ranks_identical, load_ranks, reference  # noqa: F401


def run_single_command(tmp_path, *argv):
    spec = harness.ProcessSpec("launcher", (sys.executable, *argv, str(WORKER), "--out", str(tmp_path)))
    result = harness.run([spec], timeout=180)
    result.check()
    return result


def test_kdist_launch(tmp_path, reference):  # noqa: F811
    result = run_single_command(tmp_path, "-m", "kdist", "launch", "--nproc", "2")
    assert "[worker-1] rank 1 of 2 done" in result.output("launcher")
    ranks = load_ranks(tmp_path, 2)
    assert_ranks_identical(ranks)
    assert_matches(reference, ranks[0])


def test_torchrun_standalone(tmp_path, reference):  # noqa: F811
    run_single_command(tmp_path, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    ranks = load_ranks(tmp_path, 2)
    assert_ranks_identical(ranks)
    assert_matches(reference, ranks[0])


def test_hand_written_tf_config(tmp_path, reference):  # noqa: F811
    specs = harness.python_specs(harness.tf_config_envs(workers=2), WORKER, "--out", str(tmp_path))
    harness.run(specs, timeout=150).check()
    ranks = load_ranks(tmp_path, 2)
    assert_ranks_identical(ranks)
    assert_matches(reference, ranks[0])
