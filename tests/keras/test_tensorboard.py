"""`keras.callbacks.TensorBoard` on torch without TensorFlow (kdist.keras.tensorboard).

Runs happen in child processes (tests/keras/workers/tensorboard_run.py) and
the files are read back by tensorboard's own reader in another child
(tensorboard_read.py), which keeps TensorFlow out of this process. Where
TensorFlow is installed, kdist's files are compared with those Keras'
TensorFlow-backed callback writes for the same run.
"""

import copy
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

import kdist
from kdist.errors import InvalidArgumentError, UnsupportedError
from kdist.keras import tensorboard, tensorboard_redirect
from tests import harness

WORKERS = pathlib.Path(__file__).parent / "workers"
RUN = WORKERS / "tensorboard_run.py"
READ = WORKERS / "tensorboard_read.py"
TIMEOUT = 180

needs_reader = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None, reason="tensorboard's reader is not installed"
)
# Found, not imported: collecting these tests keeps TensorFlow out of this process.
needs_tensorflow = pytest.mark.skipif(
    not tensorboard_redirect.tensorflow_summaries_installed(),
    reason="Keras' own TensorBoard callback needs TensorFlow and tensorboard (not installed here)",
)
# Two plain runs train identically: values are compared to float32 round-off.
EXACT = 1e-6


def _run(tmp_path, name, writer, options, *extra, envs=None):
    log_dir = tmp_path / name
    envs = envs or [(name, {})]
    args = ["--log-dir", log_dir, "--writer", writer, "--options", json.dumps(options), *extra]
    result = harness.run(harness.python_specs(envs, RUN, *args), timeout=TIMEOUT).check()
    return log_dir, result


def _read(tmp_path, *log_dirs):
    out = tmp_path / "read.json"
    argv = [sys.executable, str(READ), str(out), *map(str, log_dirs)]
    harness.run([harness.ProcessSpec("reader", argv, {})], timeout=TIMEOUT).check()
    read = json.loads(out.read_text())
    return [read[str(log_dir)] for log_dir in log_dirs]


def _differences(expected, actual, rtol):
    """What differs between two read-back log dirs: runs, tags, plugins, steps, values."""
    found = []
    if sorted(expected) != sorted(actual):
        return [f"runs {sorted(expected)} != {sorted(actual)}"]
    for run in expected:
        tags, other = expected[run]["tags"], actual[run]["tags"]
        if sorted(tags) != sorted(other):
            found.append(f"{run}: tags {sorted(tags)} != {sorted(other)}")
            continue
        if len(expected[run]["files"]) != len(actual[run]["files"]):
            found.append(f"{run}: {len(expected[run]['files'])} event files != {len(actual[run]['files'])}")
        for tag, series in tags.items():
            theirs = other[tag]
            where = f"{run}/{tag}"
            if (series["plugin"], series["steps"]) != (theirs["plugin"], theirs["steps"]):
                found.append(f"{where}: {series['plugin']} {series['steps']} != {theirs['plugin']} {theirs['steps']}")
            elif series["plugin"] == "graph_keras_model":
                if series["values"] != theirs["values"]:
                    found.append(f"{where}: model JSON differs")
            elif "steps_per_second" not in tag:  # a timing: tags and steps only
                mine, yours = np.asarray(series["values"]), np.asarray(theirs["values"])
                if mine.shape != yours.shape or not np.allclose(mine, yours, rtol=rtol, atol=rtol * 1e-3):
                    found.append(f"{where}: values {mine.tolist()} != {yours.tolist()}")
                elif series["plugin"] == "histograms" and rtol == EXACT and not np.array_equal(mine[..., 2], yours[..., 2]):
                    found.append(f"{where}: bucket counts differ")
    return found


# ----- the same files as Keras' TensorFlow-backed callback --------------------------------
COMPARED_OPTIONS = [
    {"histogram_freq": 1, "update_freq": "batch", "write_steps_per_second": True},
    # Keras' record_if gating: epoch scalars only when the epoch's last batch number is a multiple of 3.
    {"histogram_freq": 2, "update_freq": 3},
]


@needs_tensorflow
@pytest.mark.parametrize("options", COMPARED_OPTIONS, ids=["batch+histograms", "update_freq=3"])
def test_files_match_keras_tensorflow_callback(tmp_path, options):
    keras_dir, keras_run = _run(tmp_path, "keras", "keras", options)
    kdist_dir, kdist_run = _run(tmp_path, "kdist", "kdist", options)
    assert "class=keras.src.callbacks.tensorboard.TensorBoard" in keras_run.output("keras")
    assert "class=kdist.keras.tensorboard.TensorBoard" in kdist_run.output("kdist")
    expected, actual = _read(tmp_path, keras_dir, kdist_dir)
    assert _differences(expected, actual, EXACT) == []
    assert expected["train"]["tags"], "Keras wrote nothing to compare with"
    # Negative control: the comparison sees one changed value, step, or missing tag.
    for change in (_change_value, _change_step, _drop_tag):
        broken = copy.deepcopy(actual)
        change(broken)
        assert _differences(expected, broken, EXACT) != [], change.__name__


