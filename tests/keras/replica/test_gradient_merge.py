"""`optimizer.apply` on replicas: TensorFlow's merge in custom loops, and steps that apply twice under `fit`.

- A custom loop (`strategy.run` + `apply_gradients` inside the replica
  function, TensorFlow's tutorial ported by renames) sums the replicas'
  gradients and applies them once per step: the weights equal one device's and
  `iterations` equals the number of steps, in one process and across two.
- A `train_step` with two optimizers (the keras.io GAN pattern) runs in the
  engine's merge mode: the generator's gradients see the discriminator's update,
  as on one device.

Each has a negative control: the old per-replica apply, and recording both
applies without merging.
"""

from pathlib import Path

import keras
import numpy as np
import pytest
import torch

import kdist
from tests import harness
from tests.keras import _models as m
from tests.keras.workers import custom_loop_tutorial as tutorial
from tests.keras.workers.gan import build_gan, fit_gan

TOLERANCE = 1e-5


def worst_differences(reference, results):
    assert set(reference) == set(results), set(reference) ^ set(results)
    diffs = {key: float(np.max(np.abs(np.asarray(reference[key], "float64") - results[key]))) for key in reference}
    return {key: diff for key, diff in diffs.items() if diff > TOLERANCE}


@pytest.fixture(scope="module")
def one_device():
    return tutorial.train(kdist.get_strategy())


# ----- custom loop: strategy.run + apply_gradients --------------------------------
@pytest.mark.parametrize("num_replicas", [2, 3])
def test_custom_loop_tutorial_matches_one_device(one_device, num_replicas):
    results = tutorial.train(m.mirrored(num_replicas))
    assert int(results["iterations"]) == int(results["steps"])
    assert worst_differences(one_device, results) == {}


def test_negative_control_applying_once_per_replica_is_caught(one_device):
    with m.fault(unmerged_replica_apply=True):
        results = tutorial.train(m.mirrored(2))
    assert int(results["iterations"]) == 2 * int(results["steps"])
    assert worst_differences(one_device, results)


def test_custom_loop_tutorial_across_two_processes(one_device, tmp_path):
    specs = harness.python_specs(harness.torchrun_envs(2), Path(tutorial.__file__), "--out", str(tmp_path))
    harness.run(specs, timeout=180).check()
    ranks = [dict(np.load(tmp_path / f"rank{rank}.npz")) for rank in range(2)]
    # Keras metrics in a custom loop count this process's samples only (see
    # docs/custom_loop.md); the loss, reduced by strategy.reduce, and everything
    # trained must match one device on every rank.
    trained = [key for key in one_device if key != "history"]
    for results in ranks:
        assert int(results["iterations"]) == int(results["steps"])
        assert worst_differences({k: one_device[k] for k in trained}, {k: results[k] for k in trained}) == {}
        np.testing.assert_allclose(results["history"][:, 0], one_device["history"][:, 0], rtol=1e-5)


def test_apply_in_cross_replica_context_applies_at_once():
    strategy = m.mirrored(2)
    with strategy.scope():
        variable = keras.Variable(np.ones(3, "float32"))
        optimizer = keras.optimizers.SGD(1.0)
    optimizer.apply([torch.full((3,), 0.5)], [variable])
    np.testing.assert_allclose(variable.numpy(), 0.5)
    assert int(optimizer.iterations.numpy()) == 1


def test_replicas_that_disagree_on_gradients_are_refused_before_any_update():
    strategy = m.mirrored(2)
    with strategy.scope():
        variables = [keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(2, "float32"))]
        optimizer = keras.optimizers.SGD(1.0)

    def step():
        replica = kdist.get_replica_context().replica_id_in_sync_group
        grads = [torch.ones(2), torch.ones(2) if replica == 0 else None]
        optimizer.apply(grads, variables)

    with pytest.raises(kdist.errors.ReplicaGradientError, match="no gradient"):
        strategy.run(step)
    for variable in variables:
        np.testing.assert_array_equal(variable.numpy(), 1.0)
    assert int(optimizer.iterations.numpy()) == 0


# ----- a train_step with two optimizers (keras.io's torch GAN) -------------------
@pytest.fixture(scope="module")
def plain_gan():
    return fit_gan(build_gan())


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_gan_with_two_optimizers_matches_plain_keras(plain_gan, num_replicas):
    with m.mirrored(num_replicas).scope():
        gan = build_gan()
    results = fit_gan(gan)
    steps = 2 * 5
    assert int(gan.d_optimizer.iterations.numpy()) == steps
    assert int(gan.g_optimizer.iterations.numpy()) == steps
    assert worst_differences(plain_gan, results) == {}


def test_gan_across_two_processes_matches_plain_keras(plain_gan, tmp_path):
    script = Path(tutorial.__file__).with_name("gan.py")
    specs = harness.python_specs(harness.torchrun_envs(2), script, "--out", str(tmp_path))
    harness.run(specs, timeout=180).check()
    for rank in range(2):
        results = dict(np.load(tmp_path / f"rank{rank}.npz"))
        assert worst_differences(plain_gan, results) == {}


def test_negative_control_recording_both_applies_is_caught(plain_gan):
    with m.fault(no_merge_mode=True):
        with m.mirrored(2).scope():
            gan = build_gan()
        results = fit_gan(gan)
    assert worst_differences(plain_gan, results)


def test_parameter_server_worker_with_two_devices_pushes_one_summed_update():
    from tests.keras import _ps

    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver(), devices=["cpu:0", "cpu:1"])
        with strategy.scope():
            variable = keras.Variable(np.ones((3,), "float32"))
            optimizer = keras.optimizers.SGD(0.5)

        def step():
            replica = kdist.get_replica_context().replica_id_in_sync_group
            optimizer.apply_gradients([(torch.full((3,), float(replica + 1)), variable)])

        before = cluster.stats()[0].requests.get("push", 0)
        strategy.run(step)
        assert cluster.stats()[0].requests.get("push", 0) - before == 1
        # (1 + 2) summed, times the learning rate 0.5.
        np.testing.assert_allclose(keras.ops.convert_to_numpy(variable), np.full(3, -0.5))
        key = strategy.extended.variable_router.route(variable).keys[0]
        (state,) = cluster.clients()[0].pull([key])
        np.testing.assert_allclose(state.value, np.full(3, -0.5))
        assert int(optimizer.iterations.numpy()) == 1


class AllReduceInStep(keras.Sequential):
    """A train_step that asks the other replicas something (here: the global batch size)."""

    def train_step(self, data):
        logs = super().train_step(data)
        size = torch.tensor(float(keras.utils.unpack_x_y_sample_weight(data)[0].shape[0]))
        logs["global_batch"] = kdist.get_replica_context().all_reduce("sum", size)
        return logs


def build_all_reduce_model():
    m.seeded(9)
    model = AllReduceInStep([keras.Input((12,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)])
    return m.compile_classifier(model)


def test_all_reduce_inside_train_step_under_fit_runs_in_merge_mode():
    x, y = m.classification_data(200)
    plain = build_all_reduce_model()
    with m.mirrored(3).scope():
        distributed = build_all_reduce_model()
    batches = []
    for model in (plain, distributed):
        seen = []
        callback = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(float(logs["global_batch"])))
        model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
        batches.append(seen)
    assert batches[0] == batches[1] == [64.0, 64.0, 64.0, 8.0]
    m.assert_same_state(plain, distributed)
