"""Keras' `TensorBoard` class: the one place kdist changes how it is constructed.

`keras.callbacks.TensorBoard` writes through `tf.summary`, so on torch it needs
TensorFlow and the tensorboard package. Where they are missing, kdist makes the
class build its own writer-backed subclass instead (`redirect_construction`),
so a user's unchanged `keras.callbacks.TensorBoard(log_dir)` works whichever
way the user imported the name.
"""

import keras

KerasTensorBoard = keras.callbacks.TensorBoard


def redirect_construction(replacement, should_redirect):
    """Makes `keras.callbacks.TensorBoard(...)` build a `replacement` while `should_redirect()` is true.

    Only the exact Keras class is redirected: subclasses (the user's, and
    `replacement`, which must subclass Keras' class so `isinstance` checks
    and Keras' own `__init__` still apply) are built as they are. Python
    then runs `replacement.__init__` on the returned instance, because it is
    an instance of the class that was called. Patching `__new__` rather than
    rebinding `keras.callbacks.TensorBoard` also covers programs that ran
    `from keras.callbacks import TensorBoard` before kdist loaded.

    Args:
        replacement: a subclass of `keras.callbacks.TensorBoard`.
        should_redirect: called at each construction; True to build `replacement`.
    """
    if not issubclass(replacement, KerasTensorBoard):
        raise TypeError(f"{replacement!r} must subclass keras.callbacks.TensorBoard")

    def __new__(cls, *args, **kwargs):
        if cls is KerasTensorBoard and should_redirect():
            cls = replacement
        # Keras' class (and its Callback base) define no __new__ of their own.
        return object.__new__(cls)

    KerasTensorBoard.__new__ = staticmethod(__new__)
