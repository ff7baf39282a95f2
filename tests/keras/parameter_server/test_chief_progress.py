"""The coordinator's `fit`/`evaluate` show Keras' own progress, and no redraws off a terminal."""

import io
import re
import sys

import pytest

import kdist
import kdist.coordinator
import keras
from kdist.keras.progress import CoordinatorStatusLogger, is_terminal, resolve_verbose
from tests.coordinator import _cluster, _functions

pytestmark = pytest.mark.timeout(300)

# Keras' verbose=2 line: "4/4 - 0s - 25ms/step - accuracy: 0.1953 - loss: 2.2734".
EPOCH_LINE = re.compile(r"^(\d+)/\1 - \d+s - \d+(ms|s|us)/step( - \w+: [-+.\de]+)+$")


class _Terminal(io.StringIO):
    """A text stream that says it is a terminal (what Keras' Progbar and kdist ask)."""

    def isatty(self):
        return True


def test_keras_progbar_redraws_with_carriage_returns_even_off_a_terminal(capsys):
    """Why kdist draws no bar off a terminal: Keras' own bar takes any POSIX stdout for a live display.

    The control for the tests below: the same check finds "\\r" in Keras' bar.
    If Keras stops doing this, `resolve_verbose` may pass 1 through again.
    """
    assert not is_terminal(sys.stdout)
    bar = keras.utils.Progbar(target=3, verbose=1, interval=0)
    for step in (1, 2, 3):
        bar.update(step, [("loss", 1.0 / step)])
    assert "\r" in capsys.readouterr().out


def test_resolve_verbose_draws_a_bar_only_on_a_terminal():
    terminal, pipe = _Terminal(), io.StringIO()
    assert [resolve_verbose(v, terminal) for v in ("auto", 1, 2, 0)] == [1, 1, 2, 0]
    assert [resolve_verbose(v, pipe) for v in ("auto", 1, 2, 0)] == [2, 2, 2, 0]
    closed = io.StringIO()
    closed.close()
    assert resolve_verbose("auto", closed) == 2


class _Stats:
    """The two things the status line reads from a `ClusterCoordinator`."""

    def __init__(self, num_workers):
        self.num_workers = num_workers
        self.stats = {"closures_retried": 0, "workers_available": num_workers}


def test_status_line_only_when_closures_were_retried_or_workers_are_missing(capsys):
    coordinator = _Stats(num_workers=2)
    logger = CoordinatorStatusLogger(coordinator)
    logger.on_epoch_begin(0)
    logger.on_epoch_end(0, {})
    assert capsys.readouterr().out == ""

    coordinator.stats = {"closures_retried": 2, "workers_available": 2}
    logger.on_epoch_begin(1)  # Counts from here: the epoch retried nothing.
    logger.on_epoch_end(1, {})
    assert capsys.readouterr().out == ""

    coordinator.stats = {"closures_retried": 5, "workers_available": 1}
    logger.on_epoch_end(1, {})
    assert capsys.readouterr().out == (
        "Coordinator: 3 closures retried after worker failures this epoch; 1/2 workers available\n")


def _fit(model, verbose, epochs=2):
    return model.fit(_functions.dataset_fn, epochs=epochs, steps_per_epoch=4, verbose=verbose)


def test_coordinator_fit_prints_keras_progress_by_verbose(tmp_path, capsys, monkeypatch):
    with _cluster.start(num_workers=1, num_ps=1, tmp_path=tmp_path) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            model = _functions.build_model()
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
        capsys.readouterr()
        outputs = {}
        for verbose in (2, 0, 1, "auto"):
            _fit(model, verbose)
            outputs[verbose] = capsys.readouterr()
        x, y = _functions.make_digits(64, seed=2)
        model.evaluate(x, y, batch_size=32, verbose=2)
        evaluated = capsys.readouterr().out
        # In a terminal, "auto" is Keras' bar, redrawn in place.
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stdout", terminal)
        _fit(model, "auto", epochs=1)
        monkeypatch.undo()
        strategy.extended.cluster_coordinator.shutdown()

    # verbose=2: Keras' "Epoch i/n" then one line per epoch, nothing redrawn, nothing on stderr.
    lines = outputs[2].out.splitlines()
    assert lines[0::2] == ["Epoch 1/2", "Epoch 2/2"], outputs[2].out
    assert all(EPOCH_LINE.match(line) for line in lines[1::2]) and len(lines) == 4, outputs[2].out
    assert lines[1].startswith("4/4 - ") and " - loss: " in lines[1] and " - accuracy: " in lines[1]
    assert "\r" not in outputs[2].out and "\x08" not in outputs[2].out
    assert "Epoch" not in outputs[2].err and "step/s" not in outputs[2].err
    # verbose=0: silent.
    assert outputs[0].out == "" and "Epoch" not in outputs[0].err
    # verbose=1 and "auto" off a terminal: the same one line per epoch, no "\r".
    for verbose in (1, "auto"):
        text = outputs[verbose].out
        assert "\r" not in text and "\x08" not in text, repr(text)
        assert [line.startswith("Epoch ") or bool(EPOCH_LINE.match(line)) for line in text.splitlines()] == \
            [True] * 4, repr(text)
    # evaluate(verbose=2): one line.
    assert len(evaluated.splitlines()) == 1 and EPOCH_LINE.match(evaluated.strip()), repr(evaluated)
    # The terminal got Keras' bar (redrawn with "\r"), ending at 4/4.
    drawn = terminal.getvalue()
    assert "\r" in drawn and "━" in drawn and "4/4" in drawn, repr(drawn)
