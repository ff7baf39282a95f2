"""Callbacks, saving and scope rules for models attached to a strategy."""

import csv
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest

import kdist
from kdist.errors import StrategyScopeError
from kdist.keras import _compat
from tests import harness
from tests.keras import _models as m

FIT = dict(batch_size=m.GLOBAL_BATCH, verbose=0, shuffle=False)


class StopAtEpoch(keras.callbacks.Callback):
    """Simulates a crash at the start of `epoch`."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("simulated preemption")


def test_model_created_in_scope_remembers_its_strategy():
    strategy = m.mirrored(2)
    model = m.build_in_scope(m.mlp_l2, strategy)
    assert model._kdist_strategy is strategy
    assert not kdist.has_strategy()  # fit/evaluate/predict outside the scope still distribute
    x, y = m.classification_data(100)
    model.fit(x, y, epochs=1, **FIT)
    assert model.train_function.__self__.__class__.__name__ == "ReplicaEngine"


def test_model_compiled_in_scope_is_attached():
    model = m.mlp_l2()
    strategy = m.mirrored(2)
    with strategy.scope():
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert model._kdist_strategy is strategy


def test_compiling_under_another_strategy_raises():
    model = m.build_in_scope(m.mlp_l2, m.mirrored(2))
    with pytest.raises(StrategyScopeError, match="created under"):
        with m.mirrored(3).scope():
            model.compile(optimizer="adam", loss="mse")


def test_fit_inside_another_strategys_scope_raises():
    model = m.build_in_scope(m.mlp_l2, m.mirrored(2))
    x, y = m.classification_data(64)
    with pytest.raises(StrategyScopeError):
        with m.mirrored(3).scope():
            model.fit(x, y, epochs=1, **FIT)


def test_plain_models_are_untouched():
    model = m.mlp_l2()
    assert not hasattr(model, "_kdist_strategy")
    assert "fit" not in vars(model)


def test_callbacks_behave_as_in_plain_keras(tmp_path):
    x, y = m.classification_data()
    xv, yv = m.classification_data(200, seed=3)

    def run(model, directory):
        directory.mkdir()
        callbacks = [
            keras.callbacks.ModelCheckpoint(str(directory / "best.keras"), save_best_only=True),
            keras.callbacks.ModelCheckpoint(str(directory / "{epoch}.weights.h5"), save_weights_only=True),
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0),
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9),
            keras.callbacks.CSVLogger(str(directory / "log.csv")),
        ]
        return model.fit(x, y, epochs=4, validation_data=(xv, yv), callbacks=callbacks, **FIT)

    reference = m.mlp_l2()
    distributed = m.build_in_scope(m.mlp_l2, m.mirrored(3))
    ref_history = run(reference, tmp_path / "plain")
    dist_history = run(distributed, tmp_path / "kdist")

    assert ref_history.epoch == dist_history.epoch
    m.assert_same_history(ref_history.history, dist_history.history)
    m.assert_same_state(reference, distributed)
    with open(tmp_path / "plain" / "log.csv") as ref_file, open(tmp_path / "kdist" / "log.csv") as dist_file:
        ref_rows, dist_rows = list(csv.DictReader(ref_file)), list(csv.DictReader(dist_file))
    assert [row["epoch"] for row in ref_rows] == [row["epoch"] for row in dist_rows]
    for ref_row, dist_row in zip(ref_rows, dist_rows):
        for key in ref_row:
            assert float(dist_row[key]) == pytest.approx(float(ref_row[key]), abs=1e-5)
    assert sorted(os.listdir(tmp_path / "plain")) == sorted(os.listdir(tmp_path / "kdist"))
    best = keras.saving.load_model(tmp_path / "kdist" / "best.keras")
    np.testing.assert_allclose(
        best.predict(xv, verbose=0), distributed.predict(xv, verbose=0), atol=1e-5
    )


def test_backup_and_restore_resumes_an_interrupted_fit(tmp_path):
    x, y = m.classification_data()
    backup = str(tmp_path / "backup")

    uninterrupted = m.build_in_scope(m.mlp_l2, m.mirrored(2))
    uninterrupted.fit(x, y, epochs=4, **FIT)

    resumed = m.build_in_scope(m.mlp_l2, m.mirrored(2))
    with pytest.raises(RuntimeError, match="simulated preemption"):
        resumed.fit(x, y, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(backup), StopAtEpoch(2)], **FIT)
    fresh = m.build_in_scope(lambda: m.mlp_l2(seed=123), m.mirrored(2))  # a restarted job
    history = fresh.fit(x, y, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(backup)], **FIT)

    assert history.epoch == [2, 3]
    m.assert_same_state(uninterrupted, fresh)


def test_saved_model_loads_in_a_process_without_kdist(tmp_path):
    x, y = m.classification_data(200)
    model = m.build_in_scope(m.mlp_dropout_batchnorm, m.mirrored(2))
    model.fit(x, y, epochs=1, **FIT)
    path = tmp_path / "model.keras"
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        config = archive.read("config.json").decode()
    assert "kdist" not in config
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", model.predict(x, verbose=0))
    script = f"""
