"""Input already split per rank, in 2 real processes (gloo), against plain Keras on the concatenation.

Each rank reads its own batches (`workers/per_rank_input.py`): a `DataLoader`
with a `DistributedSampler`, `distribute_datasets_from_function`, or input
declared with `kdist.distribute.per_rank` (uneven sizes and uneven numbers of
batches per rank). Results must be identical on both ranks and equal plain
Keras trained on the ranks' batches concatenated in rank order, with every
batch of every rank used. Undeclared per-rank input must be refused at the
first batch of the epoch where ranks differ with `InputMismatchError`, and a
refusal decided on one rank must reach every rank (no collective timeout);
the negative control slices per-rank input again, as before, and the
comparison must then fail.
"""

import re
from pathlib import Path

import numpy as np
import pytest

from tests import harness
from tests.keras.workers import per_rank_input as worker

WORKER = Path(worker.__file__)
TOLERANCE = 1e-5


def run_job(tmp_path, *args, timeout=150):
    specs = harness.python_specs(harness.torchrun_envs(worker.WORLD_SIZE), WORKER, *args)
    result = harness.run(specs, timeout=timeout)
    result.check()
    return result


def load(directory, scenario):
    return [dict(np.load(Path(directory) / f"{scenario}-rank{rank}.npz")) for rank in range(worker.WORLD_SIZE)]


def differences(reference, results):
    assert set(reference) == set(results), set(reference) ^ set(results)
    diffs = {}
    for key, value in reference.items():
        value = np.asarray(value, dtype="float64")
        if value.shape != np.shape(results[key]):
            diffs[key] = float("inf")  # e.g. predictions for half of the samples
            continue
        diff = float(np.max(np.abs(value - results[key]))) if value.size else 0.0
        if key.startswith("metric/"):  # accumulated totals: relative to their size
            diff /= max(1.0, float(np.max(np.abs(value))))
        diffs[key] = diff
    return diffs


@pytest.fixture(scope="module")
def references():
    return {scenario: worker.reference(scenario) for scenario in worker.SCENARIOS}


@pytest.fixture(scope="module")
def equivalence_job(tmp_path_factory):
    directory = tmp_path_factory.mktemp("per_rank")
    run_job(directory, "--job", "equivalence", "--out", str(directory))
    return directory


@pytest.mark.parametrize("scenario", worker.SCENARIOS)
def test_per_rank_input_matches_plain_keras_on_the_concatenation(equivalence_job, references, scenario):
    ranks = load(equivalence_job, scenario)
    for key in ranks[0]:
        assert np.array_equal(ranks[0][key], ranks[1][key]), f"rank 1 differs from rank 0 in {key}"
    diffs = differences(references[scenario], ranks[0])
    worst = {key: diff for key, diff in diffs.items() if diff > TOLERANCE}
    assert not worst, f"{scenario}: differs from plain Keras beyond {TOLERANCE}: {worst}"
    # Every epoch saw the whole data: the global steps are the ranks' steps, not half of them.
    assert len(ranks[0]["history/loss"]) == worker.EPOCHS
    assert ranks[0]["predict"].shape[0] == references[scenario]["predict"].shape[0]


def test_the_reference_uses_every_batch_of_every_rank():
    # Generators of 5 and 9 batches (evaluate) and 5 and 3 (predict): no rank's batches are dropped.
    for part in ("evaluate", "predict"):
        per_rank = [worker.rank_batches("declared", rank, part=part) for rank in range(worker.WORLD_SIZE)]
        rows = sum(len(batch[0]) for batches in per_rank for batch in batches)
        assert len({len(batches) for batches in per_rank}) == 2, "the ranks' batch counts must differ"
        assert sum(len(batch[0]) for batch in worker.global_batches("declared", part=part)) == rows


def test_slicing_per_rank_input_is_caught_by_the_comparison(tmp_path, references):
    # Negative control: each rank keeps only its slice of its own batch (the old
    # behaviour). Equal per-rank sizes only: sliced uneven batches cannot even
    # gather predictions (the ranks would disagree on the rows).
    scenarios = ("sampler", "sampler_shuffled")
    run_job(tmp_path, "--job", "equivalence", "--out", str(tmp_path), "--fault", "sliced_per_rank_input",
            "--scenarios", ",".join(scenarios))
    for scenario in scenarios:
        ranks = load(tmp_path, scenario)
        diffs = differences(references[scenario], ranks[0])
        broken = {key: diff for key, diff in diffs.items() if key.startswith(("weight/", "predict")) and diff > 1e-3}
        assert broken, f"{scenario}: slicing per-rank input went unnoticed: {diffs}"


@pytest.fixture(scope="module")
def error_outputs():
    result = run_job(None, "--job", "errors")
    return [result.output(f"worker-{rank}") for rank in range(worker.WORLD_SIZE)]


def _caught(output, case):
    for line in output.splitlines():
        if line.startswith(f"SKIP {case}:"):
            pytest.skip(line.split(":", 1)[1].strip())
        match = re.match(rf"CAUGHT {case} (\w+) unchanged=(\w+): (.*)", line)
        if match:
            return match.group(1), match.group(2) == "True", match.group(3)
    raise AssertionError(f"no result for {case}:\n{output}")


