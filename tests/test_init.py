"""`import kdist` is light and its public names load on first use (kdist/__init__.py, PEP 562).

Each check runs in a fresh interpreter: in this one, other tests have already
imported Keras and loaded kdist's public surface.
"""

import os
import subprocess
import sys

import pytest

import kdist

HEAVY = ("torch", "keras", "tensorflow", "jax", "grpc")


def _run_python(code, **env):
    environment = dict(os.environ, **{"KERAS_BACKEND": "torch", **env})
    environment["PYTHONPATH"] = os.pathsep.join([os.getcwd(), environment.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


HEAVY_IMPORTED = f"sorted({{name.split('.')[0] for name in sys.modules}} & set({HEAVY!r}))"


def test_import_kdist_imports_no_framework_and_settles_the_backend():
    code = f"import os, sys, kdist; print({HEAVY_IMPORTED}, os.environ['KERAS_BACKEND'])"
    assert _run_python(code, KERAS_BACKEND="") == "[] torch"


def test_first_public_name_loads_the_surface():
    code = (f"import sys, kdist; before = {HEAVY_IMPORTED}; kdist.MirroredStrategy; "
            "print(before, kdist._loaded, 'keras' in sys.modules)")
    assert _run_python(code) == "[] True True"


def test_hooks_are_installed_before_a_model_is_created_in_scope():
    # The order a user writes: kdist, then keras, then the strategy, then the model.
    code = """
import kdist
import keras
from kdist.keras import hooks
installed_before = hooks._installed
strategy = kdist.MirroredStrategy(["cpu:0", "cpu:1"])
with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
print(installed_before, hooks._installed, kdist.distribute.context.strategy_of(model) is strategy)
"""
    assert _run_python(code) == "False True True"


def test_from_import_loads_the_surface_too():
    code = """
from kdist import MirroredStrategy
import keras
from kdist.distribute import context
strategy = MirroredStrategy(["cpu:0"])
with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
print(context.strategy_of(model) is strategy)
"""
    assert _run_python(code) == "True"


def test_threads_racing_to_the_first_access_all_get_the_names():
    code = """
import threading, kdist
names = ["MirroredStrategy", "ParameterServerStrategy", "ReduceOp", "cluster", "visible_gpus"] * 4
results, errors = [], []
def access(name):
    try:
        results.append(getattr(kdist, name))
    except Exception as error:
        errors.append(repr(error))
threads = [threading.Thread(target=access, args=(name,)) for name in names]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(120)
print(len(results), errors)
"""
    assert _run_python(code) == "20 []"


@pytest.mark.parametrize("name", kdist.__all__)
def test_every_public_name_can_be_imported_from_kdist(name):
    namespace = {}
    exec(f"from kdist import {name}", namespace)
    assert namespace[name] is getattr(kdist, name)


def test_star_import_and_dir_list_the_public_surface():
    namespace = {}
    exec("from kdist import *", namespace)
    assert set(kdist.__all__) <= set(namespace)
    assert set(kdist.__all__) <= set(dir(kdist))
    assert "__version__" in dir(kdist)


def test_an_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'MirroredStrategyy'"):
        kdist.MirroredStrategyy  # noqa: B018
    assert not hasattr(kdist, "MirroredStrategyy")


def test_strategy_names_bind_to_the_backend_of_keras():
    import keras

    assert keras.backend.backend() == "torch"
    assert kdist.MirroredStrategy.__module__ == "kdist.distribute.mirrored"
