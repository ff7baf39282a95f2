"""Which Keras backend kdist drives: the user's choice, in Keras' order (kdist/_backend.py)."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

from kdist import _backend
from kdist.errors import BackendChoiceWarning, BackendError

TENSORFLOW_INSTALLED = importlib.util.find_spec("tensorflow") is not None


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"KERAS_BACKEND": "jax"}, ("jax", False)),
        ({"KERAS_BACKEND": "tensorflow"}, ("tensorflow", False)),
        ({"KERAS_BACKEND": "torch"}, ("torch", False)),
        ({}, ("torch", True)),
        ({"KERAS_BACKEND": ""}, ("torch", True)),
    ],
)
def test_choose_backend_is_torch_unless_keras_backend_says_otherwise(environ, expected):
    assert _backend.choose_backend(environ) == expected


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
    """Runs `code` in a fresh Python whose home holds `tmp_path/.keras/keras.json` (if written)."""
    environment = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "KERAS_HOME")}
    environment.update(env, HOME=str(tmp_path))
    environment["PYTHONPATH"] = os.pathsep.join([os.getcwd(), environment.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                          timeout=180)


def _write_keras_json(directory, backend):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "keras.json").write_text(json.dumps({"backend": backend, "floatx": "float32"}))


REPORT = "import os, kdist, keras; print(keras.backend.backend(), os.environ.get('KERAS_BACKEND'))"


def _last_line(result):
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_nothing_chosen_gives_torch(tmp_path):
    assert _last_line(_run_python(REPORT, tmp_path)) == "torch torch"


@pytest.mark.parametrize("where", ["home", "keras_home"])
def test_keras_json_naming_tensorflow_is_not_a_choice(tmp_path, where):
    # Keras writes {"backend": "tensorflow"} into a new keras.json on its first import:
    # with TensorFlow installed (the test extras), following it would switch torch users.
    if where == "home":
        _write_keras_json(tmp_path / ".keras", "tensorflow")
        result = _run_python(REPORT, tmp_path)
    else:
        _write_keras_json(tmp_path / "keras_home", "tensorflow")
        result = _run_python(REPORT, tmp_path, KERAS_HOME=str(tmp_path / "keras_home"))
    assert _last_line(result) == "torch torch"


def test_keras_json_written_by_keras_itself_does_not_switch_the_next_run(tmp_path):
    # The first run's Keras import writes keras.json (tensorflow); the second run reads it.
    first = _run_python(REPORT, tmp_path)
    assert _last_line(first) == "torch torch"
    second = _run_python(REPORT, tmp_path)
    assert _last_line(second) == "torch torch"


@pytest.mark.skipif(not TENSORFLOW_INSTALLED, reason="needs TensorFlow")
def test_keras_backend_tensorflow_is_one_variable_away(tmp_path):
    code = REPORT.replace("print(", "print(kdist.MirroredStrategy.__module__, ")
    result = _run_python(code, tmp_path, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    assert _last_line(result) == "kdist.backends.tensorflow tensorflow tensorflow"


@pytest.mark.skipif(not TENSORFLOW_INSTALLED, reason="needs TensorFlow")
def test_keras_imported_first_with_tensorflow_is_followed(tmp_path):
    code = ("import os; os.environ['KERAS_BACKEND'] = 'tensorflow'; import keras; "
            "del os.environ['KERAS_BACKEND']; import kdist; "
            "print(kdist.MirroredStrategy.__module__, keras.backend.backend())")
    result = _run_python(code, tmp_path, TF_CPP_MIN_LOG_LEVEL="2")
    assert _last_line(result) == "kdist.backends.tensorflow tensorflow"


def test_an_unsupported_backend_is_refused_before_keras_is_imported(tmp_path):
    result = _run_python("import kdist", tmp_path, KERAS_BACKEND="numpy")
    assert result.returncode != 0
    assert "BackendError" in result.stderr and "KERAS_BACKEND='numpy'" in result.stderr


# What a torch program imports: a model built in MirroredStrategy's scope, fit,
# evaluate and predict. Prints the top-level names of the other backends' packages.
TORCH_RUN = """
import sys
{imports}
import numpy as np
model_scope = {scope}
with model_scope:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
x, y = np.zeros((16, 4), "float32"), np.zeros((16, 2), "float32")
model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_split=0.25)
model.evaluate(x, y, verbose=0)
model.predict(x, verbose=0)
print(keras.backend.backend(), sorted({{name.split(".")[0] for name in sys.modules}}
      & {{"tensorflow", "tensorboard", "tf_keras", "jax", "jaxlib"}}))
