"""Pins every Keras internal kdist uses, so an upgrade that moves one fails loudly here."""

import pytest

from kdist.keras import _compat


@pytest.mark.parametrize("name", sorted(_compat.PINNED_INTERNALS))
def test_keras_internal_is_still_there(name):
    try:
        _compat.PINNED_INTERNALS[name]()
    except (AttributeError, ImportError) as error:
        pytest.fail(f"Keras internal '{name}' used by kdist/keras/_compat.py moved: {error}")


def test_only_compat_imports_keras_internals():
    import pathlib
    import re

    package = pathlib.Path(_compat.__file__).parents[1]
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "_compat.py"
        and re.search(r"^\s*(from|import)\s+keras\.src", path.read_text(), re.MULTILINE)
    ]
    assert offenders == []


def test_loss_reduction_denominator_is_the_divisor_keras_uses():
    """`loss * denominator` equals the same loss with reduction="sum" (mask and weights folded in alike)."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    y_true = rng.integers(0, 4, size=(6, 5))
    logits = rng.normal(size=(6, 5, 4)).astype("float32")
    sample_weight = rng.uniform(0.1, 2.0, size=(6, 5)).astype("float32")
    calls = []
    _compat.install_loss_reduction_observer(lambda *args: calls.append(_compat.loss_reduction_denominator(*args)))
    try:
        for reduction in ("sum_over_batch_size", "mean", "mean_with_sample_weight"):
            for weights in (None, sample_weight):
                for ignore in (None, 0):
                    make = lambda r: keras.losses.SparseCategoricalCrossentropy(  # noqa: E731
                        from_logits=True, ignore_class=ignore, reduction=r
                    )
                    calls.clear()
                    value = float(make(reduction)(y_true, logits, sample_weight=weights))
                    (denominator, _), = calls
                    total = float(make("sum")(y_true, logits, sample_weight=weights))
                    np.testing.assert_allclose(value * float(denominator), total, rtol=1e-5)
    finally:
        _compat.install_loss_reduction_observer(lambda *args: None)


def test_flatten_logs_matches_keras_pythonify_logs():
    from keras.src.utils.python_utils import pythonify_logs

    logs = {"loss": 1.0, "compile_metrics": {"accuracy": 0.5, "top2": 0.75}, "b": 2.0}
    assert _compat.flatten_logs(logs) == pythonify_logs(logs)
    assert list(_compat.flatten_logs(logs)) == list(pythonify_logs(logs))


def test_float8_output_gradient_state_is_found_by_owner():
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    assert _compat.output_gradient_float8_state(model) == []
    model.quantize("float8")
    pairs = _compat.output_gradient_float8_state(model)
    assert [(s.path.split("/")[-1], h.path.split("/")[-1]) for s, h in pairs] == [
        ("outputs_grad_scale", "outputs_grad_amax_history")
    ] * 2


def test_keras_still_refuses_synchronized_batchnorm_on_torch():
    """kdist.keras.sync_batchnorm exists because of this; when Keras supports it, revisit."""
    import keras

    with pytest.raises(ValueError, match="synchronized=True"):
        keras.layers.BatchNormalization(synchronized=True)
