"""SyncBatchNorm (`kdist.keras.sync_batchnorm`) against plain single-device Keras.

`BatchNormalization(synchronized=True)` built under a kdist strategy must
train exactly like plain Keras' unsynchronized layer on one device fed the
same global batches: 2 and 3 replicas, uneven and empty shards, masks; through
`strategy.run` and through `model.fit`, in one process and in two. The
negative controls make the synchronized layers use local statistics (what
BatchNormalization does without synchronization) and check that the
comparison then fails.
"""

import contextlib
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from kdist import faults
from kdist.errors import InvalidArgumentError
from kdist.keras import sync_batchnorm
from tests import harness
from tests.keras import _models as m
from tests.keras.workers import sync_batchnorm as scenarios

WORKER = Path(scenarios.__file__)
TOLERANCE = 1e-5


@contextlib.contextmanager
def fault(**flags):
    with faults.injected(**flags):
        yield


def assert_close(reference, results, tolerance=TOLERANCE):
    differences = scenarios.largest_differences(reference, results)
    worst = {key: diff for key, diff in differences.items() if diff > tolerance}
    assert not worst, f"differences above {tolerance}: {worst}"


# ----- construction, config, conversion ---------------------------------------------
def test_synchronized_is_accepted_in_a_scope_and_refused_outside_as_keras_does():
    with pytest.raises(ValueError, match="synchronized=True"):
        keras.layers.BatchNormalization(synchronized=True)
    with m.mirrored(2).scope():
        layer = keras.layers.BatchNormalization(synchronized=True, momentum=0.9)
    assert layer.synchronized and sync_batchnorm.is_synchronized(layer)
    config = layer.get_config()
    assert config["synchronized"] is False and config["momentum"] == 0.9
    plain = keras.layers.BatchNormalization()
    assert not sync_batchnorm.is_synchronized(plain) and "get_config" not in vars(plain)


def test_a_config_saying_synchronized_loads_in_a_scope():
    config = keras.layers.BatchNormalization().get_config() | {"synchronized": True}
    # Keras wraps its constructor's ValueError in a TypeError here.
    with pytest.raises((ValueError, TypeError), match="synchronized=True"):
        keras.layers.BatchNormalization.from_config(config)
    with m.mirrored(2).scope():
        layer = keras.layers.BatchNormalization.from_config(config)
    assert sync_batchnorm.is_synchronized(layer)


def test_convert_and_needs_merge_mode():
    model = scenarios.dense_model(False)
    assert not sync_batchnorm.needs_merge_mode(model)
    assert sync_batchnorm.convert(model) is model
    assert sync_batchnorm.needs_merge_mode(model)
    assert all(sync_batchnorm.is_synchronized(layer) for layer in model.layers if "batch" in layer.name)
    with pytest.raises(InvalidArgumentError, match="Received: model="):
        sync_batchnorm.convert("not a model")


def test_one_replica_and_inference_compute_what_plain_keras_computes():
    x, _ = scenarios.make_data("dense", 16)
    reference = scenarios.dense_model(False)
    synced = scenarios.build("dense", m.mirrored(1))
    for training in (True, False):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(synced(x, training=training)),
            keras.ops.convert_to_numpy(reference(x, training=training)),
        )


# ----- custom loops (strategy.run) ----------------------------------------------------
@pytest.mark.parametrize("num_replicas", [2, 3])
@pytest.mark.parametrize("kind", ["dense", "masked"])
def test_custom_loop_matches_one_device(kind, num_replicas):
    assert_close(scenarios.custom_loop(kind), scenarios.custom_loop(kind, m.mirrored(num_replicas)))


def test_custom_loop_conv_matches_one_device():
    assert_close(scenarios.custom_loop("conv"), scenarios.custom_loop("conv", m.mirrored(3)))


def test_negative_control_local_statistics_break_the_custom_loop():
    reference = scenarios.custom_loop("dense")
    with fault(local_statistics=True):
        results = scenarios.custom_loop("dense", m.mirrored(2))
    with pytest.raises(AssertionError, match="differences above"):
        assert_close(reference, results)


