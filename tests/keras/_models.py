"""Model builders and comparisons shared by the Keras integration tests.

Every builder seeds Keras first, so two calls (one plain, one inside a
strategy's scope) create identical initial weights.
"""

import contextlib

import keras
from tests import seeding
import numpy as np

import kdist  # noqa: F401  (sets KERAS_BACKEND before keras is imported)
from kdist import faults

NUM_SAMPLES = 1000
GLOBAL_BATCH = 64  # 1000 = 15 * 64 + 40: the last batch is partial and splits unevenly


def seeded(seed=7):
    seeding.set_random_seed(seed)


def compile_classifier(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def mlp_dropout_batchnorm(seed=7):
    """Sequential MLP with L2, BatchNormalization and Dropout."""
    seeded(seed)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(32, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(4, kernel_regularizer=keras.regularizers.L2(1e-3)),
        ]
    )
    return compile_classifier(model)


def mlp_l2(seed=7):
    """Sequential MLP with L2 regularisation and an activity regulariser (an add_loss path)."""
    seeded(seed)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(
                32,
                activation="relu",
                kernel_regularizer=keras.regularizers.L2(1e-3),
                activity_regularizer=keras.regularizers.L2(1e-2),
            ),
            keras.layers.Dense(4, kernel_regularizer=keras.regularizers.L2(1e-3)),
        ]
    )
    return compile_classifier(model)


def two_input_two_output(seed=7):
    """Functional model: inputs `a`, `b`; outputs `label` (classification) and `value` (regression)."""
    seeded(seed)
    a = keras.Input((8,), name="a")
    b = keras.Input((4,), name="b")
    hidden = keras.layers.Concatenate()([keras.layers.Dense(16, activation="tanh")(a), b])
    hidden = keras.layers.Dense(16, activation="relu", activity_regularizer=keras.regularizers.L1(1e-3))(hidden)
    label = keras.layers.Dense(3, name="label")(hidden)
    value = keras.layers.Dense(1, name="value")(hidden)
    model = keras.Model({"a": a, "b": b}, {"label": label, "value": value})
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss={
            "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "value": keras.losses.MeanSquaredError(),
        },
        loss_weights={"label": 1.0, "value": 0.5},
        metrics={"label": ["accuracy"], "value": ["mae"]},
    )
    return model


class CustomStepModel(keras.Model):
    """Subclassed model whose own train_step uses apply_gradients and a custom tracker."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="custom_loss")
        self.mae = keras.metrics.MeanAbsoluteError(name="mae")

    def build(self, input_shape):
        self.hidden.build(input_shape)
        self.out.build((input_shape[0], 16))

    def call(self, x):
        return self.out(self.hidden(x))

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae]

    def train_step(self, data):
        x, y = data
        y_pred = self(x, training=True)
        self.zero_grad()
        loss = keras.ops.mean(keras.ops.square(y_pred - y))
        loss.backward()
        grads = [v.value.grad for v in self.trainable_weights]
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.loss_tracker.update_state(loss, sample_weight=keras.ops.shape(x)[0])
        self.mae.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = keras.ops.mean(keras.ops.square(y_pred - y))
        self.loss_tracker.update_state(loss, sample_weight=keras.ops.shape(x)[0])
        self.mae.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def custom_step(seed=7):
    seeded(seed)
    model = CustomStepModel()
    model.build((None, 6))
    model.compile(optimizer=keras.optimizers.RMSprop(1e-2))
    return model


def classification_data(num_samples=NUM_SAMPLES, features=12, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, features)).astype("float32")
    y = (x[:, :classes].argmax(axis=1) + (rng.random(num_samples) < 0.1)) % classes
    return x, y.astype("int64")


def two_input_data(num_samples=NUM_SAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "a": rng.normal(size=(num_samples, 8)).astype("float32"),
        "b": rng.normal(size=(num_samples, 4)).astype("float32"),
    }
    y = {
        "label": (x["a"][:, :3].argmax(axis=1)).astype("int64"),
        "value": (x["a"][:, :1] * 2 + x["b"][:, 1:2]).astype("float32"),
    }
    sample_weight = rng.uniform(0.2, 2.0, size=num_samples).astype("float32")
    return x, y, sample_weight


def regression_data(num_samples=NUM_SAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.1).astype("float32")
    return x, y


def mirrored(num_replicas):
    return kdist.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)])


def build_in_scope(builder, strategy):
    with strategy.scope():
        return builder()


def _values(variables):
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]


def assert_same_state(reference, candidate, atol=1e-5, rtol=1e-5):
    """Weights, optimizer variables (iterations, slots) and metric variables all match."""
    groups = {
        "weights": (reference.variables, candidate.variables),
        "optimizer": (reference.optimizer.variables, candidate.optimizer.variables),
        "metrics": (reference.metrics_variables, candidate.metrics_variables),
    }
    for group, (ref_vars, cand_vars) in groups.items():
        assert len(ref_vars) == len(cand_vars), group
        for ref_var, ref, cand in zip(ref_vars, _values(ref_vars), _values(cand_vars)):
            np.testing.assert_allclose(
                cand, ref, atol=atol, rtol=rtol, err_msg=f"{group}: {ref_var.path}"
            )


def assert_same_history(reference, candidate, atol=1e-5):
    assert reference.keys() == candidate.keys()
    for key in reference:
        np.testing.assert_allclose(candidate[key], reference[key], atol=atol, rtol=1e-5, err_msg=key)


def assert_same_outputs(reference, candidate, atol=1e-5):
    ref_leaves = keras.tree.flatten(reference)
    cand_leaves = keras.tree.flatten(candidate)
    assert len(ref_leaves) == len(cand_leaves)
    for ref, cand in zip(ref_leaves, cand_leaves):
        np.testing.assert_allclose(np.asarray(cand), np.asarray(ref), atol=atol, rtol=1e-5)


@contextlib.contextmanager
def fault(**flags):
    """Switches on the named `kdist.faults.FaultInjection` bugs (negative controls) for the block."""
    with faults.injected(**flags):
        yield
