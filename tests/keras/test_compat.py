"""Pins every Keras internal kdist uses, so an upgrade that moves one fails loudly here.

Also guards the rule that makes the pins complete: only `kdist.keras._compat`
imports `keras.src` or touches private attributes of Keras objects.
"""

import ast
import pathlib
import re

import pytest

import kdist.keras
from kdist.keras import _compat


# Attributes whose Keras default is None on a new model: for them, existing is the check.
NONE_BY_DEFAULT = frozenset({"Model.predict_function", "Model.test_function", "Model.train_function",
                             "Trainer._initial_epoch", "Trainer._loss_tracker"})


@pytest.mark.parametrize("name", sorted(_compat.PINNED_INTERNALS))
def test_keras_internal_is_still_there(name):
    try:
        value = _compat.PINNED_INTERNALS[name]()
    except (AttributeError, ImportError) as error:
        pytest.fail(f"Keras internal '{name}' used by kdist/keras/_compat.py moved: {error}")
    if name in NONE_BY_DEFAULT:
        assert value is None, f"Keras internal '{name}' is no longer None on a new model: {value!r}"
    else:
        assert value is not None and value is not False, f"Keras internal '{name}' reads {value!r}"


def test_a_moved_internal_fails_the_pin(monkeypatch):
    # Negative control: the pin above fails when Keras loses the name.
    monkeypatch.delattr(_compat.Trainer, "_symbolic_build")
    with pytest.raises(pytest.fail.Exception, match="_symbolic_build"):
        test_keras_internal_is_still_there("Trainer._symbolic_build")


def test_only_compat_imports_keras_internals():
    import re

    package = KERAS_PACKAGE
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if not _inside_compat(path)
        and re.search(r"^\s*(from|import)\s+keras\.src", path.read_text(), re.MULTILINE)
    ]
    assert offenders == []


# ----- private attributes of Keras objects: only inside kdist.keras._compat -------------
KERAS_PACKAGE = pathlib.Path(kdist.keras.__file__).parent
KDIST_PACKAGE = KERAS_PACKAGE.parent

# Private attributes that belong to kdist (or torch), not to Keras: the checker
# cannot see types, so each one kdist touches from outside its own class is named here.
KDIST_PRIVATE_ATTRIBUTES = {
    # ParameterServerExtended's placement hook, called for each model variable born in scope.
    "_on_variable_created",
    # The JAX backend's strategy (kdist.backends.jax): the models it owns.
    "_models",
    # torch's fused list ops and a tensor's in-place version counter.
    "_foreach_zero_",
    "_foreach_div_",
    "_version",
    # torch's tensor-subclass API, as its subclassing guide uses it (a table's
    # stand-in: kdist.keras.parameter_server.remote_tables).
    "_make_subclass",
    "_C",
}
# Names that hold kdist objects by convention: a GradientOverlap shares its
# private state with the OverlappedStep of the same module (kdist.keras.replica.gradient_overlap).
KDIST_OBJECT_NAMES = {
    "overlap",
    "self._overlap",
}
# Attributes kdist itself stores on Keras objects all start with this.
KDIST_MARKER_PREFIX = "_kdist"
_ACCESSORS = {"getattr", "setattr", "hasattr", "delattr", "__setattr__", "__getattribute__"}


def _inside_compat(path):
    return "_compat" in path.relative_to(KERAS_PACKAGE.parent).parts or path.name == "_compat.py"


def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def _allowed(base, name):
    return (
        base in ("self", "cls")
        or base in KDIST_OBJECT_NAMES
        or name.startswith(KDIST_MARKER_PREFIX)
        or name in KDIST_PRIVATE_ATTRIBUTES
    )


def private_attribute_uses(source):
    """`(line, "base._name")` for each private attribute read or written in `source` that is not allowed.

    Counts `obj._name` in any position and `getattr`/`setattr`/`hasattr`/
    `delattr`/`object.__setattr__` with a constant private name.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            base, name = ast.unparse(node.value), node.attr
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            function = node.func
            called = getattr(function, "id", None) or getattr(function, "attr", None)
            name_node = node.args[1]
            if called not in _ACCESSORS or not isinstance(name_node, ast.Constant):
                continue
            if not isinstance(name_node.value, str) or not _is_private(name_node.value):
                continue
            base, name = ast.unparse(node.args[0]), name_node.value
        else:
            continue
        if not _allowed(base, name):
            found.append((node.lineno, f"{base}.{name}"))
    return sorted(found)


def _handles_keras_objects(path, source):
    """Modules of kdist.keras, and any other kdist module that imports keras."""
    return KERAS_PACKAGE in path.parents or re.search(r"^\s*(from|import)\s+keras\b", source, re.MULTILINE)


def test_only_compat_touches_private_attributes_of_keras_objects():
    offenders = []
    for path in sorted(KDIST_PACKAGE.rglob("*.py")):
        if "_generated" in path.parts or (KERAS_PACKAGE in path.parents and _inside_compat(path)):
            continue
        source = path.read_text()
        if not _handles_keras_objects(path, source):
            continue
        for line, use in private_attribute_uses(source):
            offenders.append(f"{path.relative_to(KDIST_PACKAGE.parent)}:{line}: {use}")
    assert offenders == [], (
        "Private attributes of Keras objects are read or written outside kdist.keras._compat; add a "
        "helper there (pinned in PINNED_INTERNALS) and call it, or, for a kdist-owned attribute, "
        "name it in this test's allow-list with why:\n" + "\n".join(offenders)
    )


def test_private_attribute_checker_catches_a_planted_violation():
    planted = (
        "def save(callback, model, optimizer, helper):\n"
        "    callback._save_model = helper\n"  # write
        "    variables = optimizer._trainable_variables\n"  # read
        "    object.__setattr__(model, '_initialize_ddp', helper)\n"  # write through a string
        "    getattr(model, '_loss_tracker', None)\n"  # read through a string
        "    model._kdist_engine = helper\n"  # kdist's own marker: allowed
        "    self._private = overlap._buffers\n"  # self and a kdist object: allowed
        "    return model.__class__\n"  # dunder: allowed
    )
    assert private_attribute_uses(planted) == [
        (2, "callback._save_model"),
        (3, "optimizer._trainable_variables"),
        (4, "model._initialize_ddp"),
        (5, "model._loss_tracker"),
    ]


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


def test_in_stateless_scope_agrees_with_keras_inside_and_outside_a_scope():
    import keras
    from keras.src.backend.common import stateless_scope

    assert _compat.in_stateless_scope() is stateless_scope.in_stateless_scope() is False
    with keras.StatelessScope():
        assert _compat.in_stateless_scope() is stateless_scope.in_stateless_scope() is True
        with keras.StatelessScope():
            assert _compat.in_stateless_scope() is True
    assert _compat.in_stateless_scope() is False