"""


def _other_backends_imported(tmp_path, imports, scope, **env):
    output = _last_line(_run_python(TORCH_RUN.format(imports=imports, scope=scope), tmp_path, **env))
    backend, _, names = output.partition(" ")
    assert backend == "torch"
    return set(json.loads(names.replace("'", '"')))


def test_a_torch_run_imports_neither_tensorflow_nor_jax(tmp_path):
    # keras.json naming tensorflow, as Keras writes it with TensorFlow installed.
    _write_keras_json(tmp_path / ".keras", "tensorflow")
    imported = _other_backends_imported(
        tmp_path, "import kdist\nimport keras", 'kdist.MirroredStrategy(["cpu:0", "cpu:1"]).scope()'
    )
    # Plain Keras on torch, as the baseline: Keras 3.15/3.16 itself imports JAX when it is
    # installed (keras/src/callbacks/orbax_checkpoint.py, on every backend). kdist adds nothing.
    plain = _other_backends_imported(
        tmp_path, "import contextlib\nimport keras", "contextlib.nullcontext()", KERAS_BACKEND="torch"
    )
    assert not imported & {"tensorflow", "tensorboard", "tf_keras"}
    assert imported <= plain, f"kdist added {sorted(imported - plain)} to plain Keras' imports"


# Import order: Keras imported first, its backend taken from keras.json (issue 25, item 7).
WARNING_PROBE = ("import warnings; warnings.simplefilter('always'); {first}; import kdist; "
                 "kdist.MirroredStrategy; print(kdist.MirroredStrategy.__module__)")


def _backend_warnings(result):
    assert result.returncode == 0, result.stderr
    return [line for line in result.stderr.splitlines() if "BackendChoiceWarning" in line]


@pytest.mark.skipif(not TENSORFLOW_INSTALLED, reason="needs TensorFlow")
def test_keras_first_with_keras_json_tensorflow_warns_once(tmp_path):
    _write_keras_json(tmp_path / ".keras", "tensorflow")
    result = _run_python(WARNING_PROBE.format(first="import keras"), tmp_path, TF_CPP_MIN_LOG_LEVEL="2")
    # The warning is the truth: kdist follows the imported Keras, here TensorFlow.
    assert _last_line(result) == "kdist.backends.tensorflow"
    warned = _backend_warnings(result)
    assert len(warned) == 1, result.stderr
    assert "'tensorflow' backend" in result.stderr and "KERAS_BACKEND=torch" in result.stderr
    assert "import kdist` before `import keras`" in result.stderr


@pytest.mark.skipif(not TENSORFLOW_INSTALLED, reason="needs TensorFlow")
def test_keras_backend_set_explicitly_gives_no_warning(tmp_path):
    _write_keras_json(tmp_path / ".keras", "tensorflow")
    result = _run_python(WARNING_PROBE.format(first="import keras"), tmp_path, KERAS_BACKEND="tensorflow",
                         TF_CPP_MIN_LOG_LEVEL="2")
    assert _last_line(result) == "kdist.backends.tensorflow"
    assert _backend_warnings(result) == []


def test_keras_first_with_keras_json_torch_gives_no_warning(tmp_path):
    # Negative control for the rule: only a backend other than torch is worth a warning.
    _write_keras_json(tmp_path / ".keras", "torch")
    result = _run_python(WARNING_PROBE.format(first="import keras"), tmp_path)
    assert _last_line(result) == "kdist.distribute.mirrored"
    assert _backend_warnings(result) == []


def test_kdist_first_gives_no_warning(tmp_path):
    _write_keras_json(tmp_path / ".keras", "tensorflow")
    # Keras is imported by kdist's first public name, after kdist chose torch.
    result = _run_python(WARNING_PROBE.format(first="pass"), tmp_path)
    assert _last_line(result) == "kdist.distribute.mirrored"
    assert _backend_warnings(result) == []


def test_the_warning_is_given_once_per_process(monkeypatch):
    fake_keras = types.SimpleNamespace(backend=types.SimpleNamespace(backend=lambda: "jax"))
    monkeypatch.setitem(sys.modules, "keras", fake_keras)
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setattr(_backend, "_warned", False)
    with pytest.warns(BackendChoiceWarning, match="'jax' backend") as caught:
        assert _backend.select_backend() == "jax"
        assert _backend.select_backend() == "jax"
    assert len([w for w in caught if issubclass(w.category, BackendChoiceWarning)]) == 1
