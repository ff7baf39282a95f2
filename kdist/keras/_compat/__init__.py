"""Every Keras internal kdist relies on, in one place.

Each private name used here is listed in `PINNED_INTERNALS` and checked by
`tests/keras/test_compat.py`, so a Keras upgrade that moves one fails with a
message naming it instead of breaking training silently.
"""

import collections

import keras
import numpy
from keras.src.backend.common import global_state as _global_state
from keras.src.backend.common import stateless_scope as _stateless_scope_module
from keras.src.backend.torch import core as _torch_core_module
from keras.src.backend.torch import trainer as _torch_trainer_module
from keras.src.losses import loss as _loss_module
from keras.src.trainers import trainer as _trainer_module
from keras.src.trainers.data_adapters import array_data_adapter as _array_adapter_module
from keras.src.utils import python_utils as _python_utils_module

Trainer = _trainer_module.Trainer
TorchEpochIterator = _torch_trainer_module.TorchEpochIterator
# Defines the torch backend's own fit/evaluate/predict (over Trainer's).
TorchTrainer = _torch_trainer_module.TorchTrainer
TorchVariable = _torch_core_module.Variable

# Keras releases up to 3.15 reject `steps_per_execution > 1` in the torch
# trainer; later releases loop over the list of batches a step receives.
_KERAS_VERSION = tuple(int(part) for part in keras.version().split(".")[:2] if part.isdigit())
TORCH_TRAINER_REJECTS_STEPS_PER_EXECUTION = _KERAS_VERSION <= (3, 15)
# Keras 3.16 wraps a torch model in DistributedDataParallel inside its
# make_*_function whenever torch.distributed is initialized.
TORCH_TRAINER_WRAPS_DDP = hasattr(_torch_trainer_module.TorchTrainer, "_initialize_ddp")

PINNED_INTERNALS = {
    "keras.src.trainers.trainer.Trainer": lambda: _trainer_module.Trainer,
    "Trainer.compile": lambda: Trainer.compile,
    "Trainer.__init__": lambda: Trainer.__init__,
    "Layer._flatten_layers": lambda: keras.layers.Layer._flatten_layers,
    "Layer._seed_generators": lambda: keras.layers.Dropout(0.5)._seed_generators,
    "Variable._value": lambda: keras.Variable(1.0)._value,
    "Model.train_function": lambda: keras.Sequential().train_function,
    "Model.test_function": lambda: keras.Sequential().test_function,
    "Model.predict_function": lambda: keras.Sequential().predict_function,
    "Trainer._loss_tracker": lambda: keras.Sequential()._loss_tracker,
    "keras.src.backend.torch.trainer.TorchEpochIterator._get_iterator": lambda: TorchEpochIterator._get_iterator,
    "EpochIterator._num_batches": lambda: _probe_epoch_iterator()._num_batches,
    "EpochIterator.data_adapter": lambda: _probe_epoch_iterator().data_adapter,
    "ArrayDataAdapter": lambda: _array_adapter_module.ArrayDataAdapter,
    "BackupAndRestore._weights_path": lambda: _probe_backup()._weights_path,
    "BackupAndRestore._training_metadata_path": lambda: _probe_backup()._training_metadata_path,
    "BackupAndRestore._prev_weights_path": lambda: _probe_backup()._prev_weights_path,
    "BackupAndRestore._prev_training_metadata_path": lambda: _probe_backup()._prev_training_metadata_path,
    "BackupAndRestore._current_epoch": lambda: _probe_backup()._current_epoch,
    "BackupAndRestore._last_batch_seen": lambda: _probe_backup()._last_batch_seen,
    "BackupAndRestore._save_model": lambda: _probe_backup()._save_model,
    "keras.src.backend.torch.core.Variable._initialize": lambda: TorchVariable._initialize,
    "global_state name_scope_stack": lambda: _probe_name_scope_stack(),
    "BaseOptimizer._clip_gradients": lambda: keras.optimizers.SGD()._clip_gradients,
    "BaseOptimizer._trainable_variables": lambda: keras.optimizers.SGD()._trainable_variables,
    "BaseOptimizer._iterations": lambda: keras.optimizers.SGD()._iterations,
    "BaseOptimizer._accumulated_gradients": lambda: _probe_accumulating_optimizer()._accumulated_gradients,
    "BaseOptimizer._get_variable_index": lambda: _probe_accumulating_optimizer()._get_variable_index,
    "Trainer._symbolic_build": lambda: Trainer._symbolic_build,
    "Trainer._initial_epoch": lambda: keras.Sequential()._initial_epoch,
    "Trainer._flatten_metrics_in_order": lambda: Trainer._flatten_metrics_in_order,
    "keras.src.backend.torch.trainer.TorchTrainer.fit": lambda: TorchTrainer.fit,
    "ArrayDataAdapter._epoch (Keras >= 3.16)": lambda: (
        _array_adapter_module.ArrayDataAdapter(__import__("numpy").zeros((2, 1)), batch_size=1)._epoch
        if _KERAS_VERSION >= (3, 16)
        else True
    ),
    "TorchTrainer._initialize_ddp (Keras >= 3.16)": lambda: (
        _torch_trainer_module.TorchTrainer._initialize_ddp if _KERAS_VERSION >= (3, 16) else True
    ),
    "BatchNormalization._moments": lambda: keras.layers.BatchNormalization._moments,
    "BatchNormalization._reduction_axes": lambda: _probe_batchnorm()._reduction_axes,
    "keras.src.backend.common.stateless_scope.in_stateless_scope": lambda: _stateless_scope_module.in_stateless_scope,
    "keras.src.losses.loss.reduce_weighted_values": lambda: _loss_module.reduce_weighted_values,
    "keras.src.losses.loss.squeeze_or_expand_to_same_rank": lambda: _loss_module.squeeze_or_expand_to_same_rank,
    "keras.src.losses.loss.standardize_reduction": lambda: _loss_module.standardize_reduction,
    "Dense.outputs_grad_amax_history (float8)": lambda: _probe_float8_dense().outputs_grad_amax_history,
    "keras.src.utils.python_utils.pythonify_logs": lambda: _python_utils_module.pythonify_logs,
}


