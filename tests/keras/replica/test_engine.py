"""Equivalence of MirroredStrategy (2 and 3 logical CPU replicas) with plain Keras.

1000 samples in global batches of 64 leave a last batch of 40, which splits
unevenly over 3 replicas (14/13/13): exactly where an unweighted gradient
mean goes wrong.
"""


import keras
from tests import seeding
import numpy as np
import pytest

from kdist.errors import ReplicaGradientError
from kdist.keras import _compat
from tests.keras import _models as m

FIT = dict(batch_size=m.GLOBAL_BATCH, epochs=2, verbose=0)


def train_pair(builder, num_replicas, x, y, sample_weight=None, validation=None):
    """Fits the plain and the distributed model on the same global batches and shuffle order."""
    reference = builder()
    distributed = m.build_in_scope(builder, m.mirrored(num_replicas))
    histories = []
    for model in (reference, distributed):
        seeding.set_random_seed(11)  # same shuffle order for both
        history = model.fit(
            x, y, sample_weight=sample_weight, validation_data=validation, shuffle=True, **FIT
        )
        histories.append(history.history)
    return reference, distributed, histories


def assert_equivalent(builder, num_replicas, x, y, sample_weight=None, validation=None):
    reference, distributed, (ref_history, dist_history) = train_pair(
        builder, num_replicas, x, y, sample_weight, validation
    )
    m.assert_same_history(ref_history, dist_history)
    m.assert_same_state(reference, distributed)
    eval_kwargs = dict(batch_size=m.GLOBAL_BATCH, verbose=0, return_dict=True)
    m.assert_same_outputs(
        reference.evaluate(x, y, sample_weight=sample_weight, **eval_kwargs),
        distributed.evaluate(x, y, sample_weight=sample_weight, **eval_kwargs),
    )
    m.assert_same_outputs(
        reference.predict(x, batch_size=m.GLOBAL_BATCH, verbose=0),
        distributed.predict(x, batch_size=m.GLOBAL_BATCH, verbose=0),
    )
    return reference, distributed


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_mlp_with_l2_and_activity_regularizer_matches_plain_keras(num_replicas):
    x, y = m.classification_data()
    xv, yv = m.classification_data(200, seed=1)
    assert_equivalent(m.mlp_l2, num_replicas, x, y, validation=(xv, yv))


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_two_input_two_output_model_with_sample_and_loss_weights_matches(num_replicas):
    x, y, sample_weight = m.two_input_data()
    assert_equivalent(m.two_input_two_output, num_replicas, x, y, sample_weight=sample_weight)


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_subclassed_model_with_custom_train_step_matches(num_replicas):
    x, y = m.regression_data()
    assert_equivalent(m.custom_step, num_replicas, x, y)


def test_negative_control_unweighted_gradient_mean_breaks_equivalence():
    x, y, sample_weight = m.two_input_data()
    with m.fault(unweighted_gradient_mean=True):
        with pytest.raises(AssertionError):
            assert_equivalent(m.two_input_two_output, 3, x, y, sample_weight=sample_weight)


def test_negative_control_dropped_add_loss_breaks_equivalence():
    x, y = m.classification_data()
    with m.fault(drop_replica_losses=True):
        with pytest.raises(AssertionError):
            assert_equivalent(m.mlp_l2, 2, x, y)


def test_replica_without_gradient_raises_instead_of_training_on_fewer_replicas():
    x, y = m.classification_data(128)
    model = m.build_in_scope(m.mlp_l2, m.mirrored(2))
    before = [v.numpy().copy() for v in model.trainable_variables]
    with m.fault(drop_replica_gradients=True):
        with pytest.raises(ReplicaGradientError, match="Replica 1 produced no gradient"):
            model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    for value, variable in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_replica_device_mismatch_is_caught():
    """A logical replica whose scope resolves to another device loses its gradients; the step must raise."""
    x, y = m.classification_data(128)
    model = m.build_in_scope(m.mlp_l2, m.mirrored(2))
    # Simulate the pitfall: replica 1 runs under a device scope that Keras resolves to
    # "cpu:1", so StatelessScope copies the mapped Parameters and they stop being leaves.
    strategy = model._kdist_strategy
    original = strategy.extended.replica_device_scope

    def wrong_scope(replica_id):
        return keras.device("cpu:1") if replica_id == 1 else original(replica_id)

    strategy.extended.replica_device_scope = wrong_scope
    try:
        with pytest.raises(ReplicaGradientError):
            model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    finally:
        del strategy.extended.replica_device_scope


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_dropout_batchnorm_mlp_looser_check(num_replicas):
    """Dropout masks and BatchNorm batch statistics are per replica, so training is not
    bit-for-bit plain Keras. Checked instead: the first step's BatchNorm moving mean is
    exact (weighted mean of local means = global mean), training stays close to the
    reference, and evaluate/predict are exactly those of a plain model with the same weights.
    """
    x, y = m.classification_data()
    reference = m.mlp_dropout_batchnorm()
    distributed = m.build_in_scope(m.mlp_dropout_batchnorm, m.mirrored(num_replicas))

    first_batch = (x[:m.GLOBAL_BATCH], y[:m.GLOBAL_BATCH])
    reference.train_on_batch(*first_batch)
    distributed.train_on_batch(*first_batch)
    batchnorm = lambda model: model.layers[1]  # noqa: E731
    np.testing.assert_allclose(
        batchnorm(distributed).moving_mean.numpy(), batchnorm(reference).moving_mean.numpy(), atol=1e-6
    )
    assert int(distributed.optimizer.iterations.numpy()) == 1

    ref_history = reference.fit(x, y, shuffle=False, **FIT).history
    dist_history = distributed.fit(x, y, shuffle=False, **FIT).history
    np.testing.assert_allclose(dist_history["loss"], ref_history["loss"], rtol=0.1)
    np.testing.assert_allclose(dist_history["accuracy"], ref_history["accuracy"], atol=0.05)

    plain = m.mlp_dropout_batchnorm(seed=99)
    plain.set_weights(distributed.get_weights())
    kwargs = dict(batch_size=m.GLOBAL_BATCH, verbose=0)
    np.testing.assert_allclose(distributed.evaluate(x, y, **kwargs), plain.evaluate(x, y, **kwargs), atol=1e-5)
    np.testing.assert_allclose(distributed.predict(x, **kwargs), plain.predict(x, **kwargs), atol=1e-5)


