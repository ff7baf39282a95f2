"""Where every write of a torch Keras variable passes: `Variable._direct_assign`.

`assign`, `assign_add`, `assign_sub`, `Layer.set_weights` (so
`model.set_weights`), `Optimizer.set_weights`, `load_own_variables` (so
`load_weights` and a `BackupAndRestore` restore) all end in
`_direct_assign(value)` with a value already converted and shape-checked;
inside a `StatelessScope` Keras records the update instead and never calls it.
kdist's own refreshes of local copies (a parameter-server pull) copy into the
torch tensor directly and do not pass here.

The public calls that write several variables (or read before writing) are
wrapped as well, so that a strategy can treat their writes as one unit and
name the call in an error.
"""

import functools

import keras
from keras.src.backend.torch import core as _torch_core_module

_TorchVariable = _torch_core_module.Variable

PINNED = {
    "keras.src.backend.torch.core.Variable._direct_assign": lambda: _TorchVariable._direct_assign,
}

# (class, method, the name a user knows the call by). `assign_add`/`assign_sub`
# read the variable before writing it; the others write several variables.
_NAMED_CALLS = (
    (_TorchVariable, "assign_add", "variable.assign_add()"),
    (_TorchVariable, "assign_sub", "variable.assign_sub()"),
    (keras.layers.Layer, "set_weights", "set_weights()"),
    (keras.optimizers.Optimizer, "set_weights", "optimizer.set_weights()"),
    (keras.optimizers.Optimizer, "load_own_variables", "optimizer.load_own_variables()"),
)


def install_variable_write_hook(on_write, call_scope):
    """Sends every torch Keras variable write through `on_write`; names the calls that make them.

    Args:
        on_write: `on_write(variable, value, write_locally)`, called instead of
            Keras' `_direct_assign`; `write_locally(variable, value)` is Keras'
            own (it changes the local tensor only).
        call_scope: `call_scope(obj, call_name)` returns a context manager to
            run one of the named calls in, or None (run it as is). `obj` is
            the variable, layer or optimizer whose method was called.
    """
    original = _TorchVariable._direct_assign

    @functools.wraps(original)
    def _direct_assign(self, value):
        on_write(self, value, original)

    _TorchVariable._direct_assign = _direct_assign
    for owner, name, call_name in _NAMED_CALLS:
        setattr(owner, name, _named(getattr(owner, name), call_name, call_scope))


def _named(method, call_name, call_scope):
    @functools.wraps(method)
    def named(self, *args, **kwargs):
        scope = call_scope(self, call_name)
        if scope is None:
            return method(self, *args, **kwargs)
        with scope:
            return method(self, *args, **kwargs)

    return named
