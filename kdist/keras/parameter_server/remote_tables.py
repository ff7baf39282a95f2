"""Tables that live on the parameter servers only: no copy on a worker or the chief.

A table's worth of memory on every worker is what parameter servers exist to
avoid. An `Embedding` table, or a row-partitioned trainable variable of two or
more dimensions, created in a `ParameterServerStrategy` scope with one of
Keras' own initializers is therefore created on its servers, which compute
its value (`kdist.ps.server.server_init`), and the local Keras variable holds a
`RemoteTable`: a tensor shaped like the table whose memory is one element
(every row is a zero-stride view of it). Optimizer slots of such a table
(`add_variable_from_reference`) get one too: the servers hold them.

Steps read the table by rows (`kdist.keras.parameter_server.embeddings`). Any
other use of a `RemoteTable` reads or writes the servers, never the stand-in:

- outside a step, reading it (`numpy()`, `get_weights`, `save`, `model(x)`)
  fetches the whole table from its shards for that one operation, and writing
  it (`assign`, `set_weights`, `load_weights`) sends the whole value to them,
  by the way every variable write goes (`variable_writes`);
  a gradient that would reach it there is refused when backward runs;
- inside a step, a use other than a lookup (a regularizer, a matmul) makes it
  an ordinary variable from then on, read whole (as for any row-read table);
- an optimizer slot's stand-in is written when the chief reads the servers'
  optimizer state back for a save, and becomes an ordinary variable then.

Becoming an ordinary variable happens in place (`RemoteTable.materialise`):
the tensor object Keras and torch's parameter registry hold stays the same.

Variables whose initializer the servers cannot recompute (a custom class, a
`SeedGenerator` seed) are created locally as before, then read by rows.
"""

import contextlib
import threading

import keras
import torch

from kdist.errors import UnsupportedError
from kdist.keras import _compat
from kdist.ps.wire.conventions import initializer_config
from kdist.rpc import dtypes

_local = threading.local()  # .slot_reference: the variable whose optimizer slot is being created
# Tensor functions that read only metadata, or set an attribute (`.grad`).
_METADATA = frozenset({"size", "dim", "numel", "__len__", "is_floating_point", "is_complex", "element_size",
                       "stride", "get_device", "requires_grad_", "__hash__", "__set__", "retain_grad",
                       "register_hook", "_is_view", "__reduce_ex__"})
# Properties whose value is the table's data, not metadata.
_DATA_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__"})


_AUTOGRAD = (torch.autograd.grad, torch.autograd.backward)
# Who sends a table's new value: `variable_writes` sets itself here when it installs its hook
# (it imports this module, so this one does not import it).
_writer = None


def set_writer(writer):
    """Makes `writer(table, whole)` carry every in-place write of a table the servers hold."""
    global _writer
    _writer = writer


class RemoteTable(torch.nn.Parameter):
    """A Keras variable's stand-in for a table held by parameter servers (see module doc).

    Attributes:
        route: its `Route` (None until bound; an optimizer slot has none).
        router: the `VariableRouter` of `route`.
        variable: the Keras variable it stands in for.
    """

    @staticmethod
    def create(variable, shape, dtype, trainable):
        one = torch.zeros((1,) * len(shape), dtype=dtype, device=_compat.torch_device())
        table = torch.Tensor._make_subclass(RemoteTable, one.expand(shape), bool(trainable))
        table.route, table.router, table.variable = None, None, variable
        return table

    def __repr__(self):
        return f"RemoteTable(shape={tuple(self.shape)}, dtype={self.dtype}, held by the parameter servers)"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = "data" if getattr(getattr(func, "__self__", None), "__name__", "") in _DATA_PROPERTIES else "__get__"
        tables = [value for value in flat_arguments(args, kwargs) if isinstance(value, RemoteTable)]
        # Autograd's entry points take the stand-in only as what to differentiate against: a
        # fetched copy would not be in the graph (the lookup's rows are, `embeddings`).
        if (name in _METADATA or name == "__get__" or func in _AUTOGRAD or getattr(_local, "in_lookups", False)
                or not tables):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if any(isinstance(value, torch.Tensor) and value.device.type == "meta"
               for value in flat_arguments(args, kwargs)):
            # Keras traces shapes on the meta device: no values needed.
            stand_ins = {id(table): torch.empty(table.shape, dtype=table.dtype, device="meta") for table in tables}
            return func(*_replace(args, stand_ins), **_replace(kwargs, stand_ins))
        in_place = args and args[0] is tables[0] and (
            name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.endswith("__")))
        wholes = {id(table): table.fetch(for_writing=bool(in_place) and table is args[0]) for table in tables}
        result = func(*_replace(args, wholes), **_replace(kwargs, wholes))
        if in_place:
            args[0].write(wholes[id(args[0])])
            return args[0]
        return result

    def fetch(self, for_writing=False):
        """The whole current value, read from the servers (a new tensor, not kept)."""
        if self.route is None:
            if for_writing:  # an optimizer slot being written: it becomes an ordinary variable
                return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            raise UnsupportedError(
                f"The optimizer slot {self.variable.path!r} of a table that lives on the parameter "
                "servers is held by them. Read the optimizer's state with model.save_weights() or "
                "model.save() on the chief, which read it back from the servers."
            )
        whole = dtypes.to_torch(self.router.read_whole(self.route)).to(self.device)
        if not for_writing and torch.is_grad_enabled() and self.requires_grad:
            whole.requires_grad_(True)
            whole.register_hook(_refuse_gradient(self.variable))
        return whole

    def write(self, whole):
        """Makes `whole` the table's value: on the servers, or locally for an optimizer slot.

        A Keras `assign` never gets here (`kdist.keras.parameter_server.variable_writes`
        sends it first); an in-place torch op on the tensor does, and is sent the same way.
        """
        if self.route is None:
            self.materialise(whole)
        elif _writer is not None:
            _writer(self, whole.detach())
        else:
            self.router.assign_whole(self.route, whole.detach())

    def materialise(self, whole):
        """Makes this tensor an ordinary `torch.nn.Parameter` holding `whole`, in place.

        The object stays the one Keras (and torch's parameter registry, which
        `zero_grad` walks) holds; only its memory and class change.
        """
        with torch.no_grad():
            self.data = whole.detach().to(self.device, copy=True)
        self.__class__ = torch.nn.Parameter
        if self.route is not None:
            self.route.remote = False
        return self


