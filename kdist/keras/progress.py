"""Progress output of kdist's own `fit`/`evaluate` loops, shown the way Keras shows it.

The coordinator's `fit` and `evaluate` (`kdist.keras.parameter_server.chief_fit`)
hand progress to Keras' own `keras.callbacks.ProgbarLogger`, added by the
`keras.callbacks.CallbackList` exactly as Keras' `fit` adds it: `verbose=0`
prints nothing, `verbose=1` draws Keras' `Progbar`, `verbose=2` prints one
line per epoch (`"8/8 - 1s - 95ms/step - accuracy: 0.7 - loss: 0.9"`).

One difference, so that logs stay readable: Keras' `Progbar` redraws its bar
with backspaces and carriage returns whether or not stdout is a terminal (on
POSIX it always takes the display for a dynamic one), so a bar written into a
file or a pipe becomes one long line of redraws. Here a bar (`verbose=1` or
`"auto"`) is drawn only when stdout is a terminal; otherwise the output is
`verbose=2`'s one line per epoch, the mode Keras' documentation recommends for
logs. TensorFlow's `fit` under `ParameterServerStrategy` made `"auto"` mean 2
everywhere; in a terminal kdist draws the bar instead.
"""

import logging
import sys

import keras

_logger = logging.getLogger(__name__)


def resolve_verbose(verbose, stream=None):
    """Returns the verbosity a kdist `fit`/`evaluate` loop uses for Keras' `verbose` argument.

    Args:
        verbose: `"auto"`, 0, 1 or 2, as passed to `fit` or `evaluate`.
        stream: where Keras' progress goes; None means the current `sys.stdout`.

    Returns:
        `verbose` unchanged, except that `"auto"` and 1 become 1 when `stream`
        is a terminal and 2 when it is not (a file, a pipe, a launcher's log).

    Example:
        ```python
        resolve_verbose("auto")   # 1 in a terminal, 2 when stdout is redirected
        resolve_verbose(0)        # 0
        ```
    """
    if verbose != "auto" and verbose != 1:
        return verbose
    stream = sys.stdout if stream is None else stream
    return 1 if is_terminal(stream) else 2


def is_terminal(stream):
    """True when `stream` is an interactive terminal (closed or odd streams are not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class CoordinatorStatusLogger(keras.callbacks.Callback):
    """After each epoch, one line when closures were retried or workers are unavailable.

    Keras' progress line has no place for the coordinator's health, so this
    callback adds a line of its own, only when there is something to say:

    `Coordinator: 3 closures retried after worker failures this epoch; 1/2 workers available`

    Runs on the chief; reads `coordinator.stats` (see
    `kdist.coordinator.ClusterCoordinator.stats`) at the start and end of each
    epoch. Not thread-safe (callbacks run on the thread that runs `fit`).

    Args:
        coordinator: the `ClusterCoordinator` driving `fit`.

    Example:
        ```python
        callbacks.append(CoordinatorStatusLogger(coordinator))   # with verbose != 0
        ```
    """

    def __init__(self, coordinator):
        super().__init__()
        self._coordinator = coordinator
        self._retried_at_epoch_begin = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._retried_at_epoch_begin = self._coordinator.stats["closures_retried"]

    def on_epoch_end(self, epoch, logs=None):
        stats = self._coordinator.stats
        retried = stats["closures_retried"] - self._retried_at_epoch_begin
        available, num_workers = stats["workers_available"], self._coordinator.num_workers
        if retried == 0 and available >= num_workers:
            return
        closures = "closure" if retried == 1 else "closures"
        _print_line(
            f"Coordinator: {retried} {closures} retried after worker failures this epoch; "
            f"{available}/{num_workers} workers available"
        )


def _print_line(message):
    # Where Keras' own progress goes: stdout, or Python logging once the user
    # called `keras.config.disable_interactive_logging()`.
    if keras.config.is_interactive_logging_enabled():
        print(message, flush=True)
    else:
        _logger.info(message)
