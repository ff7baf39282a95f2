"""`kdist.keras.sidecar.SidecarEvaluator`: evaluating checkpoints beside a training job.

The "chief" here is a thread that publishes prepared checkpoint files; it
publishes the next one when the evaluator reports an evaluation finished (a
Keras callback), so the tests wait on events, never on sleeps.
"""

import json
import logging
import os
import queue
import shutil
import threading
import warnings

import kdist  # noqa: F401  (sets KERAS_BACKEND before keras is imported)
import keras
from tests import seeding
import numpy as np
import pytest
import torch

from kdist.errors import InvalidArgumentError
from kdist.keras.sidecar import SidecarEvaluator

NUM_SAMPLES = 64
POLL = 0.02
DEADLINE = 20.0  # evaluator timeout: a bug ends the test instead of hanging it


def build_model(seed=3):
    seeding.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, 5)).astype("float32")
    y = rng.integers(0, 3, size=(NUM_SAMPLES,)).astype("int64")
    return x, y


def write_checkpoint(path, seed):
    """A checkpoint of `build_model()` with weights drawn from `seed`."""
    model = build_model()
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
    if str(path).endswith(".keras"):
        model.save(path)
    else:
        model.save_weights(path)
    return path


def expected_loss(path, data):
    model = build_model(seed=99)
    model.load_weights(path)
    return model.evaluate(*data, verbose=0, return_dict=True)["loss"]


def publish(source, destination, mtime_ns=None):
    """Copies in place (not atomically, like a chief writing directly) and optionally sets mtime."""
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    shutil.copyfile(source, destination)
    if mtime_ns is not None:
        os.utime(destination, ns=(mtime_ns, mtime_ns))


class Evaluated(keras.callbacks.Callback):
    """Puts the logs of every finished evaluation in a queue."""

    def __init__(self):
        super().__init__()
        self.logs = queue.Queue()

    def on_test_end(self, logs=None):
        self.logs.put(logs)


def chief(steps, evaluated):
    """A thread that runs `steps` (callables) one by one, each after the previous evaluation."""

    def run():
        for index, step in enumerate(steps):
            if index:
                evaluated.logs.get(timeout=DEADLINE)
            step()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def read_eval_json(path):
    with open(str(path) + ".eval.json") as file:
        return json.load(file)


@pytest.fixture
def staged(tmp_path):
    """Three prepared checkpoints with different weights, and their expected losses."""
    data = make_data()
    staging = tmp_path / "staging"
    staging.mkdir()
    paths = [write_checkpoint(str(staging / f"w{k}.weights.h5"), seed=k) for k in range(3)]
    return data, paths, [expected_loss(p, data) for p in paths]


@pytest.mark.timeout(60)
def test_evaluates_each_checkpoint_once_as_they_appear(tmp_path, staged, capsys, caplog):
    data, sources, losses = staged
    checkpoint_dir = tmp_path / "ckpt"  # made by the chief with its first checkpoint
    evaluated = Evaluated()
    steps = [
        lambda k=k: publish(sources[k], str(checkpoint_dir / f"epoch{k + 1}.weights.h5")) for k in range(3)
    ]
    writer = chief(steps, evaluated)
    evaluator = SidecarEvaluator(
        build_model(seed=5),
        data,
        checkpoint_dir,
        max_evaluations=3,
        callbacks=[evaluated],
        poll_interval=POLL,
        timeout=DEADLINE,
    )
    with caplog.at_level(logging.INFO, logger="kdist.sidecar"):
        records = evaluator.start()
    writer.join(timeout=DEADLINE)

    assert [r["checkpoint"] for r in records] == ["epoch1.weights.h5", "epoch2.weights.h5", "epoch3.weights.h5"]
    assert [r["evaluation"] for r in records] == [1, 2, 3]
    for record, loss in zip(records, losses):
        assert record["metrics"]["loss"] == pytest.approx(loss, rel=1e-6)
        document = read_eval_json(record["path"])
        assert document == {key: record[key] for key in ("checkpoint", "mtime_ns", "metrics", "evaluation", "time")}
        assert document["mtime_ns"] == os.stat(record["path"]).st_mtime_ns
    assert sorted(os.listdir(checkpoint_dir)) == sorted(
        [f"epoch{k}.weights.h5" for k in (1, 2, 3)] + [f"epoch{k}.weights.h5.eval.json" for k in (1, 2, 3)]
    )
    printed = capsys.readouterr().out
    assert f"SidecarEvaluator: evaluated epoch2.weights.h5: loss={losses[1]:.4f} accuracy=" in printed
    assert sum("SidecarEvaluator: evaluated" in r.getMessage() for r in caplog.records) == 3


