"""Models built as model libraries build them attach in every kdist scope and train like plain Keras.

keras-hub's backbones and tasks keep their own `__setattr__`, so Keras' layer
tracking does not exist yet while `Trainer.__init__` runs, which is where kdist
attaches a model created in a scope. Nothing kdist does at attach may read the
model's layers (issue 36: every keras-hub model failed to build under
`MirroredStrategy` with 2 replicas). Each test builds the model *inside* the
scope and compares with plain Keras on the same global batches.
"""

import keras
from tests import seeding
import numpy as np
import pytest

import kdist
from kdist.keras import hooks
from tests.keras import _models as m
from tests.keras import _ps
from tests.keras import library_models
from tests.keras.replica import test_multi_worker as multi_worker_job
from tests.keras.workers import fit_equivalence

TOLERANCE = 1e-5


def _scope(strategy):
    return strategy.scope() if strategy is not None else _NullScope()


class _NullScope:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _train(strategy, batchnorm=None, initial_weights=None, started=None):
    seeding.set_random_seed(3)
    x, y = fit_equivalence.make_data()
    with _scope(strategy):
        model = library_models.classifier(batchnorm=batchnorm)
        if initial_weights is not None:
            model.set_weights(initial_weights)
        if started is not None:
            started.extend(model.get_weights())
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(x[:200], y[:200], batch_size=30, epochs=2, shuffle=False, verbose=0)
    evaluation = model.evaluate(x[200:300], y[200:300], batch_size=30, verbose=0)
    predictions = model.predict(x[300:333], batch_size=30, verbose=0)
    return model, history.history, evaluation, predictions


def _assert_same(reference, candidate):
    plain, plain_history, plain_evaluation, plain_predictions = reference
    model, history, evaluation, predictions = candidate
    for a, b in zip(plain.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE)
    for key, values in plain_history.items():
        np.testing.assert_allclose(values, history[key], rtol=TOLERANCE, atol=TOLERANCE)
    np.testing.assert_allclose(plain_evaluation, evaluation, rtol=TOLERANCE, atol=TOLERANCE)
    np.testing.assert_allclose(plain_predictions, predictions, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.fixture(scope="module")
def reference():
    return _train(None)


def test_the_library_style_model_has_no_layers_while_trainer_init_runs(monkeypatch):
    # The premise of this file: where kdist attaches, such a model has no `_layers` yet.
    seen = []
    original = kdist.keras._compat.Trainer.__init__

    def probing_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(hasattr(self, "_layers"))

    monkeypatch.setattr(kdist.keras._compat.Trainer, "__init__", probing_init)
    library_models.LibraryStyleBackbone()
    assert seen and seen[0] is False


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_built_in_a_mirrored_scope_trains_like_plain_keras(reference, num_replicas):
    strategy = m.mirrored(num_replicas)
    candidate = _train(strategy)
    assert hooks.strategy_of(candidate[0]) is strategy
    if num_replicas == 2:
        assert candidate[0].train_function.__self__.__class__.__name__ == "ReplicaEngine"
    _assert_same(reference, candidate)


def test_synchronized_batchnorm_in_a_library_model_still_runs_in_merge_mode():
    # Merge mode is decided once the model is built (at the start of each call), not at attach.
    # Synchronized statistics over 2 replicas are one device's over the global batch.
    candidate = _train(m.mirrored(2), batchnorm="synchronized")
    assert candidate[0]._kdist_engine._merge_mode is True
    _assert_same(_train(None, batchnorm="plain"), candidate)


def test_built_in_a_parameter_server_scope_trains_like_plain_keras(reference):
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        candidate = _train(strategy)
        assert hooks.strategy_of(candidate[0]) is strategy
        _assert_same(reference, candidate)


def test_built_in_a_multi_worker_scope_in_two_processes_trains_like_plain_keras(tmp_path):
    reference = fit_equivalence.train(model_kind="library")
    ranks = multi_worker_job.run_job(tmp_path, 2, "--model", "library")
    multi_worker_job.assert_ranks_identical(ranks)
    multi_worker_job.assert_matches(reference, ranks[0])


def test_built_in_a_coordinator_scope_trains_like_plain_keras(tmp_path):
    # The chief creates the model in the scope; each worker rebuilds it from its config.
    import kdist.coordinator
    from tests.coordinator import _cluster

    with _cluster.start(num_workers=1, num_ps=1, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        # One closure in flight: batches apply in plain Keras' order.
        kdist.coordinator.ClusterCoordinator(strategy, closures_in_flight_per_worker=1)
        initial = []
        try:
            candidate = _train(strategy, started=initial)
        finally:
            strategy.extended.cluster_coordinator.shutdown()
    assert hooks.strategy_of(candidate[0]) is strategy
    # As tests/coordinator/test_coordinator_fit.py: the servers draw the initial values.
    _assert_same(_train(None, initial_weights=initial), candidate)
