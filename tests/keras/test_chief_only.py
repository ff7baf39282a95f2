"""`kdist.keras.chief_only`: a between-graph parameter-server worker other than the chief writes nothing.

Real gRPC servers in this process, a 2-worker cluster spec, and one worker
(this process) training alone with every writing callback Keras has:
`ModelCheckpoint`, `BackupAndRestore`, `CSVLogger`, `TensorBoard` and the
progress bar. Worker 1 (not the chief) writes no file and prints no progress;
its other callbacks run and its `fit` trains. The control is worker 0 (the
chief) with the same call: every writer writes, so the check can see a write.

Worker 1's `BackupAndRestore` keeps its own progress in `<backup_dir>/worker-1`:
it never restores, rewrites or deletes the chief's, and it resumes from its own.
"""

import keras
import numpy as np
import pytest

import kdist
from tests.keras import _ps

pytestmark = pytest.mark.timeout(240)

EPOCHS = 2


class Recorder(keras.callbacks.Callback):
    """A callback that writes nothing: it runs on every task."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")


def writers(root):
    return [
        keras.callbacks.ModelCheckpoint(str(root / "ckpt" / "epoch{epoch}.weights.h5"), save_weights_only=True),
        keras.callbacks.BackupAndRestore(str(root / "backup"), delete_checkpoint=False),
        keras.callbacks.CSVLogger(str(root / "log.csv")),
        kdist.callbacks.TensorBoard(str(root / "tensorboard")),
    ]


def train(cluster, worker, callbacks, epochs=EPOCHS):
    strategy = kdist.ParameterServerStrategy(cluster.resolver("worker", worker))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x, y = data()
    history = model.fit(x, y, batch_size=16, epochs=epochs, callbacks=callbacks, verbose=1)
    return strategy, history


def files_under(root):
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


@pytest.mark.parametrize("worker", [1, 0], ids=["non_chief", "chief_control"])
def test_only_the_chief_worker_writes(tmp_path, capsys, worker):
    recorder = Recorder()
    with _ps.in_process_servers(1, num_workers=2) as cluster:
        strategy, history = train(cluster, worker, [*writers(tmp_path), recorder])
    progress = capsys.readouterr().out

    assert recorder.epochs == list(range(EPOCHS))
    assert len(history.history["loss"]) == EPOCHS
    files = files_under(tmp_path)
    if worker == 1:
        assert not strategy.extended.should_checkpoint and not strategy.extended.should_save_summary
        # Its own progress only (delete_checkpoint=False keeps it after fit); the
        # weights are the servers', which the chief saves.
        assert files == ["backup/worker-1/training_metadata.json"]
        assert f"Epoch 1/{EPOCHS}" not in progress
    else:
        # The control: the same callbacks on the chief write every file.
        assert strategy.extended.should_checkpoint and strategy.extended.should_save_summary
        assert {"ckpt/epoch1.weights.h5", "ckpt/epoch2.weights.h5", "log.csv"} <= set(files)
        assert "backup/latest.weights.h5" in files and "backup/training_metadata.json" in files
        assert any(name.startswith("tensorboard/") for name in files)
        assert f"Epoch 1/{EPOCHS}" in progress


def test_a_non_chief_worker_keeps_its_own_backup_and_never_touches_the_chiefs(tmp_path):
    backup = tmp_path / "backup"
    with _ps.in_process_servers(1, num_workers=2) as cluster:
        train(cluster, 0, [keras.callbacks.BackupAndRestore(str(backup), delete_checkpoint=False)], epochs=1)
    chiefs = {name: (backup / name).read_bytes() for name in files_under(backup)}
    assert set(chiefs) == {"latest.weights.h5", "training_metadata.json"}

    # Worker 1 starts: the chief's backup is not its progress, so it starts at epoch 0.
    recorder = Recorder()
    with _ps.in_process_servers(1, num_workers=2) as cluster:
        train(cluster, 1, [keras.callbacks.BackupAndRestore(str(backup), delete_checkpoint=False), recorder],
              epochs=1)
    assert recorder.epochs == [0]
    assert files_under(backup) == sorted([*chiefs, "worker-1/training_metadata.json"])

    # Worker 1 comes back: it resumes after its own epoch 0, then deletes its own backup only.
    recorder = Recorder()
    with _ps.in_process_servers(1, num_workers=2) as cluster:
        callbacks = [keras.callbacks.BackupAndRestore(str(backup), delete_checkpoint=True), recorder]
        train(cluster, 1, callbacks, epochs=EPOCHS)
    assert recorder.epochs == list(range(1, EPOCHS))
    assert {name: (backup / name).read_bytes() for name in files_under(backup)} == chiefs


def test_negative_control_without_the_rule_worker_1_resumes_from_the_chiefs_backup(tmp_path, monkeypatch):
    # What the rule prevents: worker 1 reading the chief's backup as its own progress.
    from kdist.keras import chief_only

    monkeypatch.setattr(chief_only, "own_backup", lambda callback, task: None)
    backup = tmp_path / "backup"
    with _ps.in_process_servers(1, num_workers=2) as cluster:
        train(cluster, 0, [keras.callbacks.BackupAndRestore(str(backup), delete_checkpoint=False)], epochs=1)
    recorder = Recorder()
    with _ps.in_process_servers(1, num_workers=2) as cluster:
        train(cluster, 1, [keras.callbacks.BackupAndRestore(str(backup), delete_checkpoint=False), recorder],
              epochs=EPOCHS)
    assert recorder.epochs == list(range(1, EPOCHS))  # skipped the epoch the chief had done


@pytest.mark.parametrize("task", [None, "", 3, "..", "../chief", "worker/1", "worker-1\n"])
def test_a_task_that_trains_alone_must_be_named(task):
    from kdist.errors import InvalidArgumentError
    from kdist.keras import chief_only

    callbacks = [keras.callbacks.BackupAndRestore("unused")]
    arguments = {"callbacks": callbacks}
    with pytest.raises(InvalidArgumentError, match="task=") as error:
        chief_only.task_callbacks(arguments, kdist.get_strategy(), collective_saves=False, task=task)
    assert "worker-1" in str(error.value)
    assert arguments == {"callbacks": callbacks}  # nothing changed
    assert getattr(callbacks[0], "_kdist_own_backup", None) is None
