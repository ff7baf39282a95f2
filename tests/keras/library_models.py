"""Models built the way model libraries build them, for the construction-order tests.

keras-hub's `Backbone` and `Task` classes keep their own `__setattr__`: until
the model is initialised, attributes bypass Keras' tracking (on torch,
`torch.nn.Module.__setattr__` too), so Keras' `_layers` does not exist while
`Trainer.__init__` runs. A task also sets its backbone before calling
`Model.__init__`. These builders do the same without keras-hub, so the tests
run on every Keras version kdist supports. Both classes are registered
serializables with a config, as keras-hub's are: coordinator workers rebuild
them from it.
"""

import keras

import kdist  # noqa: F401  (sets KERAS_BACKEND before keras is imported)


class _UntrackedUntilInitialized:
    """keras-hub's `__setattr__`: plain attributes until `_initialized` is set."""

    def __setattr__(self, name, value):
        if not hasattr(self, "_initialized"):
            return object.__setattr__(self, name, value)
        return super().__setattr__(name, value)


@keras.saving.register_keras_serializable(package="kdist_tests")
class LibraryStyleBackbone(_UntrackedUntilInitialized, keras.Model):
    """A functional backbone with keras-hub's `Backbone.__setattr__`."""

    def __init__(self, features=12, hidden=16, batchnorm=None, **kwargs):
        inputs = keras.Input((features,))
        x = keras.layers.Dense(hidden, activation="relu")(inputs)
        if batchnorm is not None:  # "plain" or "synchronized" (the latter only in a kdist scope on torch)
            x = keras.layers.BatchNormalization(synchronized=batchnorm == "synchronized")(x)
        outputs = keras.layers.Dense(hidden, activation="relu")(x)
        super().__init__(inputs, outputs, **kwargs)
        self.features, self.hidden, self.batchnorm = features, hidden, batchnorm
        self._initialized = True

    def get_config(self):
        return {"features": self.features, "hidden": self.hidden, "batchnorm": self.batchnorm,
                "name": self.name, "trainable": self.trainable}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@keras.saving.register_keras_serializable(package="kdist_tests")
class LibraryStyleClassifier(_UntrackedUntilInitialized, keras.Model):
    """A task that stores its backbone before `Model.__init__`, as keras-hub's tasks do."""

    def __init__(self, backbone, num_classes=3, **kwargs):
        self.backbone = backbone
        self.num_classes = num_classes
        self.head = keras.layers.Dense(num_classes, name="logits")
        inputs = backbone.input
        outputs = self.head(backbone(inputs))
        super().__init__(inputs, outputs, **kwargs)
        self._initialized = True

    def get_config(self):
        return {"backbone": keras.saving.serialize_keras_object(self.backbone), "num_classes": self.num_classes,
                "name": self.name, "trainable": self.trainable}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)


def classifier(features=12, num_classes=3, batchnorm=None):
    """A `LibraryStyleClassifier` on a `LibraryStyleBackbone` (build it inside the scope under test)."""
    return LibraryStyleClassifier(LibraryStyleBackbone(features, batchnorm=batchnorm), num_classes)