def _change_value(read):
    read["validation"]["tags"]["evaluation_loss_vs_iterations"]["values"][0] += 1e-3


def _change_step(read):
    read["train"]["tags"]["keras"]["steps"][0] = 1


def _drop_tag(read):
    del read["train"]["tags"]["keras"]


# ----- an unchanged keras.callbacks.TensorBoard without TensorFlow ----------------------------
def _check_against_history(read, history_path, update_freq_batches):
    """The epoch and evaluation scalars equal fit's History and evaluate's result (float32)."""
    record = json.loads(pathlib.Path(history_path).read_text())
    history, evaluation = record["history"], record["evaluate"]
    train, validation = read["train"]["tags"], read["validation"]["tags"]
    epochs = len(history["loss"])
    histograms = {tag for tag in train if tag.endswith("/histogram")}
    assert histograms == {f"sequential/{layer}/{weight}/histogram" for layer in ("dense", "dense_1")
                          for weight in ("kernel", "bias")}
    for name in ("loss", "accuracy"):
        assert train[f"epoch_{name}"]["steps"] == list(range(epochs))
        np.testing.assert_array_equal(train[f"epoch_{name}"]["values"], np.float32(history[name]))
        np.testing.assert_array_equal(validation[f"epoch_{name}"]["values"], np.float32(history[f"val_{name}"]))
        evaluated = validation[f"evaluation_{name}_vs_iterations"]
        # 30 training samples in batches of 8: 4 optimizer steps per epoch; then evaluate() once more.
        assert evaluated["steps"] == [4 * (epoch + 1) for epoch in range(epochs)] + [4 * epochs]
        np.testing.assert_array_equal(evaluated["values"], np.float32(history[f"val_{name}"] + [evaluation[name]]))
        assert train[f"batch_{name}"]["steps"] == list(range(1, update_freq_batches + 1))
    np.testing.assert_allclose(train["epoch_learning_rate"]["values"], [0.1] * epochs, rtol=1e-6)
    assert train["keras"]["plugin"] == "graph_keras_model" and train["keras"]["steps"] == [0, 0]
    assert json.loads(train["keras"]["values"][0][0])["class_name"] == "Sequential"


@needs_reader
@pytest.mark.parametrize("strategy", ["none", "mirrored"])
def test_unchanged_keras_callback_without_tensorflow(tmp_path, strategy):
    history = tmp_path / "history.json"
    options = {"histogram_freq": 1, "update_freq": "batch"}
    log_dir, run = _run(tmp_path, "run", "unchanged", options, "--block-tensorflow", "--strategy", strategy,
                        "--history", history)
    assert "class=kdist.keras.tensorboard.TensorBoard" in run.output("run")
    (read,) = _read(tmp_path, log_dir)
    assert sorted(read) == ["train", "validation"]
    # One event file per run for fit, one more for evaluate (as Keras' writers).
    assert [len(read[run_name]["files"]) for run_name in ("train", "validation")] == [2, 2]
    _check_against_history(read, history, update_freq_batches=12)


@needs_reader
def test_keras_callback_built_before_kdist_is_adopted_by_a_mirrored_fit(tmp_path):
    # A callback list at the top of a script: Keras' class, since kdist's hooks are not installed yet.
    history = tmp_path / "history.json"
    options = {"histogram_freq": 1, "update_freq": "batch"}
    log_dir, run = _run(tmp_path, "run", "unchanged", options, "--block-tensorflow", "--strategy", "mirrored",
                        "--history", history, "--early")
    output = run.output("run")
    assert "before kdist: class=keras.src.callbacks.tensorboard.TensorBoard" in output
    assert "class=kdist.keras.tensorboard.TensorBoard" in output.split("before kdist:")[1]
    (read,) = _read(tmp_path, log_dir)
    # The same object served fit and evaluate: one event file per run each, as Keras' writers.
    assert [len(read[run_name]["files"]) for run_name in ("train", "validation")] == [2, 2]
    _check_against_history(read, history, update_freq_batches=12)


def _broken_tensorflow(tmp_path):
    """A PYTHONPATH on which `tensorflow` is installed (found) but raises on import."""
    package = tmp_path / "broken" / "tensorflow"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("libtensorflow_framework.so.2: cannot open shared object")\n')
    return {"PYTHONPATH": f"{package.parent}{os.pathsep}{harness.REPO_ROOT}"}


@needs_reader
def test_installed_but_broken_tensorflow_is_redirected(tmp_path):
    history = tmp_path / "history.json"
    options = {"histogram_freq": 1, "update_freq": "batch"}
    log_dir, run = _run(tmp_path, "run", "unchanged", options, "--strategy", "mirrored", "--history", history,
                        envs=[("run", _broken_tensorflow(tmp_path))])
    assert "class=kdist.keras.tensorboard.TensorBoard" in run.output("run")
    (read,) = _read(tmp_path, log_dir)
    _check_against_history(read, history, update_freq_batches=12)


