"""Any `Trainer` attaches, whatever methods its class lacks; torch BatchNorm on a 1-sample shard is refused.

Keras' own trainer tests build models as `class ExampleModel(Trainer, layers.Dense)`:
such a class has `fit`/`evaluate`/`predict` but no `save`, `save_weights` or
`load_weights`. Attaching it to a strategy must work and train exactly as plain
Keras does. A `TorchModuleWrapper` holding `torch.nn.BatchNorm1d`, fit on a
global batch of 3 over 2 replicas, would hand one replica a single sample,
which torch refuses mid-step: kdist refuses it before the step, changing nothing.
"""

import keras
import numpy as np
import pytest
import torch

import kdist
from kdist.errors import InvalidArgumentError
from kdist.keras import _compat
from tests.keras import _models as m

SAMPLES, FEATURES, UNITS, BATCH = 13, 4, 3, 8  # the last batch of 5 splits 3+2: replicas are weighted


class ExampleModel(_compat.TorchTrainer, keras.layers.Dense):
    """As Keras' trainer_test.py: a model is a layer mixed in with a Trainer (no save/save_weights/load_weights)."""

    def __init__(self, units=UNITS):
        keras.layers.Dense.__init__(self, units=units, use_bias=False, kernel_initializer=keras.initializers.Ones())
        _compat.TorchTrainer.__init__(self)


class ModelWithoutWeightFiles(keras.Model):
    """A `keras.Model` subclass whose class switched off `save_weights` and `load_weights`."""

    save_weights = None
    load_weights = None

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(UNITS, kernel_initializer="ones")

    def call(self, inputs):
        return self.dense(inputs)


class ExampleModelThatSavesWeights(ExampleModel):
    """Has its own `save_weights` (a NumPy file) and still no `save` or `load_weights`."""

    def save_weights(self, filepath):
        np.save(filepath, self.get_weights()[0])


def _data():
    rng = np.random.default_rng(0)
    return rng.random((SAMPLES, FEATURES), dtype=np.float32), rng.random((SAMPLES, UNITS), dtype=np.float32)


def _train(model_class, strategy):
    """Builds, fits, evaluates and predicts; returns `(model, history, evaluation, predictions)`."""
    x, y = _data()
    scope = strategy.scope() if strategy is not None else _nullscope()
    with scope:
        model = model_class()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    evaluation = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    return model, history, evaluation, predictions


