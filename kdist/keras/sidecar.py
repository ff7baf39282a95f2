"""`SidecarEvaluator`: evaluates the checkpoints a training job writes, beside the job.

- **Evaluator task**: the optional `"evaluator"` task of a `TF_CONFIG` cluster. It takes
  no part in training: it never talks to the chief, the workers or the parameter
  servers, and they never wait for it. It only reads the checkpoint directory the chief
  writes to, so a missing, slow or dead evaluator never blocks training.
- **Checkpoint**: one file in that directory whose name matches the evaluator's patterns
  (`ModelCheckpoint` writes `*.keras` or `*.weights.h5`; `BackupAndRestore` rewrites
  `latest.weights.h5`). Its identity is `(path, mtime_ns, size)`: a file rewritten at the
  same path is a new checkpoint. Only stable files (same identity over two polls) are
  loaded: `kdist.keras.checkpoint_watch` finds them.
- **Evaluation record**: what one evaluation produced; also written beside the
  checkpoint as `<checkpoint>.eval.json`.
"""

import json
import logging
import numbers
import os
import threading
import time
import warnings

import keras

from kdist import atomic_files
from kdist.distribute import context
from kdist.errors import InvalidArgumentError
from kdist.keras.checkpoint_watch import EVALUATION_SUFFIX, CheckpointWatch, identity_of
from kdist.validation import invalid, is_integer, is_seconds

logger = logging.getLogger("kdist.sidecar")

# A checkpoint that fails to load this many times, without changing on disk, is
# corrupt rather than half-written: the writer would have changed its size or mtime.
MAX_LOAD_ATTEMPTS = 3


