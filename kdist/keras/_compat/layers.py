"""Keras layer internals: `BatchNormalization`'s moments (`kdist.keras.sync_batchnorm`), float8 state,
and the torch `BatchNorm` modules a `TorchModuleWrapper` holds."""

import keras
from keras.src.backend.common import global_state as _global_state_module
from keras.src.backend.common import stateless_scope as _stateless_scope_module

PINNED = {
    "BatchNormalization._moments": lambda: keras.layers.BatchNormalization._moments,
    "BatchNormalization._reduction_axes": lambda: _probe_batchnorm()._reduction_axes,
    "keras.src.backend.common.stateless_scope.in_stateless_scope": lambda: _stateless_scope_module.in_stateless_scope,
    "keras.src.backend.common.global_state.GLOBAL_STATE_TRACKER": lambda: _global_state_module.GLOBAL_STATE_TRACKER,
    "Dense.outputs_grad_amax_history (float8)": lambda: _probe_float8_dense().outputs_grad_amax_history,
    "TorchModuleWrapper.module (torch backend)": lambda: _probe_torch_module_wrapper().module,
}


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
    """True inside a `keras.StatelessScope` (variable writes are recorded there, not made).

    Asked for every torch call of a parameter-server step
    (`kdist.keras.parameter_server.embeddings`): Keras' own
    `in_stateless_scope` reads this same thread-local attribute, through two
    more calls.
    """
    return getattr(_global_state_module.GLOBAL_STATE_TRACKER, "stateless_scope", None) is not None


def set_batchnorm_moments(layer, moments):
    """Makes `layer.call` compute its training statistics with `moments(inputs, mask)`.

    Installed on the instance only: every other `BatchNormalization` keeps Keras' code.
    """
    object.__setattr__(layer, "_moments", moments)


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


# ----- torch modules inside TorchModuleWrapper --------------------------------------
def _probe_torch_module_wrapper():
    import torch

    module = torch.nn.BatchNorm1d(2)
    wrapper = keras.layers.TorchModuleWrapper(module)
    if wrapper.module is not module:
        raise AttributeError("TorchModuleWrapper.module no longer holds the wrapped torch module")
    return wrapper


def torch_wrapped_modules(model):
    """`(name, module)` of the torch module each `TorchModuleWrapper` layer of the model holds.

    `name` is the wrapper layer's name. Empty off the torch backend.
    """
    if keras.backend.backend() != "torch":
        return []
    return [
        (layer.name, layer.module)
        for layer in model._flatten_layers(include_self=True)
        if isinstance(layer, keras.layers.TorchModuleWrapper)
    ]


def torch_batchnorm_modules(model):
    """`(name, module)` of every torch BatchNorm module inside the model's `TorchModuleWrapper` layers.

    `name` is `"<wrapper layer name>/<module path>"`. BatchNorm here is every
    `torch.nn` batch normalisation (`BatchNorm1d/2d/3d`, their lazy forms,
    `SyncBatchNorm`): torch refuses to train them on one value per channel.
    Empty off the torch backend.
    """
    import torch

    found = []
    for wrapper_name, root in torch_wrapped_modules(model):
        for path, module in root.named_modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                found.append((f"{wrapper_name}/{path}" if path else wrapper_name, module))
    return found
