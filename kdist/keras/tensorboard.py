"""`TensorBoard` without TensorFlow: Keras' callback, its event files written by tensorboardX.

Keras' `keras.callbacks.TensorBoard` writes through `tf.summary`, so on torch
it needs TensorFlow and the tensorboard package. This callback writes what
Keras' writes on torch, to the same places, through tensorboardX's event
writer (which needs only protobuf and NumPy):

- runs `<log_dir>/train` and `<log_dir>/validation`, a new event file in each
  every time `fit`/`evaluate` starts with the callback (as Keras' writers);
- `epoch_<metric>` (training logs on `train`, `val_` logs on `validation`,
  without the prefix) and `epoch_learning_rate` at step `epoch`;
  `epoch_steps_per_second` with `write_steps_per_second`;
- `batch_<metric>` (and `batch_steps_per_second`) on `train` at step
  1, 2, ... counted from the start of `fit`, every `update_freq` batches;
- `evaluation_<metric>_vs_iterations` on `validation` at the optimizer's
  `iterations` after every evaluation (standalone or validation);
- `<weight path>/histogram` on `train` every `histogram_freq` epochs, in the
  30 equal-width buckets `tf.summary.histogram` uses;
- with `write_graph`, the model's JSON (tag `keras`, plugin
  `graph_keras_model`, step 0) for Functional and Sequential models; Keras
  writes no op graph on torch (there is no `tf.function`), nor does this.

With an integer `update_freq`, Keras' `tf.summary.record_if` condition stays in
force after the batch that set it, so epoch scalars and histograms are written
only when the epoch's last batch number is a multiple of `update_freq`, and
`evaluation_*` only when the running count of evaluation batches is. This
callback reproduces that gating so the files stay those of Keras.

Refused with a typed error (Keras' own callback cannot do them on torch either,
or kdist cannot do them exactly): `profile_batch` other than 0,
`embeddings_freq` other than 0, and `write_images=True` with a non-zero
`histogram_freq`. `tf.summary` calls in the user's own model code still need
TensorFlow.
"""

import itertools
import os
import time
import warnings

import keras
import numpy as np

from kdist.errors import InvalidArgumentError, UnsupportedError
from kdist.keras import tensorboard_redirect
from kdist.validation import invalid, is_integer

# `tf.summary.histogram`'s default bucket count (tensorboard's DEFAULT_BUCKET_COUNT).
HISTOGRAM_BUCKET_COUNT = 30
# Distinguishes event files opened in the same second by one process (tensorboardX
# names files by second and host only; TensorFlow adds the pid and a counter too).
_FILE_NUMBERS = itertools.count()
_TRAIN, _VALIDATION = "train", "validation"