class SidecarEvaluator:
    """Evaluates each new checkpoint in a directory once, while another job trains.

    TensorFlow's `tf.keras.utils.SidecarEvaluator` for kdist. Run it in the
    `"evaluator"` task of a cluster (or in any other process that can read the
    checkpoint directory). It polls `checkpoint_dir` every `poll_interval` seconds;
    for each new checkpoint, oldest (by mtime) first, it loads the weights into
    `model` with `model.load_weights`, calls `model.evaluate`, then logs and prints
    one line (logger `"kdist.sidecar"`) and writes the metrics atomically to
    `<checkpoint>.eval.json`:
    `{"checkpoint": name, "mtime_ns": ..., "metrics": {...}, "evaluation": k, "time": ...}`
    (`k` counts from 1; `time` is Unix time).

    A file is loaded only once it is stable (same size and mtime over two polls).
    A file that fails to load is tried again on later polls; after
    `MAX_LOAD_ATTEMPTS` failures of the same unchanged file it is skipped with a
    warning. A bad file never stops the evaluator.

    Thread safety: `start` runs in one thread at a time; `stop` may be called from
    any thread.

    Args:
        model: a compiled `keras.Model` built like the trained one, outside any
            strategy scope: the evaluator is an ordinary single process.
        data: what `model.evaluate` accepts as input: a tuple `(x, y)` or
            `(x, y, sample_weight)` of arrays (unpacked into `x`, `y` and
            `sample_weight`), a `keras.utils.PyDataset`, a
            `torch.utils.data.DataLoader`, or a function of no arguments that
            returns one of those (called once, at the first evaluation).
        checkpoint_dir: the directory the chief writes checkpoints to. It need not
            exist yet. Not searched recursively.
        steps: batches per evaluation, passed to `evaluate`; None for all of `data`.
        max_evaluations: `start` returns after this many evaluations; None to run
            until `timeout` or `stop`.
        callbacks: Keras callbacks passed to every `evaluate` call.
        poll_interval: seconds between two looks at `checkpoint_dir`.
        timeout: `start` returns when this many seconds pass without a new
            checkpoint (counted from `start`, from the last new checkpoint, or
            from the end of the last evaluation); None to wait forever.
        pattern: a glob (`fnmatch`) or tuple of globs that checkpoint file names
            match. Names starting with `.` (temporary files) and ending with
            `.eval.json` never count.

    Raises:
        InvalidArgumentError: an argument has the wrong type or value, `model` is
            not compiled, is attached to a strategy, or `checkpoint_dir` is a file.

    Example:

    ```python
    import kdist, keras

    resolver = kdist.cluster.TFConfigClusterResolver()
    if resolver.task_type == "evaluator":
        model = build_model()  # no strategy scope
        model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        kdist.SidecarEvaluator(model, data=(x_val, y_val), checkpoint_dir="/ckpt").start()
    else:
        ...  # train; the chief runs keras.callbacks.ModelCheckpoint("/ckpt/{epoch}.keras")
    ```
    """

    def __init__(
        self,
        model,
        data,
        checkpoint_dir,
        steps=None,
        max_evaluations=None,
        callbacks=None,
        poll_interval=1.0,
        timeout=None,
        pattern=("*.keras", "*.weights.h5"),
    ):
        _check_model(model)
        if data is None:
            raise invalid("data", data, "arrays `(x, y)`, a PyDataset, a DataLoader or a function returning one")
        if not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise invalid("checkpoint_dir", checkpoint_dir, "a str or os.PathLike naming a directory")
        checkpoint_dir = os.fspath(checkpoint_dir)
        if not isinstance(checkpoint_dir, str):
            raise invalid("checkpoint_dir", checkpoint_dir, "a text path, not bytes")
        if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
            raise invalid("checkpoint_dir", checkpoint_dir, "a directory (or where one will be made), not a file")
        if steps is not None and not is_integer(steps, minimum=1):
            raise invalid("steps", steps, "a positive int, or None to evaluate all of `data`")
        if max_evaluations is not None and not is_integer(max_evaluations, minimum=1):
            raise invalid("max_evaluations", max_evaluations, "an int >= 1, or None to run until stopped")
        if not is_seconds(poll_interval, allow_infinite=True):
            raise invalid("poll_interval", poll_interval, "a number of seconds > 0")
        if timeout is not None and not is_seconds(timeout, allow_infinite=True):
            raise invalid("timeout", timeout, "a number of seconds > 0, or None to wait forever")
        patterns = _check_patterns(pattern)
        self._callbacks = _check_callbacks(callbacks)

        self.model = model
        self.checkpoint_dir = checkpoint_dir
        self.steps = steps
        self.max_evaluations = max_evaluations
        self.poll_interval = float(poll_interval)
        self.timeout = None if timeout is None else float(timeout)
        self._data_source = data
        self._data = None
        self._stopped = threading.Event()
        self._records = []
        self._watch = CheckpointWatch(checkpoint_dir, patterns)
        # path -> (identity, failed loads of that identity)
        self._failures = {}

    @property
    def records(self):
        """The evaluation records so far, oldest first (a copy)."""
        return list(self._records)

    def stop(self):
        """Makes `start` return after the evaluation in progress, if any. Thread-safe; final."""
        self._stopped.set()

    def start(self):
        """Watches the directory and evaluates new checkpoints until a stop condition.

        Blocks until `max_evaluations` evaluations are done, `timeout` seconds pass
        without a new checkpoint, or `stop` is called.

        Returns:
            The list of evaluation records, oldest first; each is the
            `.eval.json` document plus `"path"`, the checkpoint's full path.

        Raises:
            Whatever `model.evaluate` raises (a problem with `data` or the model,
            not with a checkpoint).
        """
        last_news = time.monotonic()
        while not self._stopped.is_set() and not self._done():
            stable, news = self._watch.poll()
            if news:
                last_news = time.monotonic()
            for identity in stable:
                if self._stopped.is_set() or self._done():
                    break
                if self._evaluate(identity):
                    last_news = time.monotonic()
            if self._done():
                break
            wait = self.poll_interval
            if self.timeout is not None:
                remaining = self.timeout - (time.monotonic() - last_news)
                if remaining <= 0:
                    break
                wait = min(wait, remaining)
            self._stopped.wait(wait)
        return self.records

    # ----- polling --------------------------------------------------------------------
    def _done(self):
        return self.max_evaluations is not None and len(self._records) >= self.max_evaluations

    # ----- one checkpoint -------------------------------------------------------------
    def _evaluate(self, identity):
        """Loads and evaluates one stable checkpoint. Returns True when it was evaluated."""
        path, mtime_ns, _ = identity
        if identity_of(path) != identity:
            return False  # Rewritten or removed since the poll; a later poll sees the new file.
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built and self.model.built:
            # Checkpoints carry the optimizer's slots; with the optimizer built
            # they load quietly (evaluation does not use them).
            optimizer.build(self.model.trainable_variables)
        try:
            self.model.load_weights(path)
        # Loading a half-written or corrupt file fails with zipfile, h5py, OSError or
        # ValueError depending on the format and where the bytes stop: any of them
        # means "not loadable now", and none must stop the evaluator.
        except Exception as error:  # noqa: BLE001
            if identity_of(path) != identity:
                return False  # Being rewritten: not this file's fault.
            self._record_failure(identity, error)
            return False
        if identity_of(path) != identity:
            return False  # Changed while it was read: the weights may be torn.

        if self._data is None:
            source = self._data_source
            self._data = source() if _is_data_function(source) else source
        metrics = _evaluate_model(self.model, self._data, self.steps, self._callbacks)
        # The loss first, then the metrics in Keras' order.
        names = sorted(metrics, key=lambda key: key != "loss")
        metrics = {key: _to_json(metrics[key]) for key in names}
        name = os.path.basename(path)
        document = {
            "checkpoint": name,
            "mtime_ns": mtime_ns,
            "metrics": metrics,
            "evaluation": len(self._records) + 1,
            "time": time.time(),
        }
        atomic_files.write_text(path + EVALUATION_SUFFIX, json.dumps(document, indent=2))
        self._watch.finish(identity)
        self._failures.pop(path, None)
        self._records.append(dict(document, path=path))
        line = f"SidecarEvaluator: evaluated {name}: " + " ".join(
            f"{key}={_format_metric(value)}" for key, value in metrics.items()
        )
        logger.info(line)
        print(line, flush=True)
        return True

    def _record_failure(self, identity, error):
        path = identity[0]
        previous_identity, count = self._failures.get(path, (None, 0))
        count = count + 1 if previous_identity == identity else 1
        self._failures[path] = (identity, count)
        logger.debug("Loading %s failed (attempt %d): %r", path, count, error)
        if count >= MAX_LOAD_ATTEMPTS:
            self._watch.finish(identity)
            del self._failures[path]
            warnings.warn(
                f"SidecarEvaluator: skipping checkpoint {path}: it failed to load {count} times "
                f"without changing on disk ({type(error).__name__}: {error}). It is probably "
                "corrupt or from a different model; it will be evaluated again only if "
                "it is rewritten.",
                RuntimeWarning,
                stacklevel=2,
            )