@pytest.mark.timeout(60)
def test_stops_at_max_evaluations_oldest_first(tmp_path, staged):
    data, sources, losses = staged
    checkpoint_dir = tmp_path / "ckpt"
    base = 1_700_000_000 * 10**9
    # Names sort the other way round from mtimes: order must come from mtime.
    for k, name in enumerate(["d.weights.h5", "c.weights.h5", "b.weights.h5", "a.weights.h5"]):
        publish(sources[k % 3], str(checkpoint_dir / name), mtime_ns=base + k * 10**9)
    records = SidecarEvaluator(
        build_model(), data, str(checkpoint_dir), max_evaluations=2, poll_interval=POLL, timeout=DEADLINE
    ).start()
    assert [r["checkpoint"] for r in records] == ["d.weights.h5", "c.weights.h5"]
    assert [r["metrics"]["loss"] for r in records] == pytest.approx(losses[:2], rel=1e-6)
    assert not os.path.exists(checkpoint_dir / "b.weights.h5.eval.json")
    assert not os.path.exists(checkpoint_dir / "a.weights.h5.eval.json")


@pytest.mark.timeout(60)
def test_rewriting_the_same_path_is_a_new_checkpoint(tmp_path, staged):
    data, sources, losses = staged
    latest = str(tmp_path / "backup" / "latest.weights.h5")  # what BackupAndRestore rewrites
    publish(sources[0], latest, mtime_ns=1_700_000_000 * 10**9)
    evaluated = Evaluated()
    # Same size, only the mtime differs: identity is (path, mtime_ns, size).
    writer = chief([lambda: None, lambda: publish(sources[1], latest, mtime_ns=1_700_000_001 * 10**9)], evaluated)
    records = SidecarEvaluator(
        build_model(),
        data,
        tmp_path / "backup",
        max_evaluations=2,
        callbacks=[evaluated],
        poll_interval=POLL,
        timeout=DEADLINE,
    ).start()
    writer.join(timeout=DEADLINE)
    assert [r["checkpoint"] for r in records] == ["latest.weights.h5"] * 2
    assert [r["metrics"]["loss"] for r in records] == pytest.approx(losses[:2], rel=1e-6)
    assert read_eval_json(latest)["evaluation"] == 2


