"""Tables on parameter servers are read by rows: a step moves what its batch touches, in every mode.

One mechanism serves `keras.layers.Embedding` and any layer that reads a
table with `keras.ops.take(table, ids, axis=0)`, whether the model runs on
its variables (one device), on the replica engine's per-replica mappings
(several local devices: `keras.StatelessScope`), in a coordinator's
closures, in a `schedule()`d custom loop or in a worker's own custom loop
(`strategy.run` between-graph): all read the table as the torch tensor
`variable.value` returns (the replica's mapping in a stateless scope) and
pass it to `torch.nn.functional.embedding` (2-D tables) or
`torch.index_select(table, 0, ids)`. While a step runs, `row_lookups()`
installs a `TorchFunctionMode` that recognises a table tensor there and
answers from the servers instead (`VariableRouter.lookup`: the distinct
ids, one request per server).

The rows come back as the output of an autograd function (`_RowLookup`)
whose input is the table tensor itself, so the table is in the autograd
graph as it is on one device, and whose backward gives the table a sparse
COO gradient shaped like it (the looked-up ids, one row each). Every form of
gradient therefore works unchanged: `loss.backward()` leaves it in
`variable.value.grad` (several lookups add up), `torch.autograd.grad(loss,
[v.value for v in model.trainable_variables])` returns it (the TensorFlow
tutorials' `tape.gradient`, renamed), `create_graph=True` differentiates it
again exactly. Whatever hands it to `optimizer.apply` (Keras' `train_step`,
a custom loop, each replica of the replica engine, whose weighted sum works
on it unchanged) pushes only those rows (`VariableRouter.send_gradients`,
duplicate ids summed by `rows_of`); a dense gradient for such a table is
refused (`kdist.keras.parameter_server.worker_steps`).

Where the block is opened: around every step function and coordinator
closure (`worker_steps`, `worker_runtime`), and, for a worker's own custom
loop, around the call of each layer that owns a table while a replica
function of the strategy runs (`read_tables_in_replicas`). A plain
`model(x)` outside `strategy.run` reads the table whole (`remote_tables`).

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

from kdist.distribute import context as distribute_context
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
# Autograd's entry points take a table as what to differentiate with respect to: no read.
_AUTOGRAD = (torch.autograd.grad, torch.autograd.backward)


def mark_tables(model, router):
    """Makes the remote tables of `model` row-read: `Embedding` tables and row-partitioned trainable variables.

    Returns:
        The `Route`s this call marked (those not row-read before it).
    """
    marked, owners = [], {}
    for layer in [model, *_compat.sublayers(model)]:  # depth first: a table's innermost layer comes last
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
                owners[id(route)] = layer
        if is_embedding and router.route(layer.embeddings) is not None:
            _check_embedding_inputs(layer)
    for layer in {id(layer): layer for layer in owners.values()}.values():
        read_tables_in_replicas(layer, router)
    return marked


def read_tables_in_replicas(layer, router):
    """Makes `layer`'s calls inside a replica function (`strategy.run`) look its tables' rows up.

    For a worker's own custom loop: steps and coordinator closures open
    `row_lookups` themselves (then this does nothing). The mode is needed only
    while the rows are read; the gradient reaches the table through autograd.
    Idempotent.
    """
    if getattr(layer, "_kdist_reads_rows_in_replicas", False):
        return
    original_call = layer.call

    def call(*args, **kwargs):
        if getattr(_local, "active", False) or not _in_replica_function():
            return original_call(*args, **kwargs)
        routes = [route for weight in layer.weights if (route := router.route(weight)) is not None]
        with row_lookups(router, routes):
            return original_call(*args, **kwargs)

    object.__setattr__(layer, "call", call)
    object.__setattr__(layer, "_kdist_reads_rows_in_replicas", True)


def _in_replica_function():
    return distribute_context.has_strategy() and distribute_context.get_replica_context() is not None


def mark_variable(variable, router):
    """Makes one remote variable row-read when it is a row-partitioned trainable table (a coordinator's worker)."""
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
        if name not in _METADATA and func not in _AUTOGRAD:
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
        shape = tuple(indices.shape) + tuple(rows.shape[1:])
        if not (torch.is_grad_enabled() and route.trainable and weight.requires_grad):
            return rows[inverse].reshape(shape)
        known = route.lookup_versions
        for position, version in versions.items():
            known[position] = min(version, known.get(position, version))
        return _RowLookup.apply(weight, rows, inverse, _sparse_gradient_into(weight, unique)).reshape(shape)


class _RowLookup(torch.autograd.Function):
    """`rows[inverse]`, differentiable with respect to the table `weight` the rows were looked up from.

    Backward gives `weight` a sparse COO gradient holding the looked-up rows
    only (`_sparse_gradient_into`), as `torch.nn.functional.embedding(...,
    sparse=True)` does; its computation is differentiable (`create_graph`).
    """

    @staticmethod
    def forward(ctx, weight, rows, inverse, table_gradient):
        ctx.num_rows, ctx.table_gradient = rows.shape[0], table_gradient
        ctx.save_for_backward(inverse)
        return rows[inverse]

    @staticmethod
    def backward(ctx, gradient):
        (inverse,) = ctx.saved_tensors
        # Duplicate ids of the batch summed into one row each (as the dense gradient would).
        summed = torch.zeros((ctx.num_rows, *gradient.shape[1:]), dtype=gradient.dtype, device=gradient.device)
        summed = summed.index_add(0, inverse.to(gradient.device), gradient)
        return ctx.table_gradient(summed), None, None, None


def _current_tensor(variable):
    # The replica's mapping in a stateless scope; else the stored tensor (no autocast copy).
    return variable.value if _compat.in_stateless_scope() else _compat.torch_tensor_of(variable)


def _who(route):
    layer = getattr(route, "layer_name", None) or route.variable.path.rsplit("/", 1)[0]
    return f"Layer {layer!r} (reading table {route.variable.path!r})"


def _sparse_gradient_into(weight, ids):
    """The function that makes `weight`'s gradient from its looked-up rows' (`ids`, one summed row each)."""
    shape = tuple(weight.shape)

    def table_gradient(gradient):
        # Two lookups of one table in a step: autograd adds their sparse gradients (ids side
        # by side, summed by `rows_of`).
        return torch.sparse_coo_tensor(ids[None].to(gradient.device), gradient, size=shape, check_invariants=False)

    return table_gradient


def rows_of(gradient):
    """A sparse row gradient as `(unique ids, summed rows)`."""
    gradient = gradient.coalesce()
    return gradient.indices()[0], gradient.values()
