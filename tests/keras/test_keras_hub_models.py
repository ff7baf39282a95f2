"""keras-hub models built inside a kdist scope train like plain Keras (issue 36 item 1).

Backbones and tasks are built from config with random weights (nothing is
downloaded), the way keras-hub builds them, *inside* the scope, and fitted on
the same global batches as plain Keras. Dropout is off: its masks are drawn
per replica, the one documented difference (docs/mirrored.md). Before the fix every one of them raised
`AttributeError: ... no attribute '_layers'` under 2 replicas.
"""

import keras
from tests import seeding
import numpy as np
import pytest

import kdist
from tests.keras import _models as m

keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is a test extra: pip install -e '.[test]'")

TOLERANCE = 1e-5
SEQUENCE, VOCABULARY, SAMPLES, BATCH = 8, 50, 12, 6


def _tokens():
    rng = np.random.default_rng(0)
    token_ids = rng.integers(1, VOCABULARY, size=(SAMPLES, SEQUENCE)).astype("int32")
    padding_mask = np.ones((SAMPLES, SEQUENCE), dtype="bool")
    padding_mask[::3, -3:] = False  # padded sequences: the mask is the labels' sample weight
    return token_ids, padding_mask


def gpt2_causal_lm():
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCABULARY, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=SEQUENCE, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    token_ids, padding_mask = _tokens()
    x = {"token_ids": token_ids[:, :-1], "padding_mask": padding_mask[:, :-1]}
    return model, (x, token_ids[:, 1:], padding_mask[:, 1:].astype("float32"))


def gemma_causal_lm():
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=VOCABULARY, num_layers=1, num_query_heads=2,
                                              num_key_value_heads=1, hidden_dim=8, intermediate_dim=16, head_dim=4)
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    token_ids, padding_mask = _tokens()
    x = {"token_ids": token_ids[:, :-1], "padding_mask": padding_mask[:, :-1]}
    return model, (x, token_ids[:, 1:], padding_mask[:, 1:].astype("float32"))


def bert_classifier():
    backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCABULARY, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=SEQUENCE, dropout=0.0)
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0)
    token_ids, padding_mask = _tokens()
    x = {"token_ids": token_ids, "segment_ids": np.zeros_like(token_ids), "padding_mask": padding_mask}
    return model, (x, np.arange(SAMPLES) % 3, None)


def vit_classifier():
    backbone = keras_hub.models.ViTBackbone(image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2,
                                            hidden_dim=8, mlp_dim=16)
    model = keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=3, preprocessor=None)
    images = np.random.default_rng(1).random((SAMPLES, 8, 8, 3), dtype=np.float32)
    return model, (images, np.arange(SAMPLES) % 3, None)


BUILDERS = {"gpt2": gpt2_causal_lm, "gemma": gemma_causal_lm, "bert": bert_classifier, "vit": vit_classifier}


def _train(builder, strategy):
    seeding.set_random_seed(5)
    scope = strategy.scope() if strategy is not None else _NullScope()
    with scope:
        model, (x, y, sample_weight) = builder()
        # A task's own default compile (its loss, optimizer choice), made deterministic.
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=["sparse_categorical_accuracy"])
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    return model, history.history, predictions


class _NullScope:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_keras_hub_task_built_in_a_two_replica_scope_trains_like_plain_keras(name):
    plain, plain_history, plain_predictions = _train(BUILDERS[name], None)
    model, history, predictions = _train(BUILDERS[name], m.mirrored(2))
    assert kdist.keras.hooks.strategy_of(model) is not None
    assert model.train_function.__self__.__class__.__name__ == "ReplicaEngine"
    for variable, a, b in zip(plain.weights, plain.get_weights(), model.get_weights(), strict=True):
        if variable.path.endswith("/key/bias"):
            # An attention key bias adds the same amount to every logit of a query, which
            # softmax ignores: its gradient is zero up to rounding, and Adam divides that
            # rounding noise by its epsilon. Both runs must leave it near zero, not equal.
            assert np.abs(a).max() < 1e-3 and np.abs(b).max() < 1e-3, (variable.path, a, b)
            continue
        np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE)
    for key, values in plain_history.items():
        np.testing.assert_allclose(values, history[key], rtol=TOLERANCE, atol=TOLERANCE, err_msg=key)
    np.testing.assert_allclose(plain_predictions, predictions, rtol=TOLERANCE, atol=TOLERANCE)