class _nullscope:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _assert_same_training(reference, candidate):
    (plain, plain_history, plain_eval, plain_pred), (model, history, evaluation, pred) = reference, candidate
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for key in plain_history:
        np.testing.assert_allclose(plain_history[key], history[key], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(plain_eval, evaluation, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(plain_pred, pred, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_class", [ExampleModel, ModelWithoutWeightFiles, ExampleModelThatSavesWeights])
def test_model_lacking_save_methods_attaches_and_trains_like_plain_keras(model_class):
    reference = _train(model_class, None)
    candidate = _train(model_class, m.mirrored(2))
    model = candidate[0]
    assert kdist.keras.hooks.strategy_of(model) is not None
    # The replica engine ran the steps (two replicas), not Keras' own step function.
    assert model.train_function.__self__.__class__.__name__ == "ReplicaEngine"
    _assert_same_training(reference, candidate)
    for name in ("save", "save_weights", "load_weights"):
        plain_value = getattr(reference[0], name, "absent")
        if plain_value == "absent" or plain_value is None:
            # What the class lacks stays as plain Keras has it: absent, or the class's None.
            assert name not in vars(model)
            assert getattr(model, name, "absent") == plain_value


def test_a_method_the_class_has_is_still_scoped(tmp_path):
    strategy = m.mirrored(2)
    with strategy.scope():
        model = ExampleModelThatSavesWeights()
        model.compile(optimizer="sgd", loss="mse")
    assert "save_weights" in vars(model) and "load_weights" not in vars(model)
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, verbose=0)
    model.save_weights(tmp_path / "w.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "w.npy"), model.get_weights()[0])


def test_negative_control_an_engine_bug_breaks_the_equivalence():
    """The comparison above can fail: unweighted replica gradients (3+2 split) differ from plain Keras."""
    reference = _train(ExampleModel, None)
    with m.fault(unweighted_gradient_mean=True):
        candidate = _train(ExampleModel, m.mirrored(2))
    with pytest.raises(AssertionError):
        _assert_same_training(reference, candidate)


# ----- torch BatchNorm inside a TorchModuleWrapper ------------------------------------
def _batchnorm_model(strategy, batchnorm=True):
    torch.manual_seed(0)
    scope = strategy.scope() if strategy is not None else _nullscope()
    with scope:
        layers = [torch.nn.Linear(2, 4)] + ([torch.nn.BatchNorm1d(4)] if batchnorm else [])
        model = keras.Sequential(
            [keras.Input((2,)), keras.layers.TorchModuleWrapper(torch.nn.Sequential(*layers)), keras.layers.Dense(1)]
        )
        model.compile(optimizer="adam", loss="mse")
    return model


def _batch(n):
    rng = np.random.default_rng(n)
    return rng.random((n, 2), dtype=np.float32), rng.random((n, 1), dtype=np.float32)


def _state(model):
    buffers = [b.clone() for b in model.layers[0].module.buffers()]
    return [w.copy() for w in model.get_weights()], buffers, int(model.optimizer.iterations)


def _assert_state_unchanged(before, after):
    (weights, buffers, iterations), (weights_now, buffers_now, iterations_now) = before, after
    assert iterations_now == iterations
    for a, b in zip(weights, weights_now):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(buffers, buffers_now):
        assert torch.equal(a, b)


@pytest.mark.parametrize("call", ["fit", "train_on_batch"])
def test_torch_batchnorm_on_a_one_sample_shard_is_refused_before_the_step(call):
    model = _batchnorm_model(m.mirrored(2))
    x, y = _batch(3)
    model.predict(x, verbose=0)  # built, optimizer variables still unbuilt or zero
    before = _state(model)
    with pytest.raises(InvalidArgumentError, match=r"split 2\+1 over 2 replicas") as raised:
        if call == "fit":
            model.fit(x, y, batch_size=3, verbose=0)
        else:
            model.train_on_batch(x, y)
    message = str(raised.value)
    assert "BatchNorm1d inside a TorchModuleWrapper" in message and "batch_size of at least 4" in message
    assert "one replica" in message and "Nothing was changed" in message
    _assert_state_unchanged(before, _state(model))


def test_torch_batchnorm_trains_when_every_replica_gets_two_samples():
    model = _batchnorm_model(m.mirrored(2))
    x, y = _batch(4)
    before = _state(model)
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0).history
    assert int(model.optimizer.iterations) == 2 and np.isfinite(history["loss"]).all()
    assert not np.array_equal(before[0][0], model.get_weights()[0])
    # Evaluation uses the running statistics: a 1-sample shard is fine there.
    assert np.isfinite(model.evaluate(*_batch(3), batch_size=3, verbose=0))


def test_refusal_is_precise_plain_keras_one_replica_and_no_batchnorm_train_on_three():
    x, y = _batch(3)
    for model in (_batchnorm_model(None), _batchnorm_model(m.mirrored(1)), _batchnorm_model(m.mirrored(2), False)):
        model.fit(x, y, batch_size=3, verbose=0)
        assert int(model.optimizer.iterations) == 1


def test_negative_control_without_the_check_torch_fails_mid_step_after_moving_statistics():
    """What the check prevents: the engine alone runs replica 0, then torch raises its own
    error mid-step, naming neither the split nor the fix. (The replicas' buffer copies,
    kdist/keras/replica/torch_buffers.py, keep the running mean where it was.)"""
    model = _batchnorm_model(m.mirrored(2))
    x, y = _batch(3)
    model.predict(x, verbose=0)
    model.make_train_function()
    running_mean = model.layers[0].module[1].running_mean.clone()
    engine = model.train_function.__self__ if hasattr(model.train_function, "__self__") else None
    engine = engine or model._kdist_engine
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        engine.train_function([(torch.from_numpy(x), torch.from_numpy(y))])
    assert torch.equal(running_mean, model.layers[0].module[1].running_mean)


def test_input_split_per_rank_is_checked_over_this_ranks_replicas(monkeypatch):
    """A rank's own batch (input split per rank) is split over its local replicas, not all of them."""
    import types

    from kdist.keras.replica import adapter, per_rank_input

    engine = types.SimpleNamespace(num_replicas=2, strategy=types.SimpleNamespace(num_replicas_in_sync=4))
    guard = adapter.BatchNormShardGuard(engine, "train")
    guard.modules = [("module.1", torch.nn.BatchNorm1d(3))]
    four, three = (np.zeros((4, 3), "float32"),), (np.zeros((3, 3), "float32"),)
    with pytest.raises(InvalidArgumentError, match=r"the global batch of 4 samples is split 1\+1\+1\+1"):
        guard.check([four])
    monkeypatch.setattr(per_rank_input, "uses_batch_whole", lambda: True)
    guard.check([four])  # 2+2 over this rank's two replicas
    with pytest.raises(InvalidArgumentError, match=r"this rank's batch .* of 3 samples is split 2\+1 over 2"):
        guard.check([three])
    # A rank whose per-rank generator ran out steps on with a 1-sample stand-in of weight 0: not refused.
    per_rank_input.set_batch_kind(True, stand_in=True)
    try:
        guard.check([(np.zeros((1, 3), "float32"),)])
    finally:
        per_rank_input.set_batch_kind(False)
    # (Several processes: every rank raises when any rank's batch splits badly, in
    # tests/keras/replica/test_per_rank_input.py, batchnorm_on_one_rank.)
