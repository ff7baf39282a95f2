"""Gradient accumulation with one all-reduce per applied update, in real processes (gloo).

`Adam(gradient_accumulation_steps=3)`: 20 steps apply 6 updates (steps 3, 6,
..., 18) and end with 2 micro-steps pending. kdist must all-reduce gradients 6
times, not 20, fold the pending 2 into the optimizer's accumulators when `fit`
returns, and match plain Keras with the same accumulation: weights, optimizer
slots and accumulators.
"""

import keras
import numpy as np
import pytest

from tests.keras.replica.test_gradient_overlap import calls, run_job, worst_differences
from tests.keras.workers import gradient_paths

ACCUMULATION = 3
STEPS = gradient_paths.EPOCHS * gradient_paths.NUM_SAMPLES // gradient_paths.GLOBAL_BATCH
UPDATES = STEPS // ACCUMULATION


@pytest.fixture(scope="module")
def plain():
    cache = {}

    def reference(kind):
        if kind not in cache:
            cache[kind] = gradient_paths.train(kind, accumulation=ACCUMULATION)[1]
        return cache[kind]

    return reference


def accumulators(results):
    """The optimizer's gradient accumulators (Keras names them gradient_accumulator)."""
    model = gradient_paths.build_model("mlp", ACCUMULATION)
    model.optimizer.build(model.trainable_variables)
    names = [v.name for v in model.optimizer.variables]
    keys = [f"optimizer/{i}" for i, name in enumerate(names) if "accumulator" in name]
    assert keys, names
    return {key: results[key] for key in keys}


@pytest.mark.parametrize("kind, num_processes", [("mlp", 2), ("masked", 3)])
def test_one_all_reduce_per_update_and_equal_to_plain_keras(tmp_path, plain, kind, num_processes):
    results, report = run_job(tmp_path, "--model", kind, "--accumulation", str(ACCUMULATION), num_processes=num_processes)
    worst = {k: d for k, d in worst_differences(plain(kind), results).items() if d > 1e-5}
    assert not worst, worst
    assert calls(report, "gradients") == UPDATES
    # The 2 micro-steps left at the end of fit, folded in once.
    assert calls(report, "accumulated_gradients") == 1


def test_pending_gradients_are_in_the_accumulators_when_fit_returns(tmp_path, plain):
    results, _ = run_job(tmp_path, "--accumulation", str(ACCUMULATION))
    reference = accumulators(plain("mlp"))
    assert any(np.abs(value).max() > 0 for value in reference.values())  # 2 micro-steps pending
    for key, value in reference.items():
        np.testing.assert_allclose(results[key], value, atol=1e-5, err_msg=key)


def test_negative_control_dropping_the_pending_gradients_is_caught(tmp_path, plain):
    results, _ = run_job(tmp_path, "--accumulation", str(ACCUMULATION), "--fault", "dropped_pending_gradients")
    broken = {k: d for k, d in worst_differences(plain("mlp"), results).items() if k.startswith("weight/") and d > 1e-3}
    assert broken


def test_plain_keras_accumulates_as_the_comparison_assumes():
    # The reference really accumulates: its `iterations` counts updates, not steps.
    model = gradient_paths.build_model("mlp", ACCUMULATION)
    x, y = gradient_paths.make_data("mlp")
    model.fit(x[:192], y[:192], batch_size=64, epochs=1, verbose=0)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 1


def test_a_checkpoint_between_micro_steps_holds_the_whole_accumulated_gradient(tmp_path):
    # Epoch 1 ends after step 10: updates at 3, 6, 9, and one micro-step pending.
    # The file must hold what one device would have accumulated by then.
    import h5py

    (tmp_path / "plain").mkdir()
    gradient_paths.train(
        "mlp", accumulation=ACCUMULATION, callbacks=[gradient_paths.checkpoint(str(tmp_path / "plain"))]
    )
    run_job(tmp_path, "--accumulation", str(ACCUMULATION), "--checkpoint")

    def datasets(path):
        found = {}

        def keep(name, item):  # returning anything but None would stop the visit
            if isinstance(item, h5py.Dataset):
                found[name] = item[()]

        with h5py.File(path) as file:
            file.visititems(keep)
        return found

    expected = datasets(tmp_path / "plain" / "epoch1.weights.h5")
    saved = datasets(tmp_path / "epoch1.weights.h5")
    assert saved.keys() == expected.keys()
    accumulators = [name for name in expected if name.startswith("optimizer/") and np.abs(expected[name]).max() > 0]
    assert accumulators  # the pending micro-step is in plain Keras' file
    for name, value in expected.items():
        np.testing.assert_allclose(saved[name], value, atol=1e-5, err_msg=name)