def _probe_name_scope_stack():
    with keras.name_scope("kdist_probe"):
        stack = _global_state.get_global_attribute("name_scope_stack")
        if not stack or stack[-1].name != "kdist_probe" or not hasattr(stack[-1], "caller"):
            raise AttributeError("name_scope_stack no longer records name scopes with their caller")
    return stack


# ----- variable birth ----------------------------------------------------------------
def variable_owner():
    """The object whose `name_scope` encloses a variable being created now (None at top level).

    Keras opens a scope with `caller=self` around every variable an optimizer,
    metric, seed generator or layer makes.
    """
    stack = _global_state.get_global_attribute("name_scope_stack") or ()
    return stack[-1].caller if stack else None


def is_model_variable(variable, owner):
    """False for variables Keras makes for an optimizer, a metric or a random seed."""
    if getattr(variable, "synchronization", None) == "on_read":
        return False
    return not isinstance(
        owner, (keras.optimizers.Optimizer, keras.metrics.Metric, keras.random.SeedGenerator)
    )


def sublayers(model):
    """Every layer nested in `model` (not `model` itself), depth first."""
    return model._flatten_layers(include_self=False)


def optimizer_trainable_variables(optimizer):
    """The variables a built optimizer applies to when `apply` gets no variables."""
    return optimizer._trainable_variables


def optimizer_step_count(optimizer):
    """How many times `apply` ran (`optimizer.iterations` counts applied updates only when accumulating)."""
    return int(optimizer._iterations)


def gradient_accumulators(optimizer, variables):
    """The optimizer's gradient accumulators of `variables` (it accumulates; it is built)."""
    return [optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables]


def _probe_accumulating_optimizer():
    optimizer = keras.optimizers.SGD(gradient_accumulation_steps=2)
    optimizer.build([keras.Variable(1.0)])
    return optimizer


def clip_gradients(optimizer, gradients):
    """The optimizer's own `clipnorm`/`clipvalue`/`global_clipnorm` applied to `gradients`."""
    return optimizer._clip_gradients(gradients)


def _probe_epoch_iterator():
    import numpy as np

    return TorchEpochIterator(x=np.zeros((4, 1)), y=np.zeros((4,)), batch_size=2)


def _probe_backup():
    import tempfile

    return keras.callbacks.BackupAndRestore(tempfile.gettempdir() + "/kdist-probe")


# ----- epoch iterators -----------------------------------------------------------
def epoch_iterator_num_batches(epoch_iterator):
    """Batches per epoch as the iterator knows it (None when unknown yet)."""
    return epoch_iterator._num_batches


def set_epoch_iterator_num_batches(epoch_iterator, num_batches):
    epoch_iterator._num_batches = num_batches


def advance_shuffle_epoch(epoch_iterator, epochs):
    """Moves an array adapter's shuffle seed on by `epochs` (Keras >= 3.16 seeds by its epoch count)."""
    adapter = epoch_iterator.data_adapter
    if isinstance(adapter, _array_adapter_module.ArrayDataAdapter) and hasattr(adapter, "_epoch"):
        adapter._epoch += epochs