import sys, numpy as np, keras
model = keras.saving.load_model({str(path)!r})
assert "kdist" not in sys.modules, "kdist was imported"
out = model.predict(np.load({str(tmp_path / 'x.npy')!r}), verbose=0)
np.testing.assert_allclose(out, np.load({str(tmp_path / 'expected.npy')!r}), atol=1e-6)
print("LOADED", type(model).__name__)
"""
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH="")
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "LOADED Sequential" in result.stdout


def test_save_weights_and_load_weights_roundtrip(tmp_path):
    x, y = m.classification_data(200)
    model = m.build_in_scope(m.mlp_l2, m.mirrored(2))
    model.fit(x, y, epochs=1, **FIT)
    model.save_weights(tmp_path / "w.weights.h5")
    plain = m.mlp_l2(seed=5)
    plain.load_weights(tmp_path / "w.weights.h5")
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


def test_history_json_serialisable():
    x, y = m.classification_data(200)
    model = m.build_in_scope(m.mlp_l2, m.mirrored(2))
    history = model.fit(x, y, epochs=2, **FIT)
    # Plain Python floats, one per epoch, for every metric: json keeps them exactly.
    assert set(history.history) == {"loss", "accuracy"}
    assert all(len(values) == 2 and all(type(value) is float for value in values)
               for values in history.history.values()), history.history
    assert json.loads(json.dumps(history.history)) == history.history


# ----- Keras 3.16's own DistributedDataParallel wrap -------------------------------
DDP_WORKER = Path(__file__).parent / "workers" / "ddp_wrap.py"


def _wrapped(tmp_path, strategy, num_processes, *extra):
    specs = harness.python_specs(harness.torchrun_envs(num_processes), DDP_WORKER, "--out", str(tmp_path),
                                 "--strategy", strategy, *extra)
    harness.run(specs, timeout=150).check()
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(num_processes)]


@pytest.mark.parametrize(
    "strategy, num_processes", [("multi_worker", 1), ("multi_worker", 2), ("mirrored", 1)]
)
def test_no_kdist_model_is_wrapped_in_distributed_data_parallel(tmp_path, strategy, num_processes):
    """Keras >= 3.16 wraps any torch model in DDP once torch.distributed is initialized;
    kdist combines gradients itself, so its models must never be wrapped (on 3.15
    nothing wraps; the negative control below shows the check bites on 3.16)."""
    for rank in _wrapped(tmp_path, strategy, num_processes):
        assert rank == {"fit": False, "evaluate": False, "predict": False}


@pytest.mark.skipif(not _compat.TORCH_TRAINER_WRAPS_DDP, reason="this Keras never wraps models in DDP")
def test_negative_control_letting_keras_wrap_is_caught(tmp_path):
    (rank,) = _wrapped(tmp_path, "multi_worker", 1, "--allow-wrap")
    assert rank["fit"] is True


# ----- Keras 3.16's own keras.distribution.DataParallel, kdist installed but unused -----
DATA_PARALLEL_WORKER = Path(__file__).parent / "workers" / "upstream_data_parallel.py"
_needs_upstream_data_parallel = pytest.mark.skipif(
    not _compat.TORCH_TRAINER_WRAPS_DDP, reason="this Keras has no multi-process DataParallel on torch"
)


def _data_parallel_run(tmp_path, mode):
    out = tmp_path / mode
    out.mkdir()
    specs = harness.python_specs(harness.torchrun_envs(2), DATA_PARALLEL_WORKER, "--out", str(out), "--mode", mode)
    harness.run(specs, timeout=150).check()
    ranks = []
    for rank in range(2):
        with np.load(out / f"rank{rank}.npz") as arrays:
            ranks.append({name: arrays[name] for name in arrays.files})
    return ranks


def _differences(a, b):
    assert a.keys() == b.keys()
    return {name: float(np.max(np.abs(a[name].astype("float64") - b[name].astype("float64"))))
            for name in a if not np.array_equal(a[name], b[name])}


@_needs_upstream_data_parallel
def test_an_upstream_data_parallel_program_is_unchanged_by_loading_kdist(tmp_path):
    """A Keras 3.16 DataParallel program (two processes, Keras' own DDP wrap and metric
    reduction) gives bit-identical weights, optimizer slots, history, evaluate and
    predict whether or not kdist and all its hooks are loaded in the process."""
    plain = _data_parallel_run(tmp_path, "plain")
    loaded = _data_parallel_run(tmp_path, "hooks")
    for rank in range(2):
        assert plain[rank]["wrapped"] and loaded[rank]["wrapped"], "Keras' own DDP wrap must still happen"
        assert _differences(plain[rank], loaded[rank]) == {}
    # DDP kept the two ranks in step (so the comparison above covers a synchronised run).
    assert _differences({k: v for k, v in plain[0].items() if k.startswith("weight/")},
                        {k: v for k, v in plain[1].items() if k.startswith("weight/")}) == {}


@_needs_upstream_data_parallel
def test_negative_control_kdist_unwrapping_a_user_model_is_caught(tmp_path):
    """If kdist's keep-out-of-DDP reached a model it does not own, the comparison fails."""
    plain = _data_parallel_run(tmp_path, "plain")
    unwrapped = _data_parallel_run(tmp_path, "kdist-unwraps")
    assert not unwrapped[0]["wrapped"]
    differences = _differences(plain[0], unwrapped[0])
    assert any(name.startswith("weight/") for name in differences), differences


@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_a_model_made_outside_every_scope_is_refused_inside_one(method):
    """tf.distribute refuses variables created outside the strategy's scope; here the
    model would otherwise silently run on one device."""
    x, y = m.classification_data(64)
    model = m.mlp_l2()
    before = [v.numpy().copy() for v in model.weights]
    strategy = m.mirrored(2)
    with strategy.scope():
        with pytest.raises(StrategyScopeError, match="outside every strategy's scope"):
            getattr(model, method)(x, y, batch_size=32, verbose=0) if method != "predict" else model.predict(x, verbose=0)
    for value, variable in zip(before, model.weights):
        np.testing.assert_array_equal(variable.numpy(), value)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # outside the scope: plain Keras
