"""Saves under ParameterServerStrategy that fail partway leave the previous checkpoint loadable.

The failures are real: a child process lowers its file size limit
(RLIMIT_FSIZE) to a third of the checkpoint and ignores SIGXFSZ, so the next
write fails with EFBIG a third of the way through, as a full disk would.
The files are then loaded here with plain Keras, outside any strategy.
"""

import errno
import json
import os
from pathlib import Path

import keras
import numpy as np
import pytest

from kdist import atomic_files
from kdist.keras import atomic_save
from tests import harness
from tests.keras.workers import failing_saves

pytestmark = pytest.mark.timeout(300)

WORKER = Path(failing_saves.__file__)
EFBIG = ["OSError", errno.EFBIG]


def run_worker(mode, directory, envs=None):
    envs = envs or [("chief", {})]
    harness.run(harness.python_specs(envs, WORKER, "--mode", mode, "--dir", str(directory)), timeout=240).check()


def first_weights(directory):
    with np.load(directory / "first.npz") as saved:
        return [saved[f"arr_{index}"] for index in range(len(saved.files))]


def _plain_model():
    model = failing_saves._model()
    model.optimizer.build(model.trainable_variables)  # so load_weights reads its slots too
    return model


def assert_weights_equal(model, expected):
    got = model.get_weights()
    assert len(got) == len(expected)
    for value, reference in zip(got, expected):
        np.testing.assert_array_equal(value, reference)


def assert_no_temporary_files(directory):
    for _, _, names in os.walk(directory):
        assert not [name for name in names if name.startswith(atomic_files.TEMPORARY_PREFIX)], names


@pytest.fixture(scope="module")
def ps_saves(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ps_save")
    run_worker("ps_save", directory)
    return directory, json.loads((directory / "ps_save.json").read_text())


def test_failed_saves_under_parameter_server_strategy_keep_the_previous_files(ps_saves):
    tmp_path, result = ps_saves
    errors = result["errors"]
    # model.save, save_weights and ModelCheckpoint each raised the write's error ...
    assert errors["save"] == EFBIG and errors["save_weights"] == EFBIG and errors["model_checkpoint"] == EFBIG, errors
    # ... and left the first save's files byte for byte, with no temporary file beside them.
    assert result["after"] == result["before"]
    assert_no_temporary_files(tmp_path)
    expected = first_weights(tmp_path)
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert_weights_equal(loaded, expected)
    plain = _plain_model()
    plain.load_weights(tmp_path / "model.weights.h5")
    assert_weights_equal(plain, expected)


def test_negative_control_the_same_failure_in_place_tears_the_checkpoint(ps_saves):
    tmp_path, result = ps_saves
    assert result["errors"]["in_place"] == EFBIG
    assert result["control_size"] < result["saved_size"] // 2  # truncated a third of the way
    with pytest.raises(Exception):  # noqa: B017 - whatever a torn zip raises
        keras.saving.load_model(tmp_path / "control" / "model.keras")


def test_a_failed_backup_on_the_coordinator_keeps_the_previous_backup_and_the_rerun_resumes(tmp_path):
    run_worker("coordinator_backup", tmp_path)
    result = json.loads((tmp_path / "coordinator_backup.json").read_text())
    assert result["errors"]["backup"] == EFBIG, result["errors"]
    assert result["after"] == result["before"]  # weights and metadata of epoch 1
    assert result["listing"] == ["latest.weights.h5", "training_metadata.json"]
    plain = _plain_model()
    plain.load_weights(tmp_path / "backup" / "latest.weights.h5")
    assert_weights_equal(plain, first_weights(tmp_path))
    # The same fit, run again, restores epoch 1's backup and trains epochs 1 and 2.
    run_worker("coordinator_resume", tmp_path)
    assert json.loads((tmp_path / "coordinator_resume.json").read_text())["resumed_epochs"] == [1, 2]


def test_save_takes_the_arguments_keras_takes_and_leaves_only_the_target(tmp_path):
    model = _plain_model()
    path = tmp_path / "model.keras"
    for args, kwargs in (((path,), {}), ((str(path), True), {}), ((), {"filepath": path, "overwrite": True})):
        atomic_save.save(keras.Model.save, model, args, kwargs)
        assert_weights_equal(keras.saving.load_model(path), model.get_weights())
    atomic_save.save(keras.Model.save_weights, model, (tmp_path / "model.weights.h5",), {"overwrite": True})
    assert sorted(os.listdir(tmp_path)) == ["model.keras", "model.weights.h5"]
    # Sharded weights are several files: written directly, under their own names.
    atomic_save.save(keras.Model.save_weights, model, (tmp_path / "sharded.weights.json",), {"max_shard_size": 0.001})
    assert not [name for name in os.listdir(tmp_path) if name.startswith(atomic_files.TEMPORARY_PREFIX)]
    plain = _plain_model()
    plain.load_weights(tmp_path / "sharded.weights.json")
    assert_weights_equal(plain, model.get_weights())
