"""Keras optimizer internals: the variables `apply` defaults to, step counts, accumulators, clipping."""

import keras
from keras.src.utils import tracking as _tracking

PINNED = {
    "BaseOptimizer._clip_gradients": lambda: keras.optimizers.SGD()._clip_gradients,
    "BaseOptimizer._trainable_variables": lambda: keras.optimizers.SGD()._trainable_variables,
    "BaseOptimizer._iterations": lambda: keras.optimizers.SGD()._iterations,
    "BaseOptimizer._learning_rate": lambda: keras.optimizers.SGD()._learning_rate,
    "BaseOptimizer._accumulated_gradients": lambda: _probe_accumulating_optimizer()._accumulated_gradients,
    "BaseOptimizer._get_variable_index": lambda: _probe_accumulating_optimizer()._get_variable_index,
    "BaseOptimizer._use_weight_decay": lambda: keras.optimizers.AdamW()._use_weight_decay,
    "BaseOptimizer._trainable_variables_indices": lambda: keras.optimizers.SGD()._trainable_variables_indices,
    "BaseOptimizer._var_key": lambda: keras.optimizers.SGD()._var_key,
}


def optimizer_trainable_variables(optimizer):
    """The variables a built optimizer applies to when `apply` gets no variables."""
    return optimizer._trainable_variables


def iterations_variable(optimizer):
    """The variable behind `optimizer.iterations` (which is computed from it when accumulating)."""
    return optimizer._iterations


def learning_rate_variable(optimizer):
    """The variable holding the optimizer's learning rate, or None (a `LearningRateSchedule`, a callable)."""
    value = optimizer._learning_rate
    return value if isinstance(value, keras.Variable) else None


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


def uses_weight_decay(optimizer, variable):
    """Whether the optimizer decays `variable` (not excluded by `exclude_from_weight_decay`)."""
    return optimizer._use_weight_decay(variable)


def mark_optimizer_built(optimizer, variables):
    """What `BaseOptimizer.build` records of `variables`, without creating any slot.

    For an optimizer whose slots live elsewhere (a rank's share of them, see
    `kdist.keras.replica.sharded_optimizer`): Keras' `apply` bookkeeping (the
    known variables, their indices) is in place and `built` is True.
    """
    # As Keras' own `build`: the model's variables are not tracked as the optimizer's.
    with _tracking.DotNotTrackScope():
        for index, variable in enumerate(variables):
            optimizer._trainable_variables_indices[optimizer._var_key(variable)] = index
        optimizer._trainable_variables = list(variables)
        optimizer.built = True
