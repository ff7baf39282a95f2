"""Request payloads of `VariableClient`: gradients, assignments and row ids as codec frames.

Stage 3 of a push (see `kdist.distribute.parameter_server.router`):
`encode_gradient` turns a `DenseGradient` or `RowGradient` into its header
entry and the arrays the codec then frames.
"""

import numpy as np

from kdist.errors import InvalidArgumentError
from kdist.ps.wire import codec
from kdist.ps.wire._generated import variable_service_pb2 as pb
from kdist.ps.wire.values import Assignment, DenseGradient, OptimizerState, RowGradient, check_name


def variables_layout(header):
    return [codec.parse_meta(meta.value, f"variable {meta.name!r}")
            for meta in header.variables if meta.has_value]


def ids_array(ids, what):
    ids = codec.as_array(ids, what)
    if not np.issubdtype(ids.dtype, np.integer):
        raise InvalidArgumentError(f"{what} must be integers. Received: dtype={ids.dtype}.")
    return np.ascontiguousarray(ids, dtype=np.int64)


def encode_gradient(gradient):
    """`(GradientMeta, [arrays])` of a `DenseGradient` or `RowGradient`, checked."""
    if isinstance(gradient, DenseGradient):
        array = codec.as_array(gradient.gradient, f"the gradient of {gradient.name!r}")
        meta = pb.GradientMeta(name=gradient.name, kind=pb.DENSE,
                               values=codec.tensor_meta(array), version=gradient.version)
        return meta, [array]
    if isinstance(gradient, RowGradient):
        what = f"the row gradient of {gradient.name!r}"
        ids = ids_array(gradient.row_ids, f"row ids of {gradient.name!r}")
        rows = codec.as_array(gradient.rows, what)
        if rows.shape[:ids.ndim] != ids.shape:
            raise InvalidArgumentError(
                f"{what}: rows must have shape row_ids.shape + row shape. Received: "
                f"row_ids.shape={ids.shape}, rows.shape={rows.shape}."
            )
        rows = rows.reshape((ids.size,) + rows.shape[ids.ndim:])
        ids = ids.reshape(-1)
        meta = pb.GradientMeta(name=gradient.name, kind=pb.ROWS, values=codec.tensor_meta(rows),
                               num_row_ids=ids.size, version=gradient.version)
        return meta, [ids, rows]
    raise InvalidArgumentError(
        f"push() takes DenseGradient and RowGradient values. Received: {type(gradient).__name__}."
    )


def assignment_payload(assignments):
    metas, arrays = [], []
    for assignment in assignments:
        if not isinstance(assignment, Assignment):
            raise InvalidArgumentError(
                f"Expected Assignment values. Received: {type(assignment).__name__}."
            )
        array = codec.as_array(assignment.value, f"the value assigned to {assignment.name!r}")
        metas.append(pb.AssignmentMeta(name=assignment.name, value=codec.tensor_meta(array)))
        arrays.append(array)
    return metas, arrays


def optimizer_state_payload(states):
    """`(OptimizerStateHeader, [slot arrays])` of name -> `OptimizerState`."""
    metas, arrays = [], []
    for name, state in states.items():
        check_name(name)
        slots = [(slot, codec.as_array(value, f"slot {slot!r} of {name!r}"))
                 for slot, value in state.slots.items()]
        metas.append(pb.VariableOptimizerState(
            name=name, iterations=int(state.iterations),
            slots=[pb.SlotMeta(name=slot, value=codec.tensor_meta(value)) for slot, value in slots]))
        arrays.extend(value for _, value in slots)
    return pb.OptimizerStateHeader(states=metas), arrays


def read_optimizer_state(frames):
    """name -> `OptimizerState` from the frames of an `OptimizerState` response."""
    response, values = codec.read_stream(
        frames, lambda header: [codec.parse_meta(slot.value, "slot")
                                for state in header.states for slot in state.slots],
        "optimizer state response")
    values = iter(values)
    return {state.name: OptimizerState(state.iterations, {slot.name: next(values) for slot in state.slots})
            for state in response.states}
