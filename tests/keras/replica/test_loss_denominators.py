"""Replica weights from the losses' own divisors, float8 state, nested logs: equal to plain Keras.

Plain Keras divides a masked or `ignore_class` loss by the number of entries
that count, and a `"mean_with_sample_weight"` loss by the weight sum; shards
with different amounts of padding or ignored labels then carry different
weights. 200 samples in global batches of 32 leave a last batch of 8 (3/3/2
over 3 replicas). Each case has a negative control that restores the wrong rule.
"""


import keras
from tests import seeding
import numpy as np
import pytest
import torch

from kdist.keras.replica import loss_denominators
from tests.keras import _models as m

NUM = 200
BATCH = 32
FIT = dict(batch_size=BATCH, epochs=2, verbose=0)
VOCAB, STEPS, CLASSES = 12, 7, 5


def train_pair(builder, num_replicas, x, y, sample_weight=None):
    reference = builder()
    distributed = m.build_in_scope(builder, m.mirrored(num_replicas))
    histories = []
    for model in (reference, distributed):
        seeding.set_random_seed(11)  # same shuffle order for both
        history = model.fit(x, y, sample_weight=sample_weight, shuffle=True, **FIT)
        histories.append(history.history)
    return reference, distributed, histories


def assert_equivalent(builder, num_replicas, x, y, sample_weight=None, rtol=1e-5):
    reference, distributed, (ref_history, dist_history) = train_pair(builder, num_replicas, x, y, sample_weight)
    assert ref_history.keys() == dist_history.keys()
    for key in ref_history:
        np.testing.assert_allclose(dist_history[key], ref_history[key], atol=1e-5, rtol=rtol, err_msg=key)
    m.assert_same_state(reference, distributed, rtol=rtol)
    eval_kwargs = dict(batch_size=BATCH, verbose=0, return_dict=True, sample_weight=sample_weight)
    m.assert_same_outputs(reference.evaluate(x, y, **eval_kwargs), distributed.evaluate(x, y, **eval_kwargs))
    return reference, distributed


def assert_not_equivalent(builder, num_replicas, x, y, sample_weight=None):
    reference, distributed, _ = train_pair(builder, num_replicas, x, y, sample_weight)
    with pytest.raises(AssertionError):
        m.assert_same_state(reference, distributed)


