"""Every Keras internal kdist relies on, in one package.

No module outside `kdist.keras._compat` imports `keras.src` or reads or
writes a private attribute of a Keras object (`tests/keras/test_compat.py`
checks both). Each private name used here is listed in `PINNED_INTERNALS`
and checked by that test, so a Keras upgrade that moves one fails with a
message naming it instead of breaking training silently.

This module holds the trainer, variable and data internals; the others, by job:
`optimizers`, `callbacks` (`BackupAndRestore`), `layers` (`BatchNormalization`,
float8), `losses` (loss reductions), `scopes` (`StatelessScope` entries
converted once), `serialization` (no TensorFlow import when Keras serializes) and
`variable_writes` (where every variable write passes). Everything is re-exported here, so
callers write `_compat.<name>`.
"""

import functools

import keras
import torch
from keras.src.backend.common import global_state as _global_state
from keras.src.backend.torch import core as _torch_core_module
from keras.src.backend.torch import trainer as _torch_trainer_module
from keras.src.trainers import trainer as _trainer_module
from keras.src.trainers.data_adapters import array_data_adapter as _array_adapter_module
from keras.src.utils import python_utils as _python_utils_module

from kdist.keras._compat import callbacks as _callbacks
from kdist.keras._compat import layers as _layers
from kdist.keras._compat import losses as _losses
from kdist.keras._compat import optimizers as _optimizers
from kdist.keras._compat import scopes as _scopes
from kdist.keras._compat import serialization as _serialization
from kdist.keras._compat import variable_writes as _variable_writes
from kdist.keras._compat.serialization import serialize_without_importing_tensorflow  # noqa: F401
from kdist.keras._compat.callbacks import (  # noqa: F401
    BackupPaths,
    backup_metadata,
    backup_paths,
    patch_backup_save,
    set_backup_dir,
)
from kdist.keras._compat.layers import (  # noqa: F401
    batchnorm_local_moments,
    batchnorm_reduction_axes,
    in_stateless_scope,
    output_gradient_float8_state,
    set_batchnorm_moments,
)
from kdist.keras._compat.losses import (  # noqa: F401
    install_loss_reduction_divisor,
    install_loss_reduction_observer,
    loss_reduction_denominator,
)
from kdist.keras._compat.scopes import stateless_scope  # noqa: F401
from kdist.keras._compat.variable_writes import install_variable_write_hook  # noqa: F401
from kdist.keras._compat.tensorboard import redirect_construction as redirect_tensorboard_construction  # noqa: F401
from kdist.keras._compat.optimizers import (  # noqa: F401
    clip_gradients,
    gradient_accumulators,
    iterations_variable,
    learning_rate_variable,
    mark_optimizer_built,
    optimizer_step_count,
    optimizer_trainable_variables,
    uses_weight_decay,
)

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

_PINNED = {
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
    "keras.src.backend.torch.core.Variable._initialize": lambda: TorchVariable._initialize,
    "Variable._initialize_with_initializer": lambda: TorchVariable._initialize_with_initializer,
    "keras.src.backend.torch.core.get_device": lambda: _torch_core_module.get_device,
    "keras.src.backend.torch.core.to_torch_dtype": lambda: _torch_core_module.to_torch_dtype,
    "global_state name_scope_stack": lambda: _probe_name_scope_stack(),
    "Trainer._symbolic_build": lambda: Trainer._symbolic_build,
    "Layer._track_variables (torch)": lambda: keras.Sequential()._track_variables,
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
    "keras.src.utils.python_utils.pythonify_logs": lambda: _python_utils_module.pythonify_logs,
}


PINNED_INTERNALS = {**_PINNED, **_callbacks.PINNED, **_layers.PINNED, **_losses.PINNED, **_optimizers.PINNED,
                     **_scopes.PINNED, **_serialization.PINNED, **_variable_writes.PINNED}


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




def _probe_epoch_iterator():
    import numpy as np

    return TorchEpochIterator(x=np.zeros((4, 1)), y=np.zeros((4,)), batch_size=2)




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


def train_step_zeroes_gradients(model):
    """True when `model.train_step` is the torch backend's own, which calls `zero_grad()` before its backward."""
    return "train_step" not in vars(model) and type(model).train_step is TorchTrainer.train_step


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


# ----- process-wide hooks (installed once by kdist.keras.hooks) ---------------------
def install_epoch_iterator_hook(hook):
    """Makes every torch `EpochIterator` get its batches from `hook(epoch_iterator, make_iterable)`.

    `make_iterable()` returns what Keras' own `_get_iterator` would; the hook
    may act before calling it and wrap what it returns.
    """
    original = TorchEpochIterator._get_iterator

    @functools.wraps(original)
    def _get_iterator(self):
        return hook(self, lambda: original(self))

    TorchEpochIterator._get_iterator = _get_iterator


def install_variable_hook(hook):
    """Calls `hook(variable)` right after each torch Keras variable is initialised.

    `Variable._initialize` is the one point every variable passes through,
    whoever creates it (layer weights, optimizer slots, metric state, seeds,
    lazily built layers).
    """
    original = TorchVariable._initialize

    @functools.wraps(original)
    def _initialize(self, value):
        original(self, value)
        hook(self)

    TorchVariable._initialize = _initialize


def install_variable_initializer_hook(hook):
    """Lets `hook(variable, initializer)` supply a variable's first value before Keras computes it.

    `hook` returns a `torch.nn.Parameter` to use as the value (the
    initializer then never runs), or None to let Keras run it as usual.
    """
    original = TorchVariable._initialize_with_initializer

    @functools.wraps(original)
    def _initialize_with_initializer(self, initializer):
        value = hook(self, initializer)
        if value is None:
            return original(self, initializer)
        return self._initialize(value)

    TorchVariable._initialize_with_initializer = _initialize_with_initializer


def write_values(pairs):
    """Writes each `(variable, value)`: `variable.assign(value)` for a value already of its dtype and shape.

    Outside a `StatelessScope` Keras' `assign` converts the value (a no-op
    here), checks its shape and ends in `_direct_assign`, a `copy_` into the
    variable's tensor; kdist's reconciled state makes that copy directly.
    Inside one, the scope records the writes, as Keras' `assign` does there.
    """
    if getattr(_global_state.GLOBAL_STATE_TRACKER, "stateless_scope", None) is not None:
        for variable, value in pairs:
            variable.assign(value)
        return
    with torch.no_grad():
        for variable, value in pairs:
            variable._value.copy_(value)


def replace_torch_tensor(variable, parameter):
    """Makes `parameter` (a `torch.nn.Parameter`) the tensor `variable` holds."""
    variable._value = parameter


def torch_device():
    """The device Keras puts new torch tensors on."""
    return _torch_core_module.get_device()


def torch_dtype_of(variable):
    """A Keras variable's dtype as a `torch.dtype`."""
    return _torch_core_module.to_torch_dtype(variable.dtype)


def track_torch_parameters(model):
    """Registers every variable of `model` as its torch parameters again, as `fit` does before its first step.

    Keras on torch records a layer's parameters when it is built; a model whose
    class keeps its own `__setattr__` (keras-hub's backbones and tasks) is built
    during its `__init__`, before its attributes are tracked, so that record is
    an unregistered, empty one until `Trainer._symbolic_build` (run by `fit`,
    `train_on_batch`, `evaluate`) records them again. A step function called
    without them would never clear the parameters' gradients (`zero_grad` finds
    none), and each step's gradient would add to the last ones.
    """
    if keras.backend.backend() == "torch":
        model._track_variables()
