"""Every Keras internal kdist relies on, in one place.

Each private name used here is listed in `PINNED_INTERNALS` and checked by
`tests/keras/test_compat.py`, so a Keras upgrade that moves one fails with a
message naming it instead of breaking training silently.
"""

import keras
from keras.src.trainers import trainer as _trainer_module

Trainer = _trainer_module.Trainer

# Keras releases up to 3.15 reject `steps_per_execution > 1` in the torch
# trainer; later releases loop over the list of batches a step receives.
_KERAS_VERSION = tuple(int(part) for part in keras.version().split(".")[:2] if part.isdigit())
TORCH_TRAINER_REJECTS_STEPS_PER_EXECUTION = _KERAS_VERSION <= (3, 15)

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
}


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
