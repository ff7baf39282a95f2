"""Buffers of torch modules inside `TorchModuleWrapper` (BatchNorm1d running statistics) under replicas.

The model is `TorchModuleWrapper(Sequential(Linear, BatchNorm1d, ReLU, Linear))`
(`workers/torch_buffers.py`), trained with SGD on global batches of 8 over
2 CPU replicas (equal shards of 4). Expected, as for Keras' own
`BatchNormalization`:

- `num_batches_tracked` equals plain Keras' (once per step);
- after one step `running_mean` equals plain Keras' (the mean of the shards'
  means is the batch mean); `running_var` is the mean of the shards' unbiased
  variances, not plain Keras' value (documented in docs/mirrored.md);
- after several steps everything (buffers, weights, evaluate loss) equals
  plain Keras with a "ghost" BatchNorm that normalises each shard-sized chunk
  with its own statistics and averages their running-statistic updates: the
  documented per-replica-statistics rule computed on one device;
- `running_mean` moves exactly as Keras' `BatchNormalization.moving_mean`
  does under the same strategy (torch momentum m = Keras momentum 1 - m).

The negative controls switch the reconciliation off
(`FaultInjection.unsynced_torch_buffers`): replicas then update the shared
buffers one after another, and multi-worker ranks drift apart.
"""

import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import kdist
from kdist import faults
from kdist.keras.replica import state_sync, torch_buffers
from tests import harness
from tests.keras.workers import torch_buffers as scenarios

WORKER = Path(scenarios.__file__)
TOLERANCE = 1e-6
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def mirrored():
    return kdist.MirroredStrategy(["cpu:0", "cpu:1"])


@pytest.fixture(scope="module")
def ghost_reference():
    """Plain Keras, one device, with the per-replica-statistics rule written into the torch module."""
    return scenarios.fit(ghost_shards=2)


@pytest.fixture(scope="module")
def two_replicas():
    return scenarios.fit(mirrored())


def max_difference(a, b):
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def test_one_step_counts_once_and_running_mean_equals_plain_keras():
    plain = scenarios.fit(num_samples=scenarios.GLOBAL_BATCH)
    distributed = scenarios.fit(mirrored(), num_samples=scenarios.GLOBAL_BATCH)
    assert int(plain["num_batches_tracked"]) == 1
    assert int(distributed["num_batches_tracked"]) == 1
    assert max_difference(distributed["running_mean"], plain["running_mean"]) < TOLERANCE
    # Per-replica statistics: the shards' unbiased variances differ from the batch's.
    assert max_difference(distributed["running_var"], plain["running_var"]) > 1e-3


def test_several_steps_equal_the_per_replica_statistics_reference(two_replicas, ghost_reference):
    plain = scenarios.fit()
    steps = scenarios.NUM_SAMPLES // scenarios.GLOBAL_BATCH
    assert int(two_replicas["num_batches_tracked"]) == int(plain["num_batches_tracked"]) == steps
    assert two_replicas.keys() == ghost_reference.keys()
    for key in two_replicas:
        assert max_difference(two_replicas[key], ghost_reference[key]) < TOLERANCE, key


def test_running_mean_follows_the_rule_of_keras_batchnormalization(two_replicas):
    keras_bn = scenarios.fit(mirrored(), kind="keras")
    assert max_difference(two_replicas["running_mean"], keras_bn["running_mean"]) < 1e-5


def test_negative_control_unsynced_buffers_fail_the_comparison(ghost_reference):
    with faults.injected(unsynced_torch_buffers=True):
        broken = scenarios.fit(mirrored())
    steps = scenarios.NUM_SAMPLES // scenarios.GLOBAL_BATCH
    assert int(broken["num_batches_tracked"]) == 2 * steps
    assert max_difference(broken["running_mean"], ghost_reference["running_mean"]) > 1e-2
    assert max_difference(broken["evaluate_loss"], ghost_reference["evaluate_loss"]) > 1e-3