def is_array_adapter(epoch_iterator):
    """True when the iterator slices in-memory arrays (same length on every rank)."""
    return isinstance(epoch_iterator.data_adapter, _array_adapter_module.ArrayDataAdapter)


# ----- BackupAndRestore -------------------------------------------------------------
BackupPaths = collections.namedtuple(
    "BackupPaths", "backup_dir weights metadata previous_weights previous_metadata"
)


def backup_paths(callback):
    """Where a `BackupAndRestore` keeps its files."""
    return BackupPaths(
        callback.backup_dir,
        callback._weights_path,
        callback._training_metadata_path,
        callback._prev_weights_path,
        callback._prev_training_metadata_path,
    )


def backup_metadata(callback):
    """The JSON document Keras' `BackupAndRestore` writes beside the weights."""
    return {"epoch": callback._current_epoch, "batch": callback._last_batch_seen}


def torch_tensor_of(variable):
    """The torch Parameter/tensor that stores a Keras variable's value."""
    return variable._value


def seed_generator_states(model):
    """State variables of every `SeedGenerator` owned by the model's layers, in layer order."""
    states = []
    seen = set()
    for layer in model._flatten_layers(include_self=True):
        for generator in getattr(layer, "_seed_generators", ()):
            if id(generator.state) not in seen:
                seen.add(id(generator.state))
                states.append(generator.state)
    return states


def loss_tracker(model):
    """The `Mean` metric that `train_step`/`test_step` feed the batch loss into (None before compile)."""
    return getattr(model, "_loss_tracker", None)


def keep_out_of_upstream_ddp(model):
    """Makes Keras' own `DistributedDataParallel` wrap a no-op for `model` (Keras >= 3.16).

    kdist combines gradients itself; a DDP wrap would all-reduce them a second
    time during backward (and wrap a one-process job's model for nothing).
    """
    if TORCH_TRAINER_WRAPS_DDP:
        object.__setattr__(model, "_initialize_ddp", lambda: None)


def local_metrics_result(model):
    """`Trainer.get_metrics_result` as Keras 3.15 computes it: no reduction across processes.

    Later Keras releases all-reduce metric variables inside
    `get_metrics_result` when `torch.distributed` is initialised; kdist has
    already combined them, so reducing again would count every rank twice.
    """
    results = {}
    for metric in model.metrics:
        result = metric.result()
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results


def symbolic_build(model, data_batch):
    """Builds the model's compiled loss and metrics from a batch's shapes (no computation)."""
    model._symbolic_build(data_batch=data_batch)


def take_initial_epoch(model, initial_epoch):
    """The epoch `fit` starts at: the one `BackupAndRestore` restored, else `initial_epoch`."""
    return model._initial_epoch or initial_epoch


def flatten_metrics_in_order(model, logs):
    """`evaluate`'s non-dict return value: the logs as a list in the model's metric order."""
    return model._flatten_metrics_in_order(logs)


# ----- BatchNormalization (kdist.keras.sync_batchnorm) --------------------------------
def _probe_batchnorm():
    layer = keras.layers.BatchNormalization()
    layer.build((None, 3))
    if list(layer._reduction_axes) != [0]:
        raise AttributeError("BatchNormalization._reduction_axes no longer lists the reduced axes")
    return layer


def batchnorm_reduction_axes(layer):
    """The axes a built `BatchNormalization` reduces over for its batch statistics."""
    return layer._reduction_axes


def batchnorm_local_moments(layer, inputs, mask):
    """`(mean, variance)` of `inputs` exactly as Keras' own unsynchronized `BatchNormalization` computes them."""
    if mask is None:
        return keras.ops.moments(inputs, axes=layer._reduction_axes, synchronized=False)
    # Keras' masked branch never reads `layer.synchronized`.
    return keras.layers.BatchNormalization._moments(layer, inputs, mask)


def in_stateless_scope():
    """True inside a `keras.StatelessScope` (variable writes are recorded there, not made)."""
    return _stateless_scope_module.in_stateless_scope()


def set_batchnorm_moments(layer, moments):
    """Makes `layer.call` compute its training statistics with `moments(inputs, mask)`.

    Installed on the instance only: every other `BatchNormalization` keeps Keras' code.
    """
    object.__setattr__(layer, "_moments", moments)


