"""Keras' serialization imports no TensorFlow once kdist is loaded (`kdist.keras._compat.serialization`).

Plain Keras imports TensorFlow, when it is installed, on its first serialization
(seconds and hundreds of MB per process). kdist serializes where plain Keras would
not (optimizer and compile configs sent to servers and workers), so under kdist
it must not: the same program, with and without kdist, in two processes.
"""

import importlib.util
import sys
import types

import pytest

from kdist.keras._compat import serialization
from tests import harness

pytestmark = pytest.mark.timeout(180)

TENSORFLOW_INSTALLED = importlib.util.find_spec("tensorflow") is not None

PROBE = """
import os, sys
{first}
import keras, numpy as np
before = "tensorflow" in sys.modules
with {scope}:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse", metrics=["mae"])
model.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), epochs=1, verbose=0)
keras.optimizers.serialize(model.optimizer)
model.get_compile_config()
path = os.path.join(sys.argv[1], "{name}.keras")
model.save(path)
loaded = keras.saving.load_model(path)
same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), loaded.get_weights()))
print("RESULT", before, "tensorflow" in sys.modules, same)
"""


def _probe(tmp_path):
    specs = [
        harness.ProcessSpec(name, [sys.executable, "-c", PROBE.format(name=name, **code), str(tmp_path)])
        for name, code in {
            "kdist": {"first": "import kdist", "scope": 'kdist.MirroredStrategy(["cpu:0", "cpu:1"]).scope()'},
            "plain": {"first": "import contextlib", "scope": "contextlib.nullcontext()"},
        }.items()
    ]
    result = harness.run(specs, timeout=150).check()
    return {spec.name: result.output(spec.name, "stdout").split("RESULT ")[-1].split() for spec in specs}


def test_serializing_and_saving_under_kdist_imports_no_tensorflow(tmp_path):
    results = _probe(tmp_path)
    assert results["kdist"] == ["False", "False", "True"]
    # The control: plain Keras, same program, imports it (when it is installed).
    assert results["plain"] == ["False", str(TENSORFLOW_INSTALLED), "True"]


def test_the_view_is_available_only_once_tensorflow_is_imported(monkeypatch):
    lazy = types.SimpleNamespace(available=True, TensorShape="the class")
    view = serialization._ImportedTensorFlow(lazy)
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)
    assert view.available is False
    monkeypatch.setitem(sys.modules, "tensorflow", types.ModuleType("tensorflow"))
    assert view.available is True
    lazy.available = False  # imported, but Keras' lazy module cannot load it
    assert view.available is False
    assert view.TensorShape == "the class"  # everything else is the lazy module's


def test_installing_is_idempotent_and_done_by_kdist():
    import kdist  # noqa: F401  (its hooks install it)
    from kdist.keras import hooks

    hooks.install()
    assert not serialization.serialization_imports_tensorflow()
    view = serialization._serialization_lib.tf
    serialization.serialize_without_importing_tensorflow()
    assert serialization._serialization_lib.tf is view