# ----- model.fit ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_replicas", [2, 3])
@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_fit_matches_one_device(kind, num_replicas):
    """Weights, moving statistics, optimizer slots, metrics, History, evaluate and predict."""
    assert_close(scenarios.fit(kind), scenarios.fit(kind, m.mirrored(num_replicas)))


def test_fit_with_masks_matches_one_device():
    assert_close(scenarios.fit("masked"), scenarios.fit("masked", m.mirrored(3)))


def test_negative_control_local_statistics_break_fit():
    reference = scenarios.fit("dense")
    with fault(local_statistics=True):
        results = scenarios.fit("dense", m.mirrored(3))
    with pytest.raises(AssertionError, match="differences above"):
        assert_close(reference, results)


# ----- saving ---------------------------------------------------------------------------------
_LOAD_IN_PLAIN_KERAS = """
import os, sys
os.environ["KERAS_BACKEND"] = "torch"
import keras, numpy as np
model = keras.saving.load_model(sys.argv[1])
assert "kdist" not in sys.modules
assert not any(layer.get_config().get("synchronized") for layer in model.layers)
np.save(sys.argv[2], keras.ops.convert_to_numpy(model(np.load(sys.argv[3]), training=False)))
"""


def test_saved_model_loads_in_plain_keras_and_predicts_the_same(tmp_path):
    x, y = scenarios.make_data("conv", 40)
    strategy = m.mirrored(2)
    model = scenarios.compile_model(scenarios.build("conv", strategy))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "synced.keras"
    model.save(path)
    np.save(tmp_path / "x.npy", x)
    subprocess.run(
        [sys.executable, "-c", _LOAD_IN_PLAIN_KERAS, str(path), str(tmp_path / "out.npy"), str(tmp_path / "x.npy")],
        check=True, timeout=120, cwd=tmp_path,
    )
    expected = keras.ops.convert_to_numpy(model(x, training=False))
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, atol=1e-6)
    # Loaded back under kdist, the layer is ordinary until converted.
    loaded = keras.saving.load_model(path)
    assert not sync_batchnorm.needs_merge_mode(loaded)
    assert sync_batchnorm.needs_merge_mode(sync_batchnorm.convert(loaded))


# ----- two processes (MultiWorkerMirroredStrategy on gloo) -------------------------------------
def run_job(tmp_path, *args, num_processes=2, timeout=150, check_ranks=True):
    specs = harness.python_specs(harness.torchrun_envs(num_processes), WORKER, "--out", str(tmp_path), *args)
    harness.run(specs, timeout=timeout).check()
    ranks = [dict(np.load(tmp_path / f"rank{rank}.npz")) for rank in range(num_processes)]
    for rank in ranks[1:] if check_ranks else ():
        for key in ranks[0]:
            assert np.array_equal(ranks[0][key], rank[key]), f"ranks differ in {key}"
    return ranks[0]


def test_two_processes_custom_loop_two_local_replicas_match_one_device(tmp_path):
    reference = scenarios.custom_loop("dense")
    assert_close(reference, run_job(tmp_path, "--mode", "custom", "--local-devices", "2"))


def test_two_processes_fit_matches_one_device(tmp_path):
    assert_close(scenarios.fit("dense"), run_job(tmp_path, "--mode", "fit"))


def test_two_processes_fit_with_stand_in_replicas_matches_one_device(tmp_path):
    """2 processes x 2 replicas; 194 samples leave a last batch of 2, so rank 1 runs a stand-in (weight 0)."""
    reference = scenarios.fit("conv", num_samples=194)
    results = run_job(tmp_path, "--mode", "fit", "--kind", "conv", "--local-devices", "2", "--num-samples", "194")
    assert_close(reference, results)


def test_negative_control_two_processes_local_statistics(tmp_path):
    reference = scenarios.custom_loop("dense")
    # Local statistics also leave each rank with its own moving statistics.
    results = run_job(tmp_path, "--mode", "custom", "--fault", "local_statistics", check_ranks=False)
    with pytest.raises(AssertionError, match="differences above"):
        assert_close(reference, results)
