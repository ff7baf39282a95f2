"""The variable service end to end: a real server on a free port, a real client."""

import grpc
import ml_dtypes
import numpy as np
import pytest
import torch

from kdist.errors import ParameterServerError
from kdist.ps import (
    Assignment,
    DenseGradient,
    RowGradient,
    Security,
    VariableInit,
)
from kdist.ps.wire import codec
from kdist.ps.wire._generated import variable_service_pb2 as pb
from kdist.ps.wire.methods import METHODS
from tests.ps.conftest import sgd_config

pytestmark = pytest.mark.timeout(120)


def _create(client, name, value, trainable=True, optimizer=True):
    [state] = client.create([VariableInit(name, value, trainable)])
    if optimizer and trainable:
        client.configure_optimizer(sgd_config(0.5), [name])
    return state


def _value(client, name):
    [state] = client.pull([name])
    return state.value


def test_create_is_idempotent_and_first_creator_wins(client, rng):
    first = rng.standard_normal((40, 7)).astype("float32")
    states = client.create([VariableInit("layer/kernel", first), VariableInit("bias", np.ones(3))])
    assert [state.version for state in states] == [0, 0]
    np.testing.assert_array_equal(states[0].value, first)
    assert states[0].value.flags.writeable and not np.shares_memory(states[0].value, first)
    [again] = client.create([VariableInit("layer/kernel", np.zeros((40, 7), "float32"))])
    np.testing.assert_array_equal(again.value, first)


@pytest.mark.parametrize("value, trainable", [
    (np.zeros((40, 6), "float32"), True),
    (np.zeros((40, 7), "float64"), True),
    (np.zeros((40, 7), "float32"), False),
])
def test_create_with_other_shape_dtype_or_flag_names_the_variable(client, value, trainable):
    client.create([VariableInit("layer/kernel", np.zeros((40, 7), "float32"))])
    with pytest.raises(ParameterServerError, match="layer/kernel") as caught:
        client.create([VariableInit("fresh", np.zeros(2)),
                       VariableInit("layer/kernel", value, trainable)])
    assert caught.value.code_name == "INVALID_ARGUMENT" and not caught.value.retryable
    with pytest.raises(ParameterServerError) as caught:
        client.pull(["fresh"])  # nothing of the failed request was created
    assert caught.value.code_name == "NOT_FOUND"


def test_pull_skips_known_versions(client):
    _create(client, "a", np.arange(5, dtype="float32"))
    _create(client, "b", np.arange(3, dtype="int64"), trainable=False)
    states = client.pull(["a", "b"], known_versions={"a": 0, "b": 7})
    assert states[0].value is None and states[0].version == 0
    np.testing.assert_array_equal(states[1].value, np.arange(3))


def test_dense_push_applies_sgd_and_counts(client, server):
    _create(client, "w", np.ones((10, 10), "float32"))
    result = client.push([DenseGradient("w", np.full((10, 10), 2.0, "float32"), version=0)])
    assert result.versions == {"w": 1} and result.rejected == () and result.staleness == {"w": 0}
    [state] = client.pull(["w"])
    np.testing.assert_allclose(state.value, np.zeros((10, 10)))
    assert state.version == 1
    stats = client.stats()
    assert stats.variables["w"].applied_updates == 1 and stats.applied_pushes == 1
    assert stats.requests["push"] == 1 and stats.requests["pull"] == 1
    assert stats.bytes_received == 400 + 400 and stats.bytes_sent >= 400
    assert server.stats().variables["w"].version == 1


def test_row_gradient_sums_repeated_ids_like_a_dense_gradient(client):
    table = np.arange(24, dtype="float32").reshape(6, 4)
    _create(client, "table", table)
    ids = np.array([[1, 4], [1, 0]])
    rows = np.ones((2, 2, 4), "float32")
    client.push([RowGradient("table", ids, rows, version=0)])
    dense = np.zeros_like(table)
    np.add.at(dense, ids.reshape(-1), rows.reshape(-1, 4))
    np.testing.assert_allclose(_value(client, "table"), table - 0.5 * dense)


def test_torch_inputs_and_bfloat16(client):
    value = torch.arange(6, dtype=torch.bfloat16)
    state = _create(client, "half", value)
    assert state.value.dtype == np.dtype(ml_dtypes.bfloat16)
    client.push([DenseGradient("half", torch.full((6,), 2.0, dtype=torch.bfloat16))])
    np.testing.assert_array_equal(_value(client, "half").astype("float32"),
                                  np.arange(6, dtype="float32") - 1.0)


def test_assign_replaces_value_and_bumps_version(client):
    _create(client, "moving_mean", np.zeros(4, "float32"), trainable=False)
    assert client.assign([Assignment("moving_mean", np.full(4, 3.0, "float32"))]) == {
        "moving_mean": 1}
    np.testing.assert_array_equal(_value(client, "moving_mean"), np.full(4, 3.0))


def test_push_with_gradients_and_assignments(client):
    _create(client, "w", np.ones(3, "float32"))
    _create(client, "stat", np.zeros(2, "float32"), trainable=False)
    result = client.push([DenseGradient("w", np.ones(3, "float32"), 0)],
                         [Assignment("stat", np.ones(2, "float32"))])
    assert result.versions == {"w": 1, "stat": 1}


