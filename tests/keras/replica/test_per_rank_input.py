"""Input already split per rank, in 2 real processes (gloo), against plain Keras on the concatenation.

Each rank reads its own batches (`workers/per_rank_input.py`): a `DataLoader`
with a `DistributedSampler`, `distribute_datasets_from_function`, or input
declared with `kdist.distribute.per_rank` (uneven sizes per rank). Results
must be identical on both ranks and equal plain Keras trained on the ranks'
batches concatenated in rank order. Undeclared per-rank input must be refused
at the first batch with `InputMismatchError`; the negative control slices
per-rank input again, as before, and the comparison must then fail.
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


def test_per_rank_refuses_arrays_and_global_datasets():
    import kdist
    from kdist.distribute.input import per_rank

    with pytest.raises(kdist.errors.InvalidArgumentError, match="Received: data of type ndarray"):
        per_rank(np.zeros((4, 2)))
    with pytest.raises(kdist.errors.InvalidArgumentError, match="holds global batches"):
        per_rank(kdist.MirroredStrategy(devices=["cpu:0"]).experimental_distribute_dataset([np.zeros((2, 1))]))
