"""Which Keras backend kdist drives: the user's choice, in Keras' order (kdist/_backend.py)."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

from kdist import _backend
from kdist.errors import BackendError

TENSORFLOW_INSTALLED = importlib.util.find_spec("tensorflow") is not None


@pytest.mark.parametrize(
    ("environ", "config_backend", "tensorflow_installed", "expected"),
    [
        ({"KERAS_BACKEND": "jax"}, "tensorflow", True, ("jax", False)),
        ({"KERAS_BACKEND": "torch"}, None, True, ("torch", False)),
        ({}, "jax", True, ("jax", False)),
        ({}, "torch", True, ("torch", False)),
        ({}, "tensorflow", True, ("tensorflow", False)),
        # Keras writes "tensorflow" into a new keras.json itself: no choice where it cannot import.
        ({}, "tensorflow", False, ("torch", True)),
        ({}, None, True, ("tensorflow", False)),
        ({}, None, False, ("torch", True)),
        ({"KERAS_BACKEND": ""}, None, False, ("torch", True)),
    ],
)
def test_choose_backend_follows_the_users_choice(environ, config_backend, tensorflow_installed, expected):
    assert _backend.choose_backend(environ, config_backend, tensorflow_installed) == expected


def test_keras_config_path_follows_keras_home(tmp_path):
    assert _backend.keras_config_path({"KERAS_HOME": str(tmp_path)}) == str(tmp_path / "keras.json")
    assert _backend.keras_config_path({}).endswith(os.path.join(".keras", "keras.json"))


def test_keras_imported_with_an_unsupported_backend_is_refused(monkeypatch):
    fake_keras = types.SimpleNamespace(backend=types.SimpleNamespace(backend=lambda: "numpy"))
    monkeypatch.setitem(sys.modules, "keras", fake_keras)
    with pytest.raises(BackendError, match="imported with the 'numpy' backend") as raised:
        _backend.select_backend()
    assert "torch, tensorflow, jax" in str(raised.value)


def test_require_backend_names_the_fix(monkeypatch):
    monkeypatch.setattr(_backend, "current_backend", lambda: "jax")
    with pytest.raises(BackendError, match="KERAS_BACKEND=torch") as raised:
        _backend.require_backend("ParameterServerStrategy", ("torch",))
    assert "keras.backend.backend()='jax'" in str(raised.value)
    assert _backend.require_backend("MirroredStrategy", ("torch", "jax")) == "jax"


def _run_python(code, tmp_path, **env):
    environment = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    environment.update(env, KERAS_HOME=str(tmp_path))
    environment["PYTHONPATH"] = os.pathsep.join([os.getcwd(), environment.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                          timeout=180)


REPORT = "import os, kdist, keras; print(keras.backend.backend(), os.environ.get('KERAS_BACKEND'))"


def test_nothing_chosen_gives_keras_default_or_torch_without_tensorflow(tmp_path):
    result = _run_python(REPORT, tmp_path)
    assert result.returncode == 0, result.stderr
    expected = "tensorflow None" if TENSORFLOW_INSTALLED else "torch torch"
    assert result.stdout.strip().splitlines()[-1] == expected


def test_keras_json_choice_is_respected(tmp_path):
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "torch"}))
    result = _run_python(REPORT, tmp_path)
    assert result.returncode == 0, result.stderr
    # kdist left the environment alone: the choice came from keras.json.
    assert result.stdout.strip().splitlines()[-1] == "torch None"


def test_an_unsupported_backend_is_refused_before_keras_is_imported(tmp_path):
    result = _run_python("import kdist", tmp_path, KERAS_BACKEND="numpy")
    assert result.returncode != 0
    assert "BackendError" in result.stderr and "KERAS_BACKEND='numpy'" in result.stderr