def test_evaluate_and_predict_leave_the_buffers_alone():
    with mirrored().scope():
        model = scenarios.torch_model()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = scenarios.data()
    model.fit(x, y, batch_size=scenarios.GLOBAL_BATCH, epochs=1, verbose=0)
    norm = model.get_layer("wrapped").module[1]
    tensors = {name: buffer for name, buffer in norm.named_buffers()}
    before = {name: buffer.clone() for name, buffer in tensors.items()}
    model.evaluate(x, y, batch_size=scenarios.GLOBAL_BATCH, verbose=0)
    model.predict(x, batch_size=scenarios.GLOBAL_BATCH, verbose=0)
    for name, buffer in norm.named_buffers():
        assert buffer is tensors[name], f"{name} is no longer the module's own tensor"
        assert np.array_equal(buffer.numpy(), before[name].numpy()), name
    # Outside a replica step the module is plain torch again: one call, one count.
    model(x[:4], training=True)
    assert int(norm.num_batches_tracked) == int(before["num_batches_tracked"]) + 1


def test_a_step_that_raises_mid_way_leaves_the_buffers_as_they_were():
    """Replica 1 gets 1 sample (the adapter's guard bypassed): torch raises after replica 0 ran."""
    import torch

    with mirrored().scope():
        model = scenarios.torch_model()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = scenarios.data(3)
    model.predict(x, verbose=0)
    model.make_train_function()
    norm = model.get_layer("wrapped").module[1]
    before = {name: buffer.clone() for name, buffer in norm.named_buffers()}
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        model._kdist_engine.train_function([(torch.from_numpy(x), torch.from_numpy(y))])
    for name, buffer in norm.named_buffers():
        assert torch.equal(buffer, before[name]), name
    # The failed step's replica copies do not leak into a plain call afterwards.
    model(x[:2], training=True)
    assert int(norm.num_batches_tracked) == 1
    assert not torch.equal(norm.running_mean, before["running_mean"])


def test_models_without_torch_modules_have_no_buffers_to_reconcile():
    model = scenarios.keras_model()
    state = state_sync.StateVariables(model)
    assert state.torch_buffers.buffers == []
    state.torch_buffers.start_replica(0, True)
    assert state.torch_buffers.plan_contributions([1.0], True) == ([], [])
    wrapped = torch_buffers.TorchBuffers(scenarios.torch_model())
    assert [b.name for b in wrapped.buffers] == [f"wrapped/1.{name}" for name in BUFFERS]


# ----- two processes -----------------------------------------------------------------
def run_job(tmp_path, *args):
    envs = harness.torchrun_envs(2)
    specs = harness.python_specs(envs, WORKER, "--out", str(tmp_path), *args)
    harness.run(specs, timeout=150).check()
    return [dict(np.load(tmp_path / f"rank{rank}.npz")) for rank in range(2)]


@pytest.mark.skipif(sys.platform == "win32", reason="gloo multi-process test")
def test_two_processes_end_with_identical_buffers_equal_to_two_replicas(tmp_path, two_replicas):
    ranks = run_job(tmp_path)
    for key in ranks[0]:
        assert np.array_equal(ranks[0][key], ranks[1][key]), f"rank 1 differs from rank 0 in {key}"
        assert max_difference(ranks[0][key], two_replicas[key]) < TOLERANCE, key


@pytest.mark.skipif(sys.platform == "win32", reason="gloo multi-process test")
def test_negative_control_two_processes_drift_apart_without_reconciliation(tmp_path, two_replicas):
    ranks = run_job(tmp_path, "--fault", "unsynced_torch_buffers")
    assert max_difference(ranks[0]["running_mean"], ranks[1]["running_mean"]) > 1e-2
    assert max_difference(ranks[0]["running_mean"], two_replicas["running_mean"]) > 1e-2
