"""Tables on parameter servers are read by rows: a step moves what its batch touches, in every mode.

One mechanism serves `keras.layers.Embedding` and any layer that reads a
table with `keras.ops.take(table, ids, axis=0)`, whether the model runs on
its variables (one device), on the replica engine's per-replica mappings
(several local devices: `keras.StatelessScope`), in a coordinator's
closures or in a `schedule()`d custom loop: both read the table as the torch
tensor `variable.value` returns (the replica's mapping in a stateless scope)
and pass it to `torch.nn.functional.embedding` (2-D tables) or
`torch.index_select(table, 0, ids)`. While a step runs, `row_lookups()`
installs a `TorchFunctionMode` that recognises a table tensor there and
answers from the servers instead (`VariableRouter.lookup`: the distinct
ids, one request per server). The rows come back as a fresh leaf tensor;
when backward reaches it, a hook adds its gradient to the table tensor's
`.grad` as a sparse COO tensor shaped like the table. Whatever reads
`variable.value.grad` next (Keras' `train_step`, a custom loop, each replica
of the replica engine) hands that to `optimizer.apply`; the replica
engine's weighted sum works on it unchanged (rows looked up by several
replicas: union of ids, gradients summed), and the push carries only those
rows (`VariableRouter.send_gradients`, duplicate ids summed by `rows_of`).

Tables (`mark_tables`): `Embedding` tables and row-partitioned trainable
variables of two or more dimensions. A table that a step uses any other way
(a regularizer, a matmul) is read whole from the servers right then and is
an ordinary variable from then on: exact, never stale.

Bad ids are refused before the lookup, hence before anything is pushed:
`kdist.errors.InvalidArgumentError` naming the layer, the id and V
(`Embedding`: float, negative or out-of-range ids; `ops.take` on a table:
ids out of range after Keras' wrap of negative ones).
"""

import contextlib
import threading

import keras
import torch
from torch.overrides import TorchFunctionMode

from kdist.errors import InvalidArgumentError
from kdist.keras import _compat
from kdist.keras.parameter_server import remote_tables

_local = threading.local()  # .active: a `row_lookups` block is open in this thread

# Tensor functions that read a table's metadata only, or write its .grad.
_METADATA = frozenset({"__get__", "__set__", "size", "dim", "numel", "__len__", "is_floating_point", "is_complex",
                       "element_size", "stride", "is_contiguous", "data_ptr", "storage_offset", "get_device",
                       "requires_grad_", "__repr__", "__format__", "__hash__"})
# Functions whose result is the same table (another device or a view of the same memory).
_ALIASES = frozenset({"to", "detach", "contiguous", "cpu", "cuda"})


def mark_tables(model, router):
    """Makes the remote tables of `model` row-read: `Embedding` tables and row-partitioned trainable variables.

    Returns:
        The `Route`s this call marked (those not row-read before it).
    """
    marked = []
    for layer in [model, *_compat.sublayers(model)]:
        is_embedding = isinstance(layer, keras.layers.Embedding)
        if is_embedding and (getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None)):
            continue
        for variable in [weight for weight in layer.weights if weight.trainable]:
            route = router.route(variable)
            if route is None:
                continue
            if (is_embedding and variable is layer.embeddings) or _is_partitioned_table(route):
                if not route.row_sparse:
                    marked.append(route)
                route.row_sparse = True
                route.layer_name = layer.name
        if is_embedding and router.route(layer.embeddings) is not None:
            _check_embedding_inputs(layer)
    return marked


def mark_variable(variable, router):
    """Makes one remote variable row-read when it is a row-partitioned trainable table."""
    route = router.route(variable)
    if route is not None and _is_partitioned_table(route):
        route.row_sparse = True


def _is_partitioned_table(route):
    return route.trainable and route.placement.is_partitioned and len(route.placement.shape) >= 2


def _check_embedding_inputs(layer):
    # Keras casts float ids to int32 and wraps negative ones; a remote table refuses both.
    if getattr(layer, "_kdist_checks_ids", False):
        return
    original_call = layer.call

    def call(inputs, *args, **kwargs):
        if isinstance(inputs, torch.Tensor) and inputs.device.type != "meta" and inputs.numel():
            if inputs.is_floating_point() or inputs.is_complex():
                flat = inputs.reshape(-1)
                fractional = torch.nonzero(flat != torch.floor(flat.real if inputs.is_complex() else flat))
                bad = flat[fractional[0, 0] if len(fractional) else 0].item()
                raise InvalidArgumentError(
                    f"Embedding layer {layer.name!r} received float ids (the id {bad!r}, dtype "
                    f"{inputs.dtype}); its table of V={layer.input_dim} rows lives on parameter "
                    "servers and is indexed by integers in [0, V). Cast the ids to int32/int64 yourself."
                )
            _check_range(inputs, layer.input_dim, f"Embedding layer {layer.name!r}")
        return original_call(inputs, *args, **kwargs)

    object.__setattr__(layer, "call", call)
    object.__setattr__(layer, "_kdist_checks_ids", True)


