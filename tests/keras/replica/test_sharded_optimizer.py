"""`MultiWorkerMirroredStrategy(shard_optimizer_state=True)` (ZeRO-1) in real processes (gloo on loopback).

Each job trains every optimizer configuration of `workers/zero_training.py`
(SGD with Nesterov momentum, Adam, AdamW with exclusions, Adagrad, RMSprop,
Lion, clipnorm, global_clipnorm, a schedule, gradient accumulation, EMA) on a
model with a constraint, a frozen layer and a short last batch. Sharded
results must equal the unsharded strategy's bit for bit (weights, History and
the whole optimizer state gathered from the ranks), match plain Keras, and
save checkpoints a plain Keras process loads; checkpoints resume on another
number of processes in both directions. The negative controls apply rank 0's
slice twice or lose the last rank's slice, and must differ.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import h5py
import keras
import numpy as np
import pytest

from tests import harness
from tests.keras.workers import zero_training

WORKER = Path(zero_training.__file__)
CONFIGS = list(zero_training.CONFIGS)
TOLERANCE = 1e-5


def run_job(directory, num_processes, *args):
    directory.mkdir(parents=True, exist_ok=True)
    specs = harness.python_specs(harness.torchrun_envs(num_processes), WORKER, "--out", str(directory), *args)
    result = harness.run(specs, timeout=180).check()
    if "--refusals" in args:
        return None, result
    ranks = [dict(np.load(directory / f"rank{rank}.npz")) for rank in range(num_processes)]
    return ranks, result


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Two-process jobs with whole and with sharded optimizer state, each saving every configuration."""
    root = tmp_path_factory.mktemp("zero")
    whole, _ = run_job(root / "whole", 2, "--save")
    sharded, _ = run_job(root / "sharded", 2, "--save", "--sharded")
    return {"root": root, "whole": whole, "sharded": sharded}


def _assert_ranks_identical(ranks):
    for rank, results in enumerate(ranks[1:], start=1):
        for key, value in ranks[0].items():
            if not key.endswith("slot_elements"):
                assert np.array_equal(value, results[key]), f"rank {rank} differs from rank 0 in {key}"


def _bitwise_differences(expected, got):
    return [key for key in expected if not np.array_equal(expected[key], got[key])]


def test_sharded_state_trains_bit_for_bit_like_the_whole_state(jobs):
    whole, sharded = jobs["whole"], jobs["sharded"]
    _assert_ranks_identical(whole)
    _assert_ranks_identical(sharded)
    assert {key.split("/")[0] for key in sharded[0]} == set(CONFIGS)
    assert _bitwise_differences(whole[0], sharded[0]) == []


def test_the_all_gather_in_many_small_chunks_gives_the_same_bits(jobs, tmp_path):
    # 1024-byte buckets: the slices travel in chunks of 256 floats, which cut through variables.
    ranks, _ = run_job(tmp_path, 2, "--sharded", "--bucket-bytes", "1024", "--configs", "adam,sgd_accumulation")
    _assert_ranks_identical(ranks)
    assert _bitwise_differences({k: v for k, v in ranks[0].items() if not k.endswith("slot_elements")},
                                jobs["whole"][0]) == []


def test_two_replicas_per_process_shard_across_processes_with_the_same_bits(tmp_path):
    configs = "adam,sgd_accumulation,adam_clipnorm"
    whole, _ = run_job(tmp_path / "whole", 2, "--local-replicas", "2", "--configs", configs)
    sharded, _ = run_job(tmp_path / "sharded", 2, "--sharded", "--local-replicas", "2", "--configs", configs)
    _assert_ranks_identical(sharded)
    assert _bitwise_differences(whole[0], sharded[0]) == []


def test_each_rank_holds_its_half_of_the_slots(jobs):
    for name in CONFIGS:
        slots = [value for key, value in jobs["whole"][0].items()
                 if key.startswith(f"{name}/optimizer") and value.ndim > 0]
        whole = sum(value.size for value in slots)
        held = [int(rank[f"{name}/slot_elements"]) for rank in jobs["sharded"]]
        assert sum(held) == whole, (name, held, whole)  # every element's slots on exactly one rank
        # Balanced: slices are cut at multiples of 64 elements within each variable.
        for count in held:
            assert abs(count - whole / 2) <= 64 * len(slots), (name, held, whole)


@pytest.mark.parametrize("name", CONFIGS)
def test_sharded_state_matches_plain_keras(jobs, name):
    expected = zero_training.train_plain(name)
    got = jobs["sharded"][0]
    for key, value in expected.items():
        assert _relative_difference(value, got[key]) <= TOLERANCE, (key, value, got[key])