# ----- loss reduction (the divisor of a "sum_over_batch_size" loss) -----------------
# Every `keras.losses.Loss.__call__` ends in `reduce_weighted_values`, looked up in
# its module at call time; it folds the mask into the sample weights and divides
# the weighted sum by the element count (or the weight sum). Wrapped once.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def install_loss_reduction_observer(observer):
    """Calls `observer(values, sample_weight, mask, reduction, dtype)` at every Keras loss reduction.

    Installed once per process (later calls with the same observer do nothing);
    the observer itself must return at once when it has nothing to record.
    """
    current = _loss_module.reduce_weighted_values
    if getattr(current, "_kdist_observer", None) is observer:
        return
    original = getattr(current, "_kdist_original", current)

    def reduce_weighted_values(
        values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None
    ):
        observer(values, sample_weight, mask, reduction, dtype)
        return original(values, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype)

    reduce_weighted_values._kdist_observer = observer
    reduce_weighted_values._kdist_original = original
    _loss_module.reduce_weighted_values = reduce_weighted_values


def loss_reduction_denominator(values, sample_weight, mask, reduction, dtype):
    """What a Keras loss reduction divides the weighted sum by, mirroring `reduce_weighted_values`.

    Returns:
        `(denominator, counts_elements)`: `denominator` is a 0-d float64 tensor
        (still on its device: no host sync), `counts_elements` says it is the
        plain element count (no mask, no sample-weight sum), which grows with
        the batch size. `(None, False)` when the reduction divides by nothing
        (`"sum"`, `"none"`, a scalar or empty value).
    """
    reduction = _loss_module.standardize_reduction(reduction)
    if reduction not in _MEAN_REDUCTIONS + ("mean_with_sample_weight",):
        return None, False
    values = keras.ops.convert_to_tensor(values, dtype=dtype)
    weights = None
    if sample_weight is not None:
        weights = keras.ops.cast(keras.ops.convert_to_tensor(sample_weight, dtype=dtype), values.dtype)
    if mask is not None and (weights is not None or reduction == "mean_with_sample_weight"):
        # As `apply_mask` for this reduction: the mask multiplies the weights.
        mask_weight = keras.ops.cast(mask, values.dtype)
        if weights is None:
            weights = mask_weight
        else:
            mask_weight, weights = _loss_module.squeeze_or_expand_to_same_rank(mask_weight, weights)
            weights = weights * mask_weight
    shape = tuple(values.shape)
    if weights is not None:
        values, weights = _loss_module.squeeze_or_expand_to_same_rank(values, weights)
        shape = tuple(numpy.broadcast_shapes(tuple(values.shape), tuple(weights.shape)))
    if shape in ((), (0,)):
        return None, False
    count = 1
    for dim in shape:
        count *= int(dim)
    if reduction == "mean_with_sample_weight" and weights is not None:
        return keras.ops.cast(keras.ops.sum(weights), "float64"), False
    if mask is not None and reduction in _MEAN_REDUCTIONS:
        # `apply_mask` scales valid entries by total/valid: the divisor is the valid count.
        valid = keras.ops.sum(keras.ops.cast(keras.ops.cast(mask, "bool"), "float64"))
        total = 1
        for dim in mask.shape:
            total *= int(dim)
        return valid * (count / total), False
    return keras.ops.convert_to_tensor(float(count), dtype="float64"), True


# ----- float8 training state -------------------------------------------------------
# A float8-quantized layer keeps its scales and amax histories as trainable
# variables with `overwrite_with_gradient=True`: the "gradient" is the new value.
def _probe_float8_dense():
    layer = keras.layers.Dense(2)
    layer.build((None, 2))
    layer.quantize("float8")
    if not layer.outputs_grad_scale.overwrite_with_gradient:
        raise AttributeError("float8 scales are no longer overwritten with their gradient")
    return layer


def output_gradient_float8_state(model):
    """`(scale, amax history)` of the output gradients of every float8 layer in the model.

    Unlike the inputs' and the kernel's, they follow the size of the gradient
    reaching the layer's output, which depends on how the loss was scaled.
    """
    pairs = []
    for layer in model._flatten_layers(include_self=True):
        if getattr(layer, "quantization_mode", None) != "float8":
            continue
        scale = getattr(layer, "outputs_grad_scale", None)
        history = getattr(layer, "outputs_grad_amax_history", None)
        if scale is not None and history is not None:
            pairs.append((scale, history))
    return pairs


# ----- logs --------------------------------------------------------------------------
def flatten_logs(logs):
    """Nested step logs flattened as Keras' `pythonify_logs` does, values left as they are.

    Keys in sorted order, a nested dict's keys merged in its place (a later
    key of the same name wins); callbacks and History see Keras' flattening.
    """
    flat = {}
    for key, value in sorted(logs.items()):
        if isinstance(value, dict):
            flat.update(flatten_logs(value))
        else:
            flat[key] = value
    return flat