# ----- models and data ----------------------------------------------------------------
def masked_sequences(seed=0):
    """Token sequences padded with 0 at the end, lengths 1..STEPS: every shard has its own padding."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, STEPS + 1, size=NUM)
    x = rng.integers(1, VOCAB, size=(NUM, STEPS))
    x[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0
    y = (x + 1) % CLASSES
    return x.astype("int64"), y.astype("int64")


def masked_gru(seed=7):
    m.seeded(seed)
    model = keras.Sequential(
        [
            keras.Input((STEPS,), dtype="int64"),
            keras.layers.Embedding(VOCAB, 6, mask_zero=True),
            keras.layers.GRU(8, return_sequences=True),
            keras.layers.Dense(CLASSES),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def masked_dense(seed=7):
    """Embedding(mask_zero) → Dense per timestep: the mask reaches the per-timestep loss."""
    m.seeded(seed)
    model = keras.Sequential(
        [
            keras.Input((STEPS,), dtype="int64"),
            keras.layers.Embedding(VOCAB, 6, mask_zero=True),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(CLASSES),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def ignored_labels(seed=0):
    """Labels with class 0 ("ignore") at random: each shard ignores a different number."""
    x, y = m.classification_data(NUM, seed=seed)
    rng = np.random.default_rng(seed + 1)
    y = np.where(rng.random(NUM) < 0.35, 0, y + 1).astype("int64")
    return x, y


def ignore_class_mlp(seed=7):
    m.seeded(seed)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
            keras.layers.Dense(5),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
        metrics=["accuracy"],
    )
    return model


def weighted_mean_mlp(seed=7, reduction="mean_with_sample_weight"):
    m.seeded(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.MeanSquaredError(reduction=reduction),
        metrics=["mae"],
    )
    return model


def skewed_sample_weights(seed=0):
    rng = np.random.default_rng(seed)
    return np.where(rng.random(NUM) < 0.5, 0.1, 3.0).astype("float32") * rng.uniform(0.5, 1.5, NUM).astype("float32")


# ----- (a) masks from mask_zero ---------------------------------------------------------
@pytest.mark.parametrize("num_replicas", [2, 3])
def test_mask_zero_per_timestep_loss_matches_plain_keras(num_replicas):
    x, y = masked_sequences()
    assert_equivalent(masked_dense, num_replicas, x, y)


def test_mask_zero_through_gru_matches_plain_keras():
    x, y = masked_sequences()
    assert_equivalent(masked_gru, 3, x, y, rtol=1e-4)


def test_negative_control_sample_count_weights_break_masked_loss():
    x, y = masked_sequences()
    with m.fault(sample_count_weights=True):
        assert_not_equivalent(masked_dense, 3, x, y)


# ----- (b) ignore_class ---------------------------------------------------------------------
@pytest.mark.parametrize("num_replicas", [2, 3])
def test_ignore_class_matches_plain_keras(num_replicas):
    x, y = ignored_labels()
    assert_equivalent(ignore_class_mlp, num_replicas, x, y)


def test_negative_control_sample_count_weights_break_ignore_class():
    x, y = ignored_labels()
    with m.fault(sample_count_weights=True):
        assert_not_equivalent(ignore_class_mlp, 3, x, y)


# ----- (c) sample weights -------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean_with_sample_weight", "sum_over_batch_size"])
def test_sample_weighted_losses_match_plain_keras(reduction):
    x, y = m.regression_data(NUM)
    assert_equivalent(lambda: weighted_mean_mlp(reduction=reduction), 3, x, y, sample_weight=skewed_sample_weights())


def test_negative_control_sample_count_weights_break_mean_with_sample_weight():
    x, y = m.regression_data(NUM)
    with m.fault(sample_count_weights=True):
        assert_not_equivalent(weighted_mean_mlp, 3, x, y, sample_weight=skewed_sample_weights())


# ----- the recorder on its own ----------------------------------------------------------------
def test_recorder_reads_the_divisor_keras_used():
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    y = np.array([0, 1, 2, 0, 3])
    logits = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    loss_denominators.begin()
    try:
        value = loss(y, logits)
        denominator = loss_denominators.take()
    finally:
        loss_denominators.end()
    assert float(denominator) == 3.0
    per_sample = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)(y, logits)
    np.testing.assert_allclose(float(value), float(keras.ops.sum(per_sample[y != 0])) / 3.0, rtol=1e-6)


def test_recorder_falls_back_where_the_divisor_is_the_count_or_unknown():
    values = np.ones((4, 3), "float32")
    cases = [keras.losses.MeanSquaredError(), keras.losses.MeanSquaredError(reduction="sum")]
    for loss in cases:
        loss_denominators.begin()
        try:
            loss(values, values * 2)
            assert loss_denominators.take() is None
        finally:
            loss_denominators.end()
    # Nothing is recorded outside begin()/end().
    keras.losses.MeanSquaredError()(values, values)
    assert loss_denominators.take() is None


def test_two_losses_with_different_divisors_fall_back():
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    logits = np.zeros((4, 3), "float32")
    loss_denominators.begin()
    try:
        loss(np.array([0, 1, 1, 1]), logits)
        loss(np.array([0, 0, 1, 1]), logits)
        denominator = loss_denominators.take()
    finally:
        loss_denominators.end()
    weights = loss_denominators.replica_weights([denominator, torch.tensor(2.0, dtype=torch.float64)], [4, 4])
    assert list(weights) == [0.5, 0.5]


def test_replica_weights_rule():
    d = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    assert list(loss_denominators.replica_weights([d(3.0), d(1.0)], [4, 4])) == [0.75, 0.25]
    assert list(loss_denominators.replica_weights([None, None], [3, 1])) == [0.75, 0.25]
    assert list(loss_denominators.replica_weights([d(3.0), None], [2, 2])) == [0.5, 0.5]
    # Every entry masked everywhere: no divisor to share, sample counts.
    assert list(loss_denominators.replica_weights([d(0.0), d(0.0)], [1, 3])) == [0.25, 0.75]
    weights = loss_denominators.replica_weights([d(3.0), d(1.0)], [1, 3])
    assert weights.sample_shares == [0.25, 0.75] and weights.total == 4


# ----- (d) float8 -----------------------------------------------------------------------------
def float8_mlp(seed=7):
    m.seeded(seed)
    model = keras.Sequential(
        [keras.Input((12,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)]
    )
    model.quantize("float8")
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _float8_state(model):
    """`(name, value)` of every scale and amax history, in creation order."""
    return [
        (v.path.split("/")[-1], np.asarray(keras.ops.convert_to_numpy(v)))
        for v in model.variables
        if getattr(v, "overwrite_with_gradient", False)
    ]


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_float8_scales_and_amax_histories_match_plain_keras(num_replicas):
    x, y = m.classification_data(NUM)
    reference, distributed, _ = train_pair(float8_mlp, num_replicas, x, y)
    ref_state, dist_state = _float8_state(reference), _float8_state(distributed)
    assert [name for name, _ in ref_state] == [name for name, _ in dist_state] and len(ref_state) == 12
    # Float8 rounding amplifies float32 summation-order differences a little
    # (an element on a rounding edge flips): relative 1e-3, not 1e-5; the
    # negative control is off by 10-20%.
    for (name, ref), (_, dist) in zip(ref_state, dist_state):
        np.testing.assert_allclose(dist, ref, rtol=1e-3, atol=1e-8, err_msg=name)
    for ref, dist in zip(reference.trainable_variables, distributed.trainable_variables):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(dist), keras.ops.convert_to_numpy(ref), rtol=1e-3, atol=5e-4, err_msg=ref.path
        )
    assert int(distributed.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())


def test_negative_control_float8_mean_breaks_amax_histories():
    x, y = m.classification_data(NUM)
    with m.fault(float8_mean=True):
        reference, distributed, _ = train_pair(float8_mlp, 3, x, y)
    worst = max(
        float(np.max(np.abs(dist - ref) / (np.abs(ref) + 1e-7)))
        for (name, ref), (_, dist) in zip(_float8_state(reference), _float8_state(distributed))
        if name == "inputs_amax_history"
    )
    assert worst > 0.05


# ----- (e) nested logs ------------------------------------------------------------------------
class NestedLogsModel(keras.Model):
    """keras.io's pattern: the default step body, logs returned as `{m.name: m.result()}`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(5)

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        y_pred = self(x, training=True)
        self.zero_grad()
        loss = self.compute_loss(y=y, y_pred=y_pred)
        loss.backward()
        self.optimizer.apply([v.value.grad for v in self.trainable_weights], self.trainable_weights)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss, sample_weight=keras.ops.shape(x)[0])
            else:
                metric.update_state(y, y_pred)
        return {metric.name: metric.result() for metric in self.metrics}


def nested_logs_model(seed=7):
    m.seeded(seed)
    model = NestedLogsModel()
    model.build((None, 12))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
        metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")],
    )
    return model


def test_nested_logs_history_matches_plain_keras():
    x, y = ignored_labels()
    reference, distributed, (ref_history, dist_history) = train_pair(nested_logs_model, 3, x, y)
    assert set(ref_history) == {"loss", "accuracy", "top2"}
    m.assert_same_history(ref_history, dist_history)
    m.assert_same_state(reference, distributed)


def test_negative_control_unflattened_logs_break_history():
    x, y = ignored_labels()
    with m.fault(unflattened_logs=True):
        _, _, (ref_history, dist_history) = train_pair(nested_logs_model, 3, x, y)
    with pytest.raises(AssertionError):
        m.assert_same_history(ref_history, dist_history)