def test_dropout_masks_differ_across_replicas():
    """Replica k runs with an offset seed: two identical shards must get different masks."""
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x, training=None):
            if training:  # skip Keras' symbolic build pass
                seen.append(keras.ops.convert_to_numpy(x).copy())
            return x

    def builder():
        m.seeded()
        model = keras.Sequential([keras.Input((50,)), keras.layers.Dropout(0.5), Probe(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    model = m.build_in_scope(builder, m.mirrored(2))
    x = np.ones((4, 50), "float32")
    model.train_on_batch(x, np.zeros((4, 1), "float32"))
    assert len(seen) == 2
    assert not np.array_equal(seen[0], seen[1])


def test_train_test_predict_on_batch_match_plain_keras():
    x, y = m.classification_data(70)
    reference = m.mlp_l2()
    distributed = m.build_in_scope(m.mlp_l2, m.mirrored(3))
    for model in (reference, distributed):
        model.train_on_batch(x, y)
        model.train_on_batch(x[:5], y[:5])  # fewer than... 5 samples over 3 replicas: 2/2/1
    m.assert_same_state(reference, distributed)
    m.assert_same_outputs(reference.test_on_batch(x, y), distributed.test_on_batch(x, y))
    m.assert_same_outputs(reference.predict_on_batch(x), distributed.predict_on_batch(x))


def test_batch_smaller_than_replicas_runs_on_the_replicas_that_have_data():
    x, y = m.classification_data(2)
    reference = m.mlp_l2()
    distributed = m.build_in_scope(m.mlp_l2, m.mirrored(3))
    reference.train_on_batch(x, y)
    distributed.train_on_batch(x, y)
    m.assert_same_state(reference, distributed)


def test_lazily_built_model_matches():
    def lazy():
        m.seeded()
        model = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    x, y = m.classification_data()
    assert_equivalent(lazy, 2, x, y)


def test_sum_reduction_loss_uses_plain_gradient_sum():
    def summed():
        m.seeded()
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(1e-4), loss=keras.losses.MeanSquaredError(reduction="sum"))
        return model

    x, y = m.regression_data(200)
    assert_equivalent(summed, 3, x, y)


def test_sum_reduction_loss_with_regularizer_is_refused_before_any_update():
    def summed_regularized():
        m.seeded()
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L2(1.0))]
        )
        model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
        return model

    from kdist.errors import UnsupportedError

    x, y = m.regression_data(64)
    model = m.build_in_scope(summed_regularized, m.mirrored(2))
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(UnsupportedError, match="reduction='sum'"):
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_class_weight_matches():
    x, y = m.classification_data()
    reference = m.mlp_l2()
    distributed = m.build_in_scope(m.mlp_l2, m.mirrored(3))
    class_weight = {0: 1.0, 1: 2.0, 2: 0.5, 3: 1.5}
    for model in (reference, distributed):
        model.fit(x, y, class_weight=class_weight, shuffle=False, **FIT)
    m.assert_same_state(reference, distributed)


@pytest.mark.skipif(
    _compat.TORCH_TRAINER_REJECTS_STEPS_PER_EXECUTION,
    reason="this Keras refuses steps_per_execution > 1 on torch (tests/keras/test_errors.py)",
)
@pytest.mark.parametrize("num_replicas", [2, 3])
def test_steps_per_execution_above_one_matches_plain_keras(num_replicas):
    x, y = m.classification_data()

    def build():
        model = m.mlp_l2()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), steps_per_execution=3,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    reference = build()
    distributed = m.build_in_scope(build, m.mirrored(num_replicas))
    histories = []
    for model in (reference, distributed):
        seeding.set_random_seed(11)
        histories.append(model.fit(x, y, shuffle=True, **FIT).history)
    m.assert_same_state(reference, distributed)
    m.assert_same_history(histories[0], histories[1])
