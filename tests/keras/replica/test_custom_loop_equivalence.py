"""TensorFlow's custom-loop tutorial over five epochs: how far replicas may drift from one device.

The port (tests/keras/workers/custom_loop_tutorial.py) ends its epochs with a
partial batch (20 of 60), divided by the global batch size
(`kdist.nn.compute_average_loss(..., global_batch_size=60)`), as the tutorial
does.

- **float64**: 2 and 3 replicas equal one device to 1e-10 (measured: loss
  history identical, weights and Adam slots 3e-16). Nothing in kdist's path
  (loss divisor, regularisation scaling, the gradient sum, one apply per step)
  differs from one device.
- **float32**: the same program drifts by summation order only, bounded below
  (see `FLOAT32_LOSS_RTOL`).
- Negative controls: dividing by the per-replica batch fails both checks;
  omitting `global_batch_size` (TensorFlow's default, shard size times
  replicas) is exact for equal shards and not for the 7/7/6 split of the
  partial batch over 3 replicas: that is the ~1e-3 relative drift of the epoch
  losses seen when the tutorial is ported without `global_batch_size`.
"""

import keras
import numpy as np
import pytest

import kdist
from tests.keras import _models as m
from tests.keras.workers import custom_loop_tutorial as tutorial

EPOCHS = 5
FLOAT64_TOLERANCE = 1e-10
# float32: a replica sums its shard's per-example losses and kdist then sums
# the replicas' gradients; one device reduces the whole batch at once. The
# terms are the same, the order is not, so each step differs by about one
# float32 ulp (6e-8 relative). Adam divides each update by sqrt(v), which
# turns those ulps into visible weight differences on components whose
# gradient is near zero (up to 5e-4 absolute after 70 steps), and the epoch
# losses move by up to 5.7e-7 relative (2 and 3 replicas, Keras 3.15.1 and
# 3.16, CPU). The float64 run above shows the drift is rounding only: it
# collapses to 3e-16. The bound leaves a margin of about 20 for other BLAS
# builds; a wrong divisor moves the losses by 1e-3 or more.
FLOAT32_LOSS_RTOL = 1e-5


def run(strategy, dtype):
    return tutorial.train(strategy, epochs=EPOCHS, dtype=dtype)


@pytest.fixture(scope="module")
def one_device64():
    return run(kdist.get_strategy(), "float64")


@pytest.fixture(scope="module")
def one_device32():
    return run(kdist.get_strategy(), "float32")


def float64_differences(reference, results):
    """Every weight, optimizer slot and epoch loss that differs from one device by more than 1e-10."""
    assert set(reference) == set(results), set(reference) ^ set(results)
    differences = {}
    for key in reference:
        expected = np.asarray(reference[key], "float64")
        actual = np.asarray(results[key], "float64")
        if key == "history":
            expected, actual = expected[:, 0], actual[:, 0]
            diff = float(np.max(np.abs(actual - expected) / np.abs(expected)))
        else:
            diff = float(np.max(np.abs(actual - expected), initial=0.0))
        if diff > FLOAT64_TOLERANCE:
            differences[key] = diff
    return differences


def float32_loss_drift(reference, results):
    """The epochs whose loss differs from one device by more than `FLOAT32_LOSS_RTOL` (relative)."""
    expected, actual = reference["history"][:, 0], results["history"][:, 0]
    drift = np.abs(actual - expected) / np.abs(expected)
    return {epoch + 1: float(d) for epoch, d in enumerate(drift) if d > FLOAT32_LOSS_RTOL}


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_float64_equals_one_device(one_device64, num_replicas):
    results = run(m.mirrored(num_replicas), "float64")
    assert results["weight/0"].dtype == np.float64
    assert int(results["iterations"]) == int(results["steps"])
    assert float64_differences(one_device64, results) == {}


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_float32_epoch_losses_drift_by_summation_order_only(one_device32, num_replicas):
    results = run(m.mirrored(num_replicas), "float32")
    assert int(results["iterations"]) == int(results["steps"])
    assert float32_loss_drift(one_device32, results) == {}


def test_negative_control_dividing_by_the_per_replica_batch_fails(one_device64, one_device32, monkeypatch):
    compute_average_loss = kdist.nn.compute_average_loss

    def per_replica_divisor(per_example_loss, sample_weight=None, global_batch_size=None):
        del global_batch_size
        shard_size = keras.ops.shape(per_example_loss)[0]
        return compute_average_loss(per_example_loss, sample_weight=sample_weight, global_batch_size=shard_size)

    monkeypatch.setattr(kdist.nn, "compute_average_loss", per_replica_divisor)
    assert float64_differences(one_device64, run(m.mirrored(2), "float64"))
    assert float32_loss_drift(one_device32, run(m.mirrored(2), "float32"))


def test_without_global_batch_size_uneven_shards_are_not_exact(monkeypatch):
    compute_average_loss = kdist.nn.compute_average_loss

    def default_divisor(per_example_loss, sample_weight=None, global_batch_size=None):
        del global_batch_size
        return compute_average_loss(per_example_loss, sample_weight=sample_weight)

    monkeypatch.setattr(kdist.nn, "compute_average_loss", default_divisor)
    reference = run(kdist.get_strategy(), "float64")
    # 20 examples over 2 replicas: 10 + 10, each divides by 10 * 2 = 20, as one device.
    assert float64_differences(reference, run(m.mirrored(2), "float64")) == {}
    # Over 3 replicas: 7 + 7 + 6, divided by 21, 21 and 18 instead of 20.
    drift = float64_differences(reference, run(m.mirrored(3), "float64"))
    assert drift.get("history", 0.0) > 1e-4, drift