@pytest.mark.timeout(60)
def test_corrupt_checkpoint_is_skipped_with_a_warning(tmp_path, staged):
    data, sources, losses = staged
    checkpoint_dir = tmp_path / "ckpt"
    checkpoint_dir.mkdir()
    bad = checkpoint_dir / "x.keras"
    bad.write_bytes(np.random.default_rng(1).bytes(2048))
    os.utime(bad, ns=(1_700_000_000 * 10**9,) * 2)  # oldest: tried first
    publish(sources[2], str(checkpoint_dir / "y.weights.h5"), mtime_ns=1_700_000_001 * 10**9)
    evaluator = SidecarEvaluator(build_model(), data, checkpoint_dir, poll_interval=POLL, timeout=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        records = evaluator.start()
    skipped = [str(w.message) for w in caught if "skipping checkpoint" in str(w.message)]
    assert len(skipped) == 1 and "x.keras" in skipped[0]
    assert [r["checkpoint"] for r in records] == ["y.weights.h5"]
    assert records[0]["metrics"]["loss"] == pytest.approx(losses[2], rel=1e-6)
    assert not os.path.exists(str(bad) + ".eval.json")


@pytest.mark.timeout(60)
def test_half_written_checkpoint_is_evaluated_once_complete(tmp_path, staged):
    data, sources, losses = staged
    checkpoint_dir = tmp_path / "ckpt"
    publish(sources[0], str(checkpoint_dir / "a.weights.h5"), mtime_ns=1_700_000_000 * 10**9)
    half = checkpoint_dir / "b.weights.h5"
    with open(sources[1], "rb") as file:
        content = file.read()
    half.write_bytes(content[: len(content) // 2])
    os.utime(half, ns=(1_700_000_001 * 10**9,) * 2)
    evaluated = Evaluated()
    # The chief finishes writing b after a is evaluated; the evaluator may try the
    # half file before, during or after that, and must only ever evaluate it whole.
    writer = chief([lambda: None, lambda: publish(sources[1], str(half), mtime_ns=1_700_000_002 * 10**9)], evaluated)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        records = SidecarEvaluator(
            build_model(),
            data,
            checkpoint_dir,
            max_evaluations=2,
            callbacks=[evaluated],
            poll_interval=POLL,
            timeout=DEADLINE,
        ).start()
    writer.join(timeout=DEADLINE)
    assert [r["checkpoint"] for r in records] == ["a.weights.h5", "b.weights.h5"]
    assert [r["metrics"]["loss"] for r in records] == pytest.approx(losses[:2], rel=1e-6)
    assert records[1]["mtime_ns"] == 1_700_000_002 * 10**9


@pytest.mark.timeout(30)
def test_temporary_and_result_files_are_not_checkpoints(tmp_path, staged):
    data, sources, losses = staged
    publish(sources[0], str(tmp_path / "good.weights.h5"))
    publish(sources[1], str(tmp_path / ".kdist-tmp-123-good.weights.h5"))  # the chief's file before its rename
    records = SidecarEvaluator(build_model(), data, tmp_path, pattern="*", poll_interval=POLL, timeout=0.5).start()
    assert [r["checkpoint"] for r in records] == ["good.weights.h5"]  # and not good.weights.h5.eval.json
    assert records[0]["metrics"]["loss"] == pytest.approx(losses[0], rel=1e-6)


@pytest.mark.timeout(30)
def test_timeout_returns_without_checkpoints(tmp_path):
    records = SidecarEvaluator(
        build_model(), make_data(), tmp_path / "never_made", poll_interval=POLL, timeout=0.2
    ).start()
    assert records == []


@pytest.mark.timeout(30)
def test_stop_from_another_thread(tmp_path):
    evaluator = SidecarEvaluator(build_model(), make_data(), tmp_path, poll_interval=POLL)
    result = queue.Queue()
    thread = threading.Thread(target=lambda: result.put(evaluator.start()), daemon=True)
    thread.start()
    evaluator.stop()
    assert result.get(timeout=DEADLINE) == []


class ArrayDataset(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return len(self.x) // self.batch_size

    def __getitem__(self, index):
        window = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[window], self.y[window]


def _py_dataset(x, y):
    return ArrayDataset(x, y, batch_size=16)


def _data_loader(x, y):
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return torch.utils.data.DataLoader(dataset, batch_size=16)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda x, y: _py_dataset(x, y), id="py_dataset"),
        pytest.param(lambda x, y: _data_loader(x, y), id="data_loader"),
        pytest.param(lambda x, y: (lambda: _data_loader(x, y)), id="function"),
    ],
)
def test_data_forms_and_keras_format(tmp_path, make):
    x, y = make_data()
    path = write_checkpoint(str(tmp_path / "model.keras"), seed=4)
    calls = []
    source = make(x, y)
    is_function = callable(source)
    if is_function:
        function = source
        source = lambda: calls.append(1) or function()  # noqa: E731
    records = SidecarEvaluator(
        build_model(), source, tmp_path, steps=2, max_evaluations=1, poll_interval=POLL, timeout=DEADLINE
    ).start()
    reference = build_model(seed=99)
    reference.load_weights(path)
    expected = reference.evaluate(x[:32], y[:32], verbose=0, return_dict=True)["loss"]
    assert records[0]["metrics"]["loss"] == pytest.approx(expected, rel=1e-6)
    assert len(calls) == int(is_function)  # a function is called once


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("model", dict(model="not a model")),
        ("steps", dict(steps=0)),
        ("steps", dict(steps=1.5)),
        ("max_evaluations", dict(max_evaluations=0)),
        ("max_evaluations", dict(max_evaluations=2.0)),
        ("max_evaluations", dict(max_evaluations=True)),
        ("poll_interval", dict(poll_interval=0)),
        ("poll_interval", dict(poll_interval=-1.0)),
        ("timeout", dict(timeout=0)),
        ("checkpoint_dir", dict(checkpoint_dir=42)),
        ("pattern", dict(pattern=())),
        ("callbacks", dict(callbacks=["not a callback"])),
        ("data", dict(data=None)),
    ],
)
def test_bad_arguments_raise(tmp_path, name, kwargs):
    arguments = dict(model=build_model(), data=make_data(), checkpoint_dir=tmp_path)
    arguments.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=f"Received: {name}="):
        SidecarEvaluator(**arguments)


def test_uncompiled_model_raises(tmp_path):
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    with pytest.raises(InvalidArgumentError, match="compiled.*Received: model="):
        SidecarEvaluator(model, make_data(), tmp_path)


def test_checkpoint_dir_that_is_a_file_raises(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(InvalidArgumentError, match="Received: checkpoint_dir="):
        SidecarEvaluator(build_model(), make_data(), path)