class TensorBoard(keras.callbacks.TensorBoard):
    """Keras' `TensorBoard` callback for backends without TensorFlow: the same files, written by tensorboardX.

    On torch, once kdist is loaded, `keras.callbacks.TensorBoard(...)` builds
    this class whenever TensorFlow or the tensorboard package is missing or
    fails to import; with both working it stays Keras' own. A Keras instance
    built before kdist loaded becomes this class when a kdist model's `fit`
    or `evaluate` receives it (`kdist.keras.tensorboard_redirect`). Use this class by name to get it
    either way. Its run directories, tags, steps and values are those of
    Keras' callback (see the module docstring). Under
    `MultiWorkerMirroredStrategy` only the chief writes.

    Args:
        log_dir: directory for the `train` and `validation` runs.
        histogram_freq: write weight histograms every this many epochs (0: never).
        write_graph: write the model's JSON for TensorBoard's graph plugin
            (Functional and Sequential models, as Keras does).
        write_images: must stay False while `histogram_freq` is non-zero.
        write_steps_per_second: also write `batch_steps_per_second` and
            `epoch_steps_per_second`.
        update_freq: `"epoch"`, `"batch"` (same as 1) or a positive integer:
            write batch scalars every this many training batches.
        profile_batch: must be 0 (the torch backend has no Keras profiler).
        embeddings_freq: must be 0.
        embeddings_metadata: ignored while `embeddings_freq` is 0, as in Keras.

    Raises:
        kdist.errors.InvalidArgumentError: `update_freq` or `profile_batch` is
            not a value this callback accepts.
        kdist.errors.UnsupportedError: `embeddings_freq`, or `write_images`
            with histograms, was asked for; or tensorboardX, which writes the
            event files, cannot be imported.

    Example:

    ```python
    import kdist, keras
    strategy = kdist.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, epochs=3, callbacks=[keras.callbacks.TensorBoard("logs", histogram_freq=1)])
    # or explicitly: kdist.callbacks.TensorBoard("logs", histogram_freq=1)
    ```
    """

    def __init__(
        self,
        log_dir="logs",
        histogram_freq=0,
        write_graph=True,
        write_images=False,
        write_steps_per_second=False,
        update_freq="epoch",
        profile_batch=0,
        embeddings_freq=0,
        embeddings_metadata=None,
    ):
        if update_freq not in ("epoch", "batch") and not is_integer(update_freq, minimum=1):
            raise invalid("update_freq", update_freq, '"epoch", "batch" or a positive integer')
        # Keras' own test: any true value asks for profiling.
        if profile_batch:
            raise InvalidArgumentError(
                "profile_batch must be 0: kdist's TensorBoard (torch, no TensorFlow) cannot profile, "
                f"as Keras' cannot on torch. Received: profile_batch={profile_batch!r}. "
                "Use torch.profiler around fit() instead."
            )
        if embeddings_freq:
            raise UnsupportedError(
                "embeddings_freq must be 0: kdist's TensorBoard does not write TensorBoard projector "
                f"files. Received: embeddings_freq={embeddings_freq!r}. Install tensorflow and "
                "tensorboard to use Keras' own callback, or save the embedding weights yourself."
            )
        if write_images and histogram_freq:
            raise UnsupportedError(
                "write_images must be False when histogram_freq is set: kdist's TensorBoard does not "
                f"write weight images. Received: write_images={write_images!r}, "
                f"histogram_freq={histogram_freq!r}. Pass write_images=False, or install tensorflow "
                "and tensorboard to use Keras' own callback."
            )
        _require_tensorboardx()
        super().__init__(
            log_dir=log_dir,
            histogram_freq=histogram_freq,
            write_graph=write_graph,
            write_images=write_images,
            write_steps_per_second=write_steps_per_second,
            update_freq=update_freq,
            profile_batch=0,
            embeddings_freq=0,
            embeddings_metadata=embeddings_metadata,
        )
        self._event_writers = {}
        # Keras' stack of (default writer, step) pairs, each with its
        # `record_if(step % update_freq == 0)`; empty when update_freq is "epoch".
        self._default_writers = []
        self._train_batches = 0
        # Never reset, as in Keras: counts every evaluation batch this callback saw.
        self._test_batches = 0
        self._batch_start = 0.0
        self._epoch_start = 0.0
        self._epoch_start_iterations = 0.0

    # ----- writers ------------------------------------------------------------------
    def _writer(self, run):
        if run not in self._event_writers:
            # Imported at construction, not when kdist loads (tensorboardX imports protobuf).
            import tensorboardX

            suffix = f".{os.getpid()}.{next(_FILE_NUMBERS)}"
            self._event_writers[run] = tensorboardX.FileWriter(
                os.path.join(self.log_dir, run), filename_suffix=suffix
            )
        return self._event_writers[run]

    def _close_writers(self):
        for writer in self._event_writers.values():
            writer.close()

    def _recording(self):
        """Whether `tf.summary` would record now, under the innermost `record_if` Keras pushed."""
        if not self._default_writers:
            return True
        return self._default_writers[-1][1] % self.update_freq == 0

    def _push(self, run, step):
        self._writer(run)  # Keras creates the writer (and its event file) here, recording or not.
        if self.update_freq != "epoch":
            self._default_writers.append((run, step))

    def _pop(self):
        if self.update_freq != "epoch":
            self._default_writers.pop()

    def _scalar(self, run, tag, value, step):
        from tensorboardX.proto.summary_pb2 import Summary

        # float32, as tf.summary.scalar stores it; the tag as given (tensorboardX's helpers rewrite it).
        value = float(np.float32(keras.ops.convert_to_numpy(value)))
        self._writer(run).add_summary(Summary(value=[Summary.Value(tag=tag, simple_value=value)]), step)

    def _histogram(self, run, tag, values, step):
        from tensorboardX.proto.summary_pb2 import HistogramProto, Summary

        lefts, rights, counts = histogram_buckets(values)
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        # TensorBoard reads a bucket as (previous limit or min, own limit or max, count).
        proto = HistogramProto(
            min=float(lefts[0]) if len(lefts) else 0.0,
            max=float(rights[-1]) if len(rights) else 0.0,
            num=float(values.size),
            sum=float(values.sum()),
            sum_squares=float(np.square(values).sum()),
            bucket_limit=[float(edge) for edge in rights],
            bucket=[float(count) for count in counts],
        )
        self._writer(run).add_summary(Summary(value=[Summary.Value(tag=tag, histo=proto)]), step)

    def _model_json(self, run):
        from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboardX.proto.tensor_pb2 import TensorProto

        try:
            json_string = self.model.to_json()
        except Exception as exc:  # Keras' own policy: a model that cannot be serialized is skipped.
            warnings.warn(f"Model failed to serialize as JSON. Ignoring... {exc}")
            return
        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="graph_keras_model", content=b"1"))
        tensor = TensorProto(dtype="DT_STRING", string_val=[json_string.encode("utf-8")])
        self._writer(run).add_summary(Summary(value=[Summary.Value(tag="keras", tensor=tensor, metadata=metadata)]), 0)

    # ----- Keras' callback hooks, in Keras' order -----------------------------------
    def set_model(self, model):
        # Callback.set_model, not Keras' TensorBoard.set_model (which would write through tf.summary).
        keras.callbacks.Callback.set_model(self, model)
        # Keras starts new writers (new event files) for every fit/evaluate; the old ones are done.
        self._close_writers()
        self._event_writers = {}
        if self.write_graph:
            self._writer(_TRAIN)
            if model.__class__.__name__ in ("Functional", "Sequential") and self._recording():
                self._model_json(_TRAIN)

    def on_train_begin(self, logs=None):
        self._train_batches = 0
        self._epoch_start_iterations = 0.0
        self._push(_TRAIN, self._train_batches)

    def on_train_end(self, logs=None):
        self._pop()
        self._close_writers()

    def on_test_begin(self, logs=None):
        self._push(_VALIDATION, self._test_batches)

    def on_test_end(self, logs=None):
        optimizer = self.model.optimizer
        if optimizer and hasattr(optimizer, "iterations"):
            self._writer(_VALIDATION)
            if self._recording():
                step = int(keras.ops.convert_to_numpy(optimizer.iterations))
                for name, value in (logs or {}).items():
                    self._scalar(_VALIDATION, f"evaluation_{name}_vs_iterations", value, step)
            # Keras leaves this to the writer's own flush; evaluate() should leave readable files.
            self._writer(_VALIDATION).flush()
        self._pop()

    def on_train_batch_begin(self, batch, logs=None):
        self._train_batches += 1
        if self.update_freq != "epoch":
            self._pop()
            self._push(_TRAIN, self._train_batches)
        if self.write_steps_per_second:
            self._batch_start = time.time()

    def on_train_batch_end(self, batch, logs=None):
        # Keras writes batch scalars to the default writer, which exists only with a batch update_freq.
        if not self._default_writers or not self._recording():
            return
        run = self._default_writers[-1][0]
        if self.write_steps_per_second:
            self._scalar(run, "batch_steps_per_second", 1.0 / (time.time() - self._batch_start), self._train_batches)
        if isinstance(logs, dict):
            for name, value in logs.items():
                self._scalar(run, f"batch_{name}", value, self._train_batches)

    def on_test_batch_begin(self, batch, logs=None):
        self._test_batches += 1
        if self.update_freq != "epoch":
            self._pop()
            self._push(_VALIDATION, self._test_batches)

    def on_epoch_begin(self, epoch, logs=None):
        if self.write_steps_per_second:
            self._epoch_start_iterations = float(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            self._epoch_start = time.time()

    def on_epoch_end(self, epoch, logs=None):
        recording = self._recording()
        if logs and recording:
            self._log_epoch_metrics(epoch, logs)
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            if recording:
                self._log_weights(epoch)
            self._writer(_TRAIN).flush()

    # ----- epoch summaries ---------------------------------------------------------------
    def _log_epoch_metrics(self, epoch, logs):
        train_logs = {name: value for name, value in logs.items() if not name.startswith("val_")}
        validation_logs = {name[4:]: value for name, value in logs.items() if name.startswith("val_")}
        train_logs.update(learning_rates(self.model.optimizer))
        if self.write_steps_per_second:
            iterations = float(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            seconds = np.float32(time.time() - self._epoch_start)
            train_logs["steps_per_second"] = float(np.float32(iterations - self._epoch_start_iterations) / seconds)
        for name, value in train_logs.items():
            self._scalar(_TRAIN, f"epoch_{name}", value, epoch)
        for name, value in validation_logs.items():
            self._scalar(_VALIDATION, f"epoch_{name}", value, epoch)

    def _log_weights(self, epoch):
        for layer in self.model.layers:
            for weight in layer.weights:
                tag = f"{weight.path.replace(':', '_')}/histogram"
                self._histogram(_TRAIN, tag, keras.ops.convert_to_numpy(weight), epoch)


def learning_rates(optimizer):
    """`{"learning_rate": lr}` (or one `learning_rate_<name>` per inner optimizer), as Keras' callback logs them."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if hasattr(optimizer, "optimizers"):
        return {
            f"learning_rate_{inner.name}": float(keras.ops.convert_to_numpy(inner.learning_rate))
            for inner in optimizer.optimizers
        }
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return {"learning_rate": float(keras.ops.convert_to_numpy(optimizer.learning_rate))}
    return {}


def histogram_buckets(values, bucket_count=HISTOGRAM_BUCKET_COUNT):
    """`(left_edges, right_edges, counts)` of `values`, bucketed as `tf.summary.histogram` does.

    Equal-width buckets from the minimum to the maximum in float64 (the last
    edge is exactly the maximum, the maximum falls in the last bucket); one
    value repeated gives `bucket_count` zero-width buckets with everything in
    the last; no values gives `bucket_count` empty buckets at 0.
    """
    data = np.asarray(values, dtype=np.float64).reshape(-1)
    if data.size == 0:
        zeros = np.zeros(bucket_count)
        return zeros, zeros, zeros
    low, high = data.min(), data.max()
    if high == low:
        edges = np.full(bucket_count, high)
        counts = np.zeros(bucket_count)
        counts[-1] = data.size
        return edges, edges, counts
    width = (high - low) / bucket_count
    indices = np.minimum(np.floor((data - low) / width).astype(np.int64), bucket_count - 1)
    counts = np.bincount(indices, minlength=bucket_count).astype(np.float64)
    edges = np.linspace(low, high, bucket_count + 1)
    edges[-1] = high
    return edges[:-1], edges[1:], counts


def _require_tensorboardx():
    try:
        import tensorboardX  # noqa: F401
    except ImportError as error:
        raise UnsupportedError(
            "kdist's TensorBoard callback (used where TensorFlow summaries are unavailable) writes its "
            f"event files with tensorboardX, which cannot be imported. Received: {type(error).__name__}: "
            f"{error}. Install it with `pip install tensorboardX`, or install tensorflow and tensorboard "
            "to use Keras' own callback."
        ) from error


def install():
    """Makes `keras.callbacks.TensorBoard(...)` build this class where TensorFlow summaries are unavailable.

    Called once by `kdist.keras.hooks.install()` (torch backend). Idempotent.
    """
    tensorboard_redirect.install(TensorBoard)
