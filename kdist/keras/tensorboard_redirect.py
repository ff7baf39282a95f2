"""Where `keras.callbacks.TensorBoard` becomes kdist's tensorboardX-backed class.

Keras' callback writes through `tf.summary`; where TensorFlow summaries are
unavailable (TensorFlow or the tensorboard package missing, or failing to
import), kdist substitutes `kdist.keras.tensorboard.TensorBoard`, which
writes the same files:

- at construction, once kdist's hooks are installed (`install`): building
  exactly Keras' class builds kdist's (`_compat.tensorboard.redirect_construction`);
- at a kdist model's `fit`/`evaluate`/`predict` (`adopt_keras_callbacks`, called
  by `hooks.py` before any adapter routes the call): an instance of exactly Keras' class built
  before the hooks were installed (a callback list written above the first
  `kdist.<name>` use) is turned into kdist's class in place, the same object.

Whether TensorFlow summaries work is learnt by importing TensorFlow and
tensorboard, once per process, and only when a Keras `TensorBoard` is about to
be built or used: then Keras itself would import them. A torch-only program
that uses no TensorBoard never imports TensorFlow.
"""

import functools
import importlib
import importlib.util
import inspect

from kdist.keras._compat import tensorboard as keras_tensorboard

_SUMMARY_MODULES = ("tensorflow", "tensorboard")
# kdist's class (`kdist.keras.tensorboard.TensorBoard`), once `install` ran;
# passed in, because that module imports this one.
_replacement = None


def tensorflow_summaries_installed():
    """True when TensorFlow and the tensorboard package are installed (found, not imported).

    Cheap: nothing is imported. A package that is installed but fails to
    import counts as installed here; `tensorflow_summaries_available` tells.
    """
    for name in _SUMMARY_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                return False
        except (ImportError, ValueError):  # ValueError: marked missing (sys.modules[name] is None).
            return False
    return True


@functools.cache
def tensorflow_summaries_available():
    """True when TensorFlow and tensorboard import, so Keras' own `TensorBoard` callback works.

    Imports them (seconds, once per process; the answer is cached). An
    installed TensorFlow whose import raises anything counts as unavailable,
    as it would fail Keras' callback at its first write.
    """
    if not tensorflow_summaries_installed():
        return False
    for name in _SUMMARY_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # A broken install raises anything (ImportError, AttributeError, ...).
            return False
    return True


def adopt_keras_callbacks(method, args, kwargs):
    """Turns each instance of exactly Keras' `TensorBoard` among a call's callbacks into kdist's, in place.

    Only where TensorFlow summaries are unavailable; subclasses (the user's
    own, kdist's) and every other callback are left alone. The callbacks
    argument is found by name or by its position in `method`'s signature;
    the call's arguments are not changed (the same objects change class).

    Args:
        method: the unbound Keras method about to run, called as
            `method(model, *args, **kwargs)`.
        args, kwargs: the call's arguments after the model.

    Raises:
        kdist.errors.InvalidArgumentError, kdist.errors.UnsupportedError:
            an instance's arguments are ones kdist's class refuses (see
            `kdist.callbacks.TensorBoard`), or tensorboardX is missing.
    """
    callbacks = kwargs.get("callbacks")
    if callbacks is None:
        position = _callbacks_position(method)
        if position is None or position >= len(args):
            return
        callbacks = args[position]
    if not isinstance(callbacks, (list, tuple)):
        return
    keras_instances = [callback for callback in callbacks if type(callback) is keras_tensorboard.KerasTensorBoard]
    if _replacement is not None and keras_instances and not tensorflow_summaries_available():
        for callback in keras_instances:
            keras_tensorboard.rebuild_in_place(callback, _replacement)


def _callbacks_position(method):
    """Index of `callbacks` among the positional arguments after the model, or None."""
    try:
        parameters = list(inspect.signature(method).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for index, parameter in enumerate(parameters):
        if parameter.kind not in positional:
            return None
        if parameter.name == "callbacks":
            return index
    return None


def install(replacement):
    """Makes Keras' `TensorBoard` become `replacement` where TensorFlow summaries are unavailable.

    At construction from now on, and at `adopt_keras_callbacks` for instances
    built before. Called once by `kdist.keras.tensorboard.install()` (torch
    backend, from `kdist.keras.hooks.install()`). Idempotent.

    Args:
        replacement: `kdist.keras.tensorboard.TensorBoard`.
    """
    global _replacement
    _replacement = replacement
    keras_tensorboard.redirect_construction(replacement, lambda: not tensorflow_summaries_available())