def placeholder_for(variable, initializer, strategy):
    """A `RemoteTable` when `variable`, about to be initialised in `strategy`'s scope, is a table the servers hold.

    Creates the table on the servers (they compute its value) and binds the
    stand-in to it. None: initialise it locally as usual.
    """
    extended = strategy.extended
    shape, dtype = tuple(variable.shape), _compat.torch_dtype_of(variable)
    owner = _compat.variable_owner()
    reference = getattr(_local, "slot_reference", None)
    if isinstance(owner, keras.optimizers.Optimizer):
        # A slot of a table the servers hold (on a coordinator's worker, possibly
        # before the table is bound: Keras builds a deserialised model's optimizer).
        if reference is not None and of(reference) is not None and tuple(reference.shape) == shape:
            return RemoteTable.create(variable, shape, dtype, trainable=False)
        return None
    if not variable.trainable or len(shape) < 2 or not _compat.is_model_variable(variable, owner):
        return None
    if extended.adopts_table(table_key(variable.path)):  # a coordinator's worker rebuilding the chief's model
        return RemoteTable.create(variable, shape, dtype, variable.trainable)
    is_embedding = isinstance(owner, keras.layers.Embedding) and variable.name == "embeddings"
    if not (is_embedding or extended.partitions_rows(shape, str(variable.dtype))):
        return None
    config = initializer_config(initializer)
    if config is None:
        return None
    route = extended.create_remote_table(variable, shape, config)
    if route is None:  # variables created now stay local (`local_variable_creation`)
        return None
    table = RemoteTable.create(variable, shape, dtype, variable.trainable)
    bind(table, route, extended.variable_router)
    return table


def table_key(path):
    """What names a table across the chief and a worker: its layer's name and its own.

    A model rebuilt from its config on a worker creates its weights without
    the enclosing model's name scope ("embedding/embeddings" for the chief's
    "sequential/embedding/embeddings").
    """
    return "/".join(path.split("/")[-2:])


def bind(table, route, router):
    """Connects a stand-in to its `Route` (a coordinator's worker binds it when adopting the chief's keys)."""
    table.route, table.router = route, router
    route.remote = route.row_sparse = True


def of(variable):
    """The variable's `RemoteTable`, or None."""
    tensor = _compat.torch_tensor_of(variable)
    return tensor if isinstance(tensor, RemoteTable) else None


def slot_of(reference_variable):
    """Marks the optimizer slot variables created inside as slots of `reference_variable`."""
    return _thread_setting("slot_reference", reference_variable, None)


def in_lookups():
    """While a step's lookups are tracked (`embeddings.row_lookups`): stand-ins pass through untouched."""
    return _thread_setting("in_lookups", True, False)


@contextlib.contextmanager
def _thread_setting(name, value, default):
    outer = getattr(_local, name, default)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, outer)


def _refuse_gradient(variable):
    def hook(gradient):
        raise UnsupportedError(
            f"A gradient reached the table {variable.path!r}, which lives on the parameter servers, "
            "outside a step kdist runs, so it could not be pushed. Train it with fit(), or with "
            "strategy.run() / ClusterCoordinator.schedule() in a custom loop."
        )

    return hook


def flat_arguments(args, kwargs):
    """The tensors (and other values) of a torch call's arguments, one level of lists opened (a list)."""
    values = [*args, *kwargs.values()] if kwargs else list(args)
    if not any(isinstance(value, (list, tuple)) for value in values):
        return values
    flat = []
    for value in values:
        if isinstance(value, (list, tuple)):
            flat.extend(value)
        else:
            flat.append(value)
    return flat


def _replace(structure, tensors):
    if isinstance(structure, dict):
        return {key: _replace(value, tensors) for key, value in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(_replace(value, tensors) for value in structure)
    if isinstance(structure, RemoteTable):
        return tensors.get(id(structure), structure)
    return structure