# ----- helpers --------------------------------------------------------------------------
def _evaluate_model(model, data, steps, callbacks):
    kwargs = dict(steps=steps, return_dict=True, verbose=0, callbacks=callbacks)
    # Keras reads a tuple of arrays as a model with several inputs, so `(x, y)` is unpacked.
    if isinstance(data, tuple) and len(data) in (2, 3):
        return model.evaluate(*data, **kwargs)
    return model.evaluate(data, **kwargs)


def _is_data_function(data):
    return callable(data) and not isinstance(data, (tuple, list, keras.utils.PyDataset))


def _to_json(value):
    if isinstance(value, numbers.Number):
        return float(value)
    array = keras.ops.convert_to_numpy(value)
    return array.item() if array.ndim == 0 else array.tolist()


def _format_metric(value):
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise invalid("model", model, "a keras.Model")
    if not getattr(model, "compiled", False):
        raise InvalidArgumentError(
            f"SidecarEvaluator needs a compiled model: it calls `model.evaluate`. Received: "
            f"model={model.name!r}, which is not compiled. Call `model.compile(loss=..., metrics=...)` first."
        )
    strategy = context.strategy_of(model)
    if strategy is not None:
        raise InvalidArgumentError(
            f"SidecarEvaluator got a model attached to a strategy. Received: model={model.name!r} "
            f"created or compiled in the scope of {strategy!r}. The evaluator is an ordinary "
            "process: build and compile its model outside any strategy scope."
        )


def _check_patterns(pattern):
    patterns = (pattern,) if isinstance(pattern, str) else pattern
    if not isinstance(patterns, (tuple, list)) or not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise invalid("pattern", pattern, 'a glob such as "*.keras", or a non-empty tuple of them')
    return tuple(patterns)


def _check_callbacks(callbacks):
    if callbacks is None:
        return None
    if not isinstance(callbacks, (list, tuple)) or not all(isinstance(c, keras.callbacks.Callback) for c in callbacks):
        raise invalid("callbacks", callbacks, "None or a list of keras.callbacks.Callback")
    return list(callbacks)