def _relative_difference(expected, got):
    """Largest difference relative to the magnitude (at least 1); equal values (an infinite loss scale) count 0."""
    expected, got = np.asarray(expected, dtype="float64"), np.asarray(got, dtype="float64")
    if not expected.size:
        return 0.0
    finite = np.isfinite(expected)
    if not np.array_equal(expected[~finite], got[~finite]):
        return np.inf
    scale = max(1.0, float(np.max(np.abs(expected[finite]), initial=0.0)))
    return float(np.max(np.abs(expected[finite] - got[finite]), initial=0.0)) / scale


def test_checkpoints_hold_the_whole_state_and_load_in_plain_keras(jobs):
    root = jobs["root"]
    for name in CONFIGS:
        whole = keras.saving.load_model(root / "whole" / f"{name}.keras")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sharded = keras.saving.load_model(root / "sharded" / f"{name}.keras")
        skipped = [str(w.message) for w in caught if "Skipping variable loading" in str(w.message)]
        assert not skipped, (name, skipped)
        assert len(sharded.optimizer.variables) == len(whole.optimizer.variables) > 2
        for a, b in zip(whole.optimizer.variables + whole.weights, sharded.optimizer.variables + sharded.weights):
            assert np.array_equal(a.numpy(), b.numpy()), (name, a.path)
        # The weights files are the same file: same entries, same values.
        assert _h5_entries(root / "sharded" / f"{name}.weights.h5") == _h5_entries(
            root / "whole" / f"{name}.weights.h5"), name
    # A process that never imports kdist loads a sharded job's file with its whole optimizer state.
    script = (
        "import os, sys\nos.environ['KERAS_BACKEND'] = 'torch'\nimport keras, numpy as np\n"
        "model = keras.saving.load_model(sys.argv[1])\n"
        "assert 'kdist' not in sys.modules\n"
        "np.savez(sys.argv[2], *[v.numpy() for v in model.optimizer.variables])\n"
    )
    out = root / "plain_load.npz"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", script, str(root / "sharded" / "adam.keras"), str(out)],
                   check=True, timeout=120, env=env, cwd=root)
    loaded = list(np.load(out).values())
    expected = [value for key, value in sorted(jobs["whole"][0].items(), key=lambda kv: _optimizer_index(kv[0]))
                if key.startswith("adam/optimizer")]
    assert len(loaded) == len(expected) and all(np.array_equal(a, b) for a, b in zip(loaded, expected))


def _h5_entries(path):
    entries = {}
    with h5py.File(path, "r") as file:
        file.visititems(lambda name, item: entries.__setitem__(name, item[()].tobytes())
                        if isinstance(item, h5py.Dataset) else None)
    return entries


def _optimizer_index(key):
    name = key.split("/")[-1]
    return int(name[len("optimizer"):]) if name.startswith("optimizer") else -1


def test_a_checkpoint_resumes_on_another_number_of_processes_either_way(jobs):
    root = jobs["root"]
    # Three processes: sharded from the whole job's files, whole from the sharded job's files.
    sharded, _ = run_job(root / "resume_sharded", 3, "--sharded", "--resume-from", str(root / "whole"))
    whole, _ = run_job(root / "resume_whole", 3, "--resume-from", str(root / "sharded"))
    _assert_ranks_identical(sharded)
    assert _bitwise_differences(whole[0], sharded[0]) == []
    # And as plain Keras continues from the same file.
    expected = zero_training.train_plain("adam", resume_from=root / "sharded" / "adam.keras", epochs=1)
    for key, value in expected.items():
        assert _relative_difference(value, sharded[0][key]) <= TOLERANCE, key


@pytest.mark.parametrize("fault", ["optimizer_slice_applied_twice", "optimizer_slice_missed"])
def test_control_a_slice_applied_twice_or_missed_differs(jobs, tmp_path, fault):
    ranks, _ = run_job(tmp_path, 2, "--sharded", "--configs", "adam", "--fault", fault)
    weights = [key for key in ranks[0] if key.startswith("adam/weight")]
    assert [key for key in weights if not np.array_equal(ranks[0][key], jobs["whole"][0][key])]


def test_optimizers_that_cannot_be_split_are_refused_at_compile(tmp_path):
    _, result = run_job(tmp_path, 1, "--sharded", "--refusals")
    assert "REFUSALS OK" in result.output("worker-0", "stdout")