def _check_range(ids, num_rows, who):
    low, high = int(ids.min().item()), int(ids.max().item())
    if low < 0 or high >= num_rows:
        bad = low if low < 0 else high
        raise InvalidArgumentError(
            f"{who} received the id {bad}, outside its table of V={num_rows} rows (valid ids: "
            f"0 to {num_rows - 1}). Nothing was sent to the parameter servers. Fix the input "
            "pipeline, or map unknown ids to a reserved row."
        )


@contextlib.contextmanager
def row_lookups(router, routes=None):
    """While active (in this thread), lookups of row-read tables go to the servers (see module doc)."""
    tables = [route for route in (router.all_routes() if routes is None else routes) if route.row_sparse]
    if not tables or getattr(_local, "active", False):  # none to read, or an outer block reads them
        yield
        return
    _local.active = True
    try:
        with remote_tables.in_lookups(), _LookupMode(router, tables):
            yield
    finally:
        _local.active = False


class _LookupMode(TorchFunctionMode):
    def __init__(self, router, tables):
        super().__init__()
        self._router = router
        self._tables = tables
        self._aliases = {}  # id(tensor) -> (tensor, route): a table moved or detached this step
        # Outside a stateless scope a table's tensor is the variable's own, whose
        # identity lasts (pulls and `RemoteTable.materialise` work in place):
        # one dict lookup per argument instead of a scan of every table. Inside
        # one (the replica engine) each replica maps its own tensors: scan.
        self._stored = {id(tensor): (tensor, route) for route in tables
                        if (tensor := _compat.torch_tensor_of(route.variable)) is not None}

    def _table(self, value, stateless):
        if not isinstance(value, torch.Tensor):
            return None
        alias = self._aliases.get(id(value))
        if alias is not None and alias[0] is value:
            return alias[1]
        if not stateless:
            stored = self._stored.get(id(value))
            return stored[1] if stored is not None and stored[0] is value and stored[1].row_sparse else None
        for route in self._tables:
            if route.row_sparse and _current_tensor(route.variable) is value:
                return route
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Every torch call of the step comes here: the common one, which reads
        # no table, costs one scope check and a dict lookup per argument.
        stateless = _compat.in_stateless_scope()
        if func is torch.nn.functional.embedding:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            route = self._table(weight, stateless)
            if route is not None:
                indices = args[0] if args else kwargs["input"]
                return self._lookup(route, weight, indices)
        elif func is torch.index_select or func is torch.Tensor.index_select:
            route = self._table(args[0], stateless)
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if route is not None and dim == 0:
                return self._lookup(route, args[0], args[2] if len(args) > 2 else kwargs["index"])
        name = getattr(func, "__name__", "")
        if name not in _METADATA:
            arguments = remote_tables.flat_arguments(args, kwargs)
            used = [route for value in arguments if (route := self._table(value, stateless)) is not None]
            if used:
                if name in _ALIASES:
                    result = func(*args, **kwargs)
                    self._aliases[id(result)] = (result, used[0])
                    return result
                for route in used:  # read densely: whole, now, and as an ordinary variable from now on
                    table = remote_tables.of(route.variable)
                    if table is not None:  # held by the servers only: from now on also here
                        table.materialise(torch.empty(table.shape, dtype=table.dtype))
                    self._router.pull([route], include_row_sparse=True, only_changed=table is None)
                    route.row_sparse = False
        return func(*args, **kwargs)

    def _lookup(self, route, weight, indices):
        num_rows = route.placement.shape[0]
        flat = indices.reshape(-1).to(torch.int64)
        if flat.numel():
            _check_range(flat, num_rows, _who(route))
        unique, inverse = torch.unique(flat, return_inverse=True)
        rows, versions = self._router.lookup(route, unique)
        rows = rows.to(device=weight.device, dtype=weight.dtype)
        if torch.is_grad_enabled() and route.trainable:
            rows.requires_grad_(True)
            rows.register_hook(_sparse_gradient_into(weight, unique))
            known = route.lookup_versions
            for position, version in versions.items():
                known[position] = min(version, known.get(position, version))
        return rows[inverse].reshape(tuple(indices.shape) + tuple(rows.shape[1:]))


def _current_tensor(variable):
    # The replica's mapping in a stateless scope; else the stored tensor (no autocast copy).
    return variable.value if _compat.in_stateless_scope() else _compat.torch_tensor_of(variable)


def _who(route):
    layer = getattr(route, "layer_name", None) or route.variable.path.rsplit("/", 1)[0]
    return f"Layer {layer!r} (reading table {route.variable.path!r})"


def _sparse_gradient_into(weight, ids):
    def hook(gradient):
        sparse = torch.sparse_coo_tensor(ids[None].to(gradient.device), gradient, size=tuple(weight.shape),
                                         check_invariants=False)
        # Two lookups of one table in a step: their ids side by side, summed by `rows_of`.
        weight.grad = sparse if weight.grad is None else weight.grad + sparse

    return hook


def rows_of(gradient):
    """A sparse row gradient as `(unique ids, summed rows)`."""
    gradient = gradient.coalesce()
    return gradient.indices()[0], gradient.values()