def test_broken_tensorflow_is_found_but_unavailable(tmp_path):
    # The control for the test above: find_spec sees the package; only importing it tells.
    environ = dict(os.environ, KERAS_BACKEND="torch", **_broken_tensorflow(tmp_path))
    code = ("from kdist.keras import tensorboard_redirect as r; "
            "print(r.tensorflow_summaries_installed(), r.tensorflow_summaries_available())")
    answer = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                            timeout=TIMEOUT, check=True).stdout.split()
    assert answer == [str(importlib.util.find_spec("tensorboard") is not None), "False"]


def test_missing_tensorboardx_is_a_typed_error_at_construction(monkeypatch):
    # How Python marks a module missing: `import tensorboardX` raises ModuleNotFoundError.
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(UnsupportedError, match=r"tensorboardX.*Received: ModuleNotFoundError.*pip install tensorboardX"):
        kdist.callbacks.TensorBoard("logs")


@needs_reader
def test_multi_worker_only_the_chief_writes(tmp_path):
    history = tmp_path / "history.json"
    options = {"histogram_freq": 1, "update_freq": "batch"}
    log_dir, run = _run(tmp_path, "run", "unchanged", options, "--block-tensorflow", "--strategy", "multi_worker",
                        "--history", history, envs=harness.torchrun_envs(2))
    pids = {}
    for rank in range(2):
        output = run.output(f"worker-{rank}")
        assert "class=kdist.keras.tensorboard.TensorBoard" in output
        pids[rank] = re.search(r"pid=(\d+) rank=(\d)", output).group(1)
    (read,) = _read(tmp_path, log_dir)
    files = [name for run_name in read.values() for name in run_name["files"]]
    assert files and all(f".{pids[0]}." in name for name in files), (pids, files)
    assert not any(f".{pids[1]}." in name for name in files)
    _check_against_history(read, history, update_freq_batches=12)


# ----- in this process: construction, refusals, coverage of Keras' hooks ----------------------
def test_every_keras_hook_is_overridden():
    # A hook kdist inherited from Keras' class would write through tf.summary.
    keras_class = keras.callbacks.TensorBoard
    hooks = [name for name in vars(keras_class) if name.startswith("on_") or name == "set_model"]
    assert "on_epoch_end" in hooks
    assert [name for name in hooks if name not in vars(tensorboard.TensorBoard)] == []


def test_public_name_and_construction():
    assert kdist.callbacks.TensorBoard is tensorboard.TensorBoard
    callback = keras.callbacks.TensorBoard("logs")
    available = tensorboard_redirect.tensorflow_summaries_available()
    expected = keras.callbacks.TensorBoard if available else tensorboard.TensorBoard
    assert type(callback) is expected
    assert isinstance(kdist.callbacks.TensorBoard("logs"), keras.callbacks.TensorBoard)


@pytest.mark.parametrize(
    "options, error, named",
    [
        ({"profile_batch": 2}, InvalidArgumentError, "profile_batch"),
        ({"profile_batch": (1, 3)}, InvalidArgumentError, "profile_batch"),
        ({"update_freq": 0}, InvalidArgumentError, "update_freq"),
        ({"update_freq": "sometimes"}, InvalidArgumentError, "update_freq"),
        ({"embeddings_freq": 1}, UnsupportedError, "embeddings_freq"),
        ({"write_images": True, "histogram_freq": 1}, UnsupportedError, "write_images"),
    ],
)
def test_refusals_name_the_argument(options, error, named):
    with pytest.raises(error, match=f"{named}.*Received: {named}="):
        kdist.callbacks.TensorBoard("logs", **options)


def test_profile_batch_refusal_is_a_value_error_like_keras():
    with pytest.raises(ValueError):
        kdist.callbacks.TensorBoard("logs", profile_batch=1)


def test_write_images_without_histograms_is_accepted_as_in_keras():
    # Keras draws weight images only with histograms; without them the flag has no effect.
    callback = kdist.callbacks.TensorBoard("logs", write_images=True)
    assert callback.write_images is True and callback.histogram_freq == 0


@pytest.mark.parametrize(
    "values, counts",
    [
        ([], [0.0] * 30),
        ([2.5, 2.5, 2.5], [0.0] * 29 + [3.0]),
        ([0.0, 1.0, 3.0], [1.0] + [0.0] * 9 + [1.0] + [0.0] * 18 + [1.0]),
    ],
    ids=["empty", "one value", "spread"],
)
def test_histogram_buckets_follow_tf_summary_histogram(values, counts):
    lefts, rights, found = tensorboard.histogram_buckets(values)
    assert found.tolist() == counts
    if len(set(values)) > 1:
        assert lefts[0] == min(values) and rights[-1] == max(values)
        np.testing.assert_allclose(rights - lefts, (max(values) - min(values)) / 30)
