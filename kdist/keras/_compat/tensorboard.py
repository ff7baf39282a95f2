"""Keras' `TensorBoard` class: the one place kdist changes how it is constructed.

`keras.callbacks.TensorBoard` writes through `tf.summary`, so on torch it needs
TensorFlow and the tensorboard package. Where they are missing, kdist makes the
class build its own writer-backed subclass instead (`redirect_construction`),
so a user's unchanged `keras.callbacks.TensorBoard(log_dir)` works whichever
way the user imported the name. A Keras instance built before the redirect
was installed is turned into kdist's class in place (`rebuild_in_place`).
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


def constructor_arguments(callback):
    """The keyword arguments that built a Keras `TensorBoard`, read back from what its `__init__` stored.

    Keras keeps every argument as a public attribute (`update_freq="batch"` as
    1, which means the same) except `profile_batch`, kept as the private
    `_start_batch`/`_stop_batch` pair (always 0 on torch, where Keras' own
    `__init__` refuses profiling).
    """
    start, stop = getattr(callback, "_start_batch", 0), getattr(callback, "_stop_batch", 0)
    return {
        "log_dir": callback.log_dir,
        "histogram_freq": callback.histogram_freq,
        "write_graph": callback.write_graph,
        "write_images": callback.write_images,
        "write_steps_per_second": callback.write_steps_per_second,
        "update_freq": callback.update_freq,
        "profile_batch": start if start == stop else (start, stop),
        "embeddings_freq": callback.embeddings_freq,
        "embeddings_metadata": callback.embeddings_metadata,
    }


def rebuild_in_place(callback, replacement):
    """Turns an instance of exactly Keras' `TensorBoard` into a `replacement`, the same object.

    The object keeps its identity (the user's reference, and the callback
    list it sits in, see the change), and `replacement.__init__` runs on it
    with the arguments it was built with, so it holds every piece of state a
    `replacement` built directly holds and gets the same refusals. If that
    `__init__` raises, the object is left as it was.

    Args:
        callback: an instance whose class is exactly `keras.callbacks.TensorBoard`.
        replacement: a subclass of it whose instances have no `__slots__`.
    """
    if type(callback) is not KerasTensorBoard or not issubclass(replacement, KerasTensorBoard):
        raise TypeError(f"Cannot rebuild {callback!r} as {replacement!r}")
    arguments = constructor_arguments(callback)
    state = dict(vars(callback))
    callback.__class__ = replacement
    try:
        replacement.__init__(callback, **arguments)
    except BaseException:
        callback.__class__ = KerasTensorBoard
        vars(callback).clear()
        vars(callback).update(state)
        raise
