"""A re-run closure reports what its first run computed (`closure_outcome`).

A coordinator re-runs a closure whose worker died after some of its pushes were
applied. The servers do not apply those pushes twice (update ids), and the
re-run must not report metrics computed from the weights they already changed:
each push carries the closure's metric state, and a deduplicated push gives the
first run's back.

Real variable servers on loopback ports, in this process; the closure is the one
coordinator `fit` schedules (`chief_fit.run_steps`) on the worker's own model.
"""

import logging

import keras
import numpy as np
import pytest

import kdist
from kdist.errors import InvalidArgumentError
from kdist.keras.parameter_server import closure_outcome, worker_steps
from kdist.keras.parameter_server.chief_fit import run_steps
from kdist.ps.wire.values import MAX_OUTCOME_BYTES, DenseGradient
from tests.keras import _models, _ps

pytestmark = pytest.mark.timeout(180)

STEPS = 4
CLOSURE = "closure-3"


def _mlp_batchnorm():
    """An MLP with BatchNormalization (state each step assigns) and no Dropout.

    A worker's dropout masks come from its own seed state (it does not live on
    the servers), so a closure re-run on another worker draws other masks, as
    in TensorFlow: not a case for an exact comparison.
    """
    _models.seeded(7)
    model = keras.Sequential([
        keras.Input((12,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(4),
    ])
    return _models.compile_classifier(model)


def _batches():
    x, y = _models.classification_data(STEPS * 32)
    return [(x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32]) for i in range(STEPS)]


def _closure(first_run_steps=None):
    """Metric states, final weights and deduplicated pushes of closure `CLOSURE`.

    `first_run_steps`: the closure first ran this many of its steps (its worker
    died after that many pushes), then ran again whole.
    """
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        model = _models.build_in_scope(_mlp_batchnorm, strategy)
        router = strategy.extended.variable_router
        batches = _batches()
        if first_run_steps is not None:
            with router.idempotent_updates(CLOSURE):
                run_steps(model, "train", batches, first_run_steps)
        with router.idempotent_updates(CLOSURE):
            states, _ = run_steps(model, "train", batches, STEPS)
        worker_steps.session_of(model).read_back()
        weights = [np.asarray(keras.ops.convert_to_numpy(v)) for v in model.weights]
        return states, weights, sum(stats.deduplicated_updates for stats in router.stats())


@pytest.fixture(scope="module")
def uninterrupted():
    states, weights, deduplicated = _closure()
    assert deduplicated == 0
    return states, weights


@pytest.mark.parametrize("first_run_steps", [1, 3])
def test_a_rerun_closure_reports_the_first_run_s_metrics_and_weights(uninterrupted, first_run_steps):
    states, weights, deduplicated = _closure(first_run_steps)
    # Each step pushes to both servers; those the first run delivered are deduplicated.
    assert deduplicated == 2 * first_run_steps
    for got, expected in zip(states, uninterrupted[0]):
        np.testing.assert_array_equal(got, expected)
    for got, expected in zip(weights, uninterrupted[1]):
        np.testing.assert_array_equal(got, expected)


def test_control_without_the_outcome_the_rerun_s_metrics_differ(uninterrupted, monkeypatch, caplog):
    monkeypatch.setattr(closure_outcome, "encode", lambda variables: b"")
    with caplog.at_level(logging.WARNING, logger=closure_outcome.__name__):
        states, weights, _ = _closure(2)
    assert "not that run's metric state (0 bytes kept" in caplog.text
    # The loss of the two steps already applied was computed on the updated weights.
    assert any(not np.array_equal(got, expected) for got, expected in zip(states, uninterrupted[0]))
    for got, expected in zip(weights, uninterrupted[1]):  # the updates themselves are exact
        np.testing.assert_array_equal(got, expected)


def test_an_outcome_is_kept_per_id_and_bounded():
    with _ps.in_process_servers(1) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            variable = keras.Variable(np.zeros(3, "float32"))
        router = strategy.extended.variable_router
        [route] = router.routes([variable])
        router.configure_optimizer(keras.optimizers.serialize(keras.optimizers.SGD(1.0)), [route])
        [client] = router.clients
        name = route.keys[0]
        gradient = [DenseGradient(name, np.ones(3, "float32"))]
        first = client.push(gradient, update_id="c/0", outcome=b"state after c/0")
        assert (first.deduplicated, first.outcome) == (False, b"")
        repeat = client.push(gradient, update_id="c/0", outcome=b"other")
        assert (repeat.deduplicated, repeat.outcome) == (True, b"state after c/0")
        assert repeat.versions == first.versions
        with pytest.raises(InvalidArgumentError, match=r"outcome=1048577 bytes"):
            client.push(gradient, update_id="c/1", outcome=b"x" * (MAX_OUTCOME_BYTES + 1))
        with pytest.raises(InvalidArgumentError, match=r"outcome=str"):
            client.push(gradient, update_id="c/1", outcome="text")
        # Refused before anything was sent: c/1 is still free, and applies once.
        assert client.push(gradient, update_id="c/1").deduplicated is False
        [value] = router.read_shards(route, [0])
        np.testing.assert_array_equal(value, np.full(3, -2.0))


def test_outcomes_survive_a_checkpoint_of_the_ids():
    from kdist.ps.server.autosaver import RememberedUpdateIds

    ids = RememberedUpdateIds(8)
    for index, outcome in enumerate([b"a\x00b", b""]):
        assert ids.claim(f"c/{index}") == (False, None)
        ids.record(f"c/{index}", ({"w": index + 1}, (), {}), outcome)
    restored = RememberedUpdateIds(8)
    restored.load(ids.snapshot(8))
    assert restored.claim("c/0") == (True, ({"w": 1}, (), {}))
    assert restored.outcome_of("c/0") == b"a\x00b"
    assert restored.outcome_of("c/1") == b""
    # A checkpoint written before outcomes were kept (four fields) still loads.
    old = RememberedUpdateIds(8)
    old.load([["c/0", {"w": 1}, [], {}]])
    assert old.claim("c/0") == (True, ({"w": 1}, (), {})) and old.outcome_of("c/0") == b""


def test_a_metric_state_too_large_to_carry_is_sent_without_it(uninterrupted, monkeypatch, caplog):
    monkeypatch.setattr(closure_outcome, "MAX_OUTCOME_BYTES", 4)
    monkeypatch.setattr(closure_outcome, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=closure_outcome.__name__):
        states, weights, _ = _closure(2)
    assert "more than a push carries (4)" in caplog.text
    assert "not that run's metric state (0 bytes kept" in caplog.text  # the re-run says what it lost
    for got, expected in zip(weights, uninterrupted[1]):  # training itself goes on, exact
        np.testing.assert_array_equal(got, expected)