@pytest.mark.parametrize("case", ["undeclared_pydataset", "tf_shard"])
def test_undeclared_per_rank_input_is_refused_at_the_first_batch(error_outputs, case):
    for output in error_outputs:
        name, unchanged, message = _caught(output, case)
        assert name == "InputMismatchError", (name, message)
        assert unchanged, "a step ran before the refusal"
        assert "Ranks read different batches" in message
        assert ".shard()" in message and "rank-specific files" in message  # the likely causes
        assert "kdist.distribute.per_rank(" in message and "give every rank the full data" in message  # both fixes


def test_input_declared_per_rank_on_one_rank_only_is_refused(error_outputs):
    for output in error_outputs:
        name, unchanged, message = _caught(output, "declared_on_one_rank")
        assert name == "InputMismatchError" and unchanged, (name, message)
        assert "Ranks disagree whether fit's x is split per rank" in message


def test_a_distributed_sampler_built_for_another_job_is_refused(error_outputs):
    for output in error_outputs:
        name, unchanged, message = _caught(output, "sampler_for_another_job")
        assert name == "InvalidArgumentError" and unchanged, (name, message)
        assert "num_replicas=3" in message and "Expected: num_replicas=2" in message


def test_a_sampler_wrong_on_one_rank_only_is_refused_on_every_rank(error_outputs):
    # DistributedSampler(ds, rank=local_rank) on 2 nodes: rank 1's sampler says rank 0.
    messages = [_caught(output, "sampler_rank_on_one_rank") for output in error_outputs]
    for name, unchanged, message in messages:
        assert name == "InvalidArgumentError" and unchanged, (name, message)
    assert "Received: a valid sampler on rank 0" in messages[0][2] and "on rank 1 is built" in messages[0][2]
    assert "num_replicas=2, rank=0. Expected: num_replicas=2, rank=1" in messages[1][2]


def test_per_rank_inputs_of_different_known_lengths_are_refused_before_the_first_step(error_outputs):
    for output in error_outputs:
        name, unchanged, message = _caught(output, "uneven_known_lengths")
        assert name == "InputMismatchError" and unchanged, (name, message)
        assert "Received: batches per rank [3, 4] in rank order" in message
        assert "same number of batches" in message and "pass a generator" in message


def test_input_that_differs_from_epoch_2_is_refused_at_epoch_2(error_outputs):
    for output in error_outputs:
        name, unchanged, message = _caught(output, "differs_from_epoch_2")
        assert name == "InputMismatchError", (name, message)
        assert message.startswith("trained_in_epoch_1=True "), message  # epoch 1 ran: the check is per epoch
        assert unchanged, "epoch 2 trained before the refusal (weights differ from those after epoch 1)"
        assert "Ranks read different batches" in message


def test_torch_batchnorm_split_badly_on_one_rank_is_refused_on_every_rank(error_outputs):
    # Rank batches of 1 and 4 (one replica each): rank 0's replica would get one sample.
    messages = [_caught(output, "batchnorm_on_one_rank") for output in error_outputs]
    for name, unchanged, message in messages:
        assert name == "InvalidArgumentError" and unchanged, (name, message)  # not CollectiveTimeoutError
    assert "this rank's batch (input split per rank) of 1 samples" in messages[0][2]
    assert "rank 0's batch (input split per rank) of 1 samples" in messages[1][2]


def _mnist_like(seed):
    # 28x28 digits with a blank 4-pixel border, as MNIST's.
    images = np.zeros((256, 28, 28), "float32")
    images[:, 4:24, 4:24] = np.random.default_rng(seed).random((256, 20, 20), dtype=np.float32)
    return images


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_fingerprint_tells_different_batches_apart_where_a_strided_sample_sees_only_the_border(kind):
    import torch

    from kdist.keras.replica.input_fingerprint import fingerprint

    first, second = _mnist_like(0), _mnist_like(1)
    # The old sample (every numel // 1024-th value) reads column 0 only: blank in both.
    stride = first.size // 1024
    assert not first.reshape(-1)[::stride].any() and not second.reshape(-1)[::stride].any()
    convert = torch.from_numpy if kind == "torch" else np.asarray
    assert fingerprint((convert(first),)) != fingerprint((convert(second),))
    assert fingerprint((convert(first),)) == fingerprint((convert(first.copy()),))
    assert fingerprint((convert(first), None)) != fingerprint((convert(first),))  # structure


def test_fingerprint_reads_strings_and_every_leaf_exactly():
    from kdist.keras.replica.input_fingerprint import fingerprint

    words = np.array([b"cat", b"dog"], dtype=object)
    assert fingerprint((words,)) != fingerprint((np.array([b"cat", b"cow"], dtype=object),))
    assert fingerprint((words,)) == fingerprint((np.array([b"cat", b"dog"], dtype=object),))
    assert fingerprint((np.array(["a", "b"]),)) != fingerprint((np.array(["a", "c"]),))
    ints = np.arange(8, dtype="int64")
    changed = ints.copy()
    changed[5] += 1
    assert fingerprint((ints,)) != fingerprint((changed,))
    # Exact in float64 (what the ranks all-reduce): integers below 2**52.
    assert all(value == int(value) and 0 <= value < 2**52 for value in fingerprint((ints, words)))


def test_per_rank_refuses_arrays_and_global_datasets():
    import kdist
    from kdist.distribute.input import per_rank

    with pytest.raises(kdist.errors.InvalidArgumentError, match="Received: data of type ndarray"):
        per_rank(np.zeros((4, 2)))
    with pytest.raises(kdist.errors.InvalidArgumentError, match="holds global batches"):
        per_rank(kdist.MirroredStrategy(devices=["cpu:0"]).experimental_distribute_dataset([np.zeros((2, 1))]))
