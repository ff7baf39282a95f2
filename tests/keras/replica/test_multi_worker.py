"""MultiWorkerMirroredStrategy in real processes (gloo on loopback) against plain Keras.

Each run starts 2 or 3 real processes through `tests.harness`; each writes its
weights, optimizer slots, metric variables, History, evaluate and predict
results (`workers/fit_equivalence.py`). They must be bitwise identical across
ranks and match one-process plain Keras on the same global batches to 1e-5.
The negative controls switch on one deliberate bug each and check that the
comparison then fails while the ranks still agree with each other: that is the
failure a rank-vs-rank check alone would never see.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import harness
from tests.keras.workers import fit_equivalence

WORKER = Path(fit_equivalence.__file__)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reference():
    """Plain Keras, one process, seeded like rank 0."""
    return fit_equivalence.train()


@pytest.fixture(scope="module")
def loader_reference():
    """Plain Keras from a shuffling DataLoader, seeded like rank 0."""
    return fit_equivalence.train(input_kind="loader")


def run_job(tmp_path, num_processes, *args, envs=None, timeout=150):
    envs = envs or harness.torchrun_envs(num_processes)
    specs = harness.python_specs(envs, WORKER, "--out", str(tmp_path), *args)
    harness.run(specs, timeout=timeout).check()
    return load_ranks(tmp_path, num_processes)


def load_ranks(directory, num_processes):
    return [dict(np.load(Path(directory) / f"rank{rank}.npz")) for rank in range(num_processes)]


def assert_ranks_identical(ranks):
    for rank, results in enumerate(ranks[1:], start=1):
        assert results.keys() == ranks[0].keys()
        for key in ranks[0]:
            assert np.array_equal(ranks[0][key], results[key]), f"rank {rank} differs from rank 0 in {key}"


def differences(reference, results):
    """Largest difference per key (every key the reference has must be present).

    Absolute, except for metric variables: those accumulate (a loss total over
    an epoch reaches hundreds), so one float32 ulp of them is above 1e-5; they
    are compared relative to their magnitude (at least 1).
    """
    assert set(reference) == set(results), set(reference) ^ set(results)
    diffs = {}
    for key, value in reference.items():
        value = np.asarray(value, dtype="float64")
        if not np.size(value):
            diffs[key] = 0.0
            continue
        diff = float(np.max(np.abs(value - results[key])))
        if key.startswith("metric/"):
            diff /= max(1.0, float(np.max(np.abs(value))))
        diffs[key] = diff
    return diffs


def assert_matches(reference, results):
    worst = {key: diff for key, diff in differences(reference, results).items() if diff > TOLERANCE}
    assert not worst, f"differs from plain Keras beyond {TOLERANCE}: {worst}"


@pytest.mark.parametrize("num_processes", [2, 3])
def test_processes_match_plain_keras(tmp_path, reference, num_processes):
    # 3 processes split the global batch of 64 as 22/21/21 and the last batch of
    # 40 as 14/13/13, so an unweighted mean would show. Keras' get_metrics_result
    # is patched to reduce metrics across processes as later Keras releases do:
    # kdist must not let that reduce them a second time.
    ranks = run_job(tmp_path, num_processes, "--simulate-upstream-ddp-metrics")
    assert_ranks_identical(ranks)
    assert_matches(reference, ranks[0])


def test_processes_with_two_local_devices_each_match_plain_keras(tmp_path, reference):
    ranks = run_job(tmp_path, 2, "--local-devices", "2")
    assert_ranks_identical(ranks)
    assert_matches(reference, ranks[0])


def test_processes_training_from_a_shuffling_dataloader_match_plain_keras(tmp_path, loader_reference):
    # Every rank's RandomSampler draws its seed from torch's global generator,
    # so every rank must hold rank 0's state, and rank 0 the plain run's: kdist
    # must not change when the DataLoader is iterated (Keras calls iter() on it
    # at every epoch's end too, which draws from that generator).
    ranks = run_job(tmp_path, 2, "--input", "loader")
    assert_ranks_identical(ranks)
    assert_matches(loader_reference, ranks[0])


@pytest.mark.parametrize(
    "fault, input_kind, num_processes, broken_keys",
    [
        # Without rank 0's shuffle order every rank trains on a different
        # permutation: still identical to each other (gradients are
        # all-reduced), but not the samples plain Keras sees. From a
        # DataLoader (its sampler seeds from torch's global generator): Keras
        # 3.16 seeds array shuffles with its own epoch counter, not the
        # random state, so with arrays the control would not bite there.
        ("unshared_random_state", "loader", 2, "weight/"),
        # A DistributedDataParallel wrap would average raw gradients over ranks
        # before kdist's weighted sum: wrong with uneven shards (22/21/21).
        ("ddp_averaged_gradients", "arrays", 3, "weight/"),
        # Keras' own (patched, upstream-like) get_metrics_result sums the
        # already-combined metrics again.
        ("upstream_metrics_result", "arrays", 2, "history/"),
    ],
)
def test_negative_controls_fail_the_comparison(request, tmp_path, fault, input_kind, num_processes, broken_keys):
    reference = request.getfixturevalue("loader_reference" if input_kind == "loader" else "reference")
    ranks = run_job(
        tmp_path, num_processes, "--fault", fault, "--simulate-upstream-ddp-metrics", "--input", input_kind
    )
    assert_ranks_identical(ranks)
    diffs = differences(reference, ranks[0])
    broken = {key: diff for key, diff in diffs.items() if key.startswith(broken_keys) and diff > 1e-3}
    assert broken, f"the {fault} bug went unnoticed: {diffs}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (one per process, NCCL)")
def test_nccl_processes_match_plain_keras(tmp_path, reference):
    # Each process drives cuda:LOCAL_RANK, so the group uses NCCL; GPU kernels
    # sum in a different order than the reference, hence the looser tolerance.
    ranks = run_job(tmp_path, 2)
    assert_ranks_identical(ranks)
    worst = {key: diff for key, diff in differences(reference, ranks[0]).items() if diff > 1e-4}
    assert not worst, worst


def test_malformed_communication_options_are_refused_before_joining():
    import kdist

    with pytest.raises(kdist.errors.InvalidArgumentError, match="timeout_seconds"):
        kdist.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(kdist.errors.InvalidArgumentError, match="communication_options"):
        kdist.MultiWorkerMirroredStrategy(communication_options={"timeout_seconds": 5})


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