def test_lookup_gathers_rows_of_several_variables(client, rng):
    table = rng.standard_normal((50, 3)).astype("float32")
    other = np.arange(20, dtype="int32").reshape(10, 2)
    _create(client, "table", table)
    _create(client, "other", other, trainable=False)
    ids = np.array([[3, 3], [49, 0]])
    (rows, version), (other_rows, _) = client.lookup([("table", ids), ("other", np.array([9]))])
    np.testing.assert_array_equal(rows, table[ids])
    assert rows.shape == (2, 2, 3) and version == 0
    np.testing.assert_array_equal(other_rows, other[[9]])


def _lookup_past_the_client(server, options, requests):
    """Sends a Lookup of `requests` as given, over a raw channel: none of the client's own checks run."""
    arrays = [np.ascontiguousarray(ids) for _, ids in requests]
    header = pb.LookupHeader(items=[
        pb.LookupItem(name=name, ids=codec.tensor_meta(ids)) for (name, _), ids in zip(requests, arrays)
    ])
    frames = codec.encode_stream(header, [codec.byte_view(ids) for ids in arrays], options.chunk_bytes)
    with Security().channel(server.address) as channel:
        return list(METHODS["Lookup"].callable(channel)(iter(frames), timeout=30))


@pytest.mark.parametrize("bad_request, code", [
    ([("table", np.array([50]))], grpc.StatusCode.INVALID_ARGUMENT),
    ([("table", np.array([-1]))], grpc.StatusCode.INVALID_ARGUMENT),
    ([("table", np.array([0.5]))], grpc.StatusCode.INVALID_ARGUMENT),
    ([("missing", np.array([0]))], grpc.StatusCode.NOT_FOUND),
])
def test_lookup_rejects_bad_ids(client, server, options, bad_request, code):
    _create(client, "table", np.zeros((50, 3), "float32"))
    # The server itself refuses them: the request bypasses the client's checks.
    with pytest.raises(grpc.RpcError) as refused:
        _lookup_past_the_client(server, options, bad_request)
    assert refused.value.code() == code


@pytest.mark.parametrize("gradients, code", [
    ([DenseGradient("missing", np.ones(3, "float32"))], "NOT_FOUND"),
    ([DenseGradient("b", np.ones(4, "float32"))], "INVALID_ARGUMENT"),
    ([DenseGradient("b", np.ones(3, "float64"))], "INVALID_ARGUMENT"),
    ([DenseGradient("frozen", np.ones(3, "float32"))], "INVALID_ARGUMENT"),
    ([DenseGradient("unconfigured", np.ones(3, "float32"))], "FAILED_PRECONDITION"),
    ([RowGradient("table", np.array([0, 6]), np.ones((2, 2), "float32"))], "INVALID_ARGUMENT"),
    ([RowGradient("table", np.array([0]), np.ones((1, 3), "float32"))], "INVALID_ARGUMENT"),
    ([DenseGradient("b", np.ones(3, "float32"), version=5)], "INVALID_ARGUMENT"),
    ([DenseGradient("b", np.ones(3, "float32"))] * 2, "INVALID_ARGUMENT"),
])
def test_a_bad_push_changes_nothing(client, gradients, code):
    # "a" comes first in every request: it must not be applied when a later
    # part of the request is bad.
    _create(client, "a", np.zeros(3, "float32"))
    _create(client, "b", np.zeros(3, "float32"))
    _create(client, "frozen", np.zeros(3, "float32"), trainable=False)
    _create(client, "unconfigured", np.zeros(3, "float32"), optimizer=False)
    _create(client, "table", np.zeros((6, 2), "float32"))
    with pytest.raises(ParameterServerError) as caught:
        client.push([DenseGradient("a", np.ones(3, "float32"))] + gradients)
    assert caught.value.code_name == code
    [state] = client.pull(["a"])
    assert state.version == 0
    np.testing.assert_array_equal(state.value, np.zeros(3))
    assert client.stats().variables["a"].applied_updates == 0
    assert client.health()["status"] == "SERVING"


def test_optimizer_config_conflict_and_repeat(client):
    _create(client, "w", np.zeros(3, "float32"))  # SGD(0.5)
    client.configure_optimizer(sgd_config(0.5), ["w"])  # the same: no-op
    with pytest.raises(ParameterServerError) as caught:
        client.configure_optimizer(sgd_config(0.1), ["w"])
    assert caught.value.code_name == "FAILED_PRECONDITION"


@pytest.mark.parametrize("config", [
    {"class_name": "NoSuchOptimizer", "config": {}},
    sgd_config(0.1, global_clipnorm=1.0),
])
def test_unusable_optimizer_config_is_invalid(client, config):
    _create(client, "w", np.zeros(3, "float32"), optimizer=False)
    with pytest.raises(ParameterServerError) as caught:
        client.configure_optimizer(config, ["w"])
    assert caught.value.code_name == "INVALID_ARGUMENT"


def test_optimizer_state_lists_slots_in_creation_order(client):
    import keras

    _create(client, "w", np.zeros(3, "float32"), optimizer=False)
    config = keras.optimizers.serialize(keras.optimizers.Adam(amsgrad=True))
    client.configure_optimizer(config, ["w"])
    client.push([DenseGradient("w", np.ones(3, "float32"))])
    state = client.optimizer_state(["w"])["w"]
    assert state.iterations == 1
    assert list(state.slots) == ["momentum", "velocity", "velocity_hat"]
    assert all(slot.shape == (3,) for slot in state.slots.values())


def test_many_variables_in_one_call(client):
    items = [VariableInit(f"v{index}", np.full(index + 1, index, "float32"))
             for index in range(200)]
    client.create(items)
    states = client.pull([item.name for item in items])
    for index, state in enumerate(states):
        np.testing.assert_array_equal(state.value, np.full(index + 1, index))
