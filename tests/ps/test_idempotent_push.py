"""Exactly-once pushes: a push's `update_id` is applied once per server."""

import dataclasses
import threading

import numpy as np
import pytest

from kdist.errors import InvalidArgumentError, ParameterServerError
from kdist.ps import Assignment, DenseGradient, RowGradient, VariableClient, VariableInit
from kdist.ps.client import variable_client as client_module
from kdist.ps.server.store import GradientSpec, MAX_REMEMBERED_UPDATES, VariableStore
from kdist.ps.wire._generated import variable_service_pb2 as pb
from tests.ps.conftest import sgd_config

pytestmark = pytest.mark.timeout(120)

NUM_THREADS = 8


def _create(client, value=None):
    value = np.zeros((4, 3), "float32") if value is None else value
    client.create([VariableInit("w", value)])
    client.configure_optimizer(sgd_config(1.0), ["w"])


def _value(client):
    [state] = client.pull(["w"])
    return state.value


def _ones():
    return [DenseGradient("w", np.ones((4, 3), "float32"), version=0)]


def test_a_repeated_update_id_is_applied_once_with_the_first_result(client):
    _create(client)
    first = client.push(_ones(), update_id="closure-1/0")
    again = client.push(_ones(), update_id="closure-1/0")
    assert again == dataclasses.replace(first, deduplicated=True) and first.versions == {"w": 1}
    assert first.deduplicated is False
    np.testing.assert_array_equal(_value(client), np.full((4, 3), -1.0))
    stats = client.stats()
    assert stats.deduplicated_updates == 1
    assert stats.variables["w"].applied_updates == 1 and stats.applied_pushes == 1


def test_different_update_ids_all_apply(client):
    _create(client)
    results = [client.push(_ones(), update_id=f"closure-1/{n}") for n in range(3)]
    assert [result.versions["w"] for result in results] == [1, 2, 3]
    np.testing.assert_array_equal(_value(client), np.full((4, 3), -3.0))
    assert client.stats().deduplicated_updates == 0


@pytest.mark.parametrize("update_id", [None, ""])
def test_pushes_without_an_update_id_each_apply(client, update_id):
    _create(client)
    client.push(_ones(), update_id=update_id)
    client.push(_ones(), update_id=update_id)
    np.testing.assert_array_equal(_value(client), np.full((4, 3), -2.0))
    stats = client.stats()
    assert stats.variables["w"].applied_updates == 2 and stats.deduplicated_updates == 0


def test_no_update_id_sends_the_same_bytes_as_before():
    gradients = [pb.GradientMeta(name="w", kind=pb.DENSE)]
    assert (pb.PushHeader(gradients=gradients, update_id="").SerializeToString()
            == pb.PushHeader(gradients=gradients).SerializeToString())


def test_assign_with_a_repeated_update_id_is_applied_once(client):
    client.create([VariableInit("mean", np.zeros(3, "float32"), trainable=False)])
    assert client.assign([Assignment("mean", np.ones(3, "float32"))], update_id="a") == {"mean": 1}
    assert client.assign([Assignment("mean", np.ones(3, "float32"))], update_id="a") == {"mean": 1}
    [state] = client.pull(["mean"])
    assert state.version == 1 and client.stats().deduplicated_updates == 1


def test_concurrent_pushes_with_one_new_update_id_apply_once(server, options):
    with VariableClient(server.address, options=options) as setup:
        _create(setup)
    barrier = threading.Barrier(NUM_THREADS, timeout=30)
    results, errors = [None] * NUM_THREADS, []

    def push(index):
        try:
            # One client per thread (separate channels), as separate workers have.
            with VariableClient(server.address, options=options) as client:
                client.wait_until_ready(30)
                barrier.wait()
                results[index] = client.push(_ones(), update_id="closure-7/0")
        except BaseException as error:  # reported below, with the thread's index
            errors.append((index, error))

    threads = [threading.Thread(target=push, args=(index,)) for index in range(NUM_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a pushing thread hung"
    assert not errors, errors
    # One applied; every other got its result, marked as a repeat.
    assert sorted(result.deduplicated for result in results) == [False] + [True] * (NUM_THREADS - 1)
    assert all(dataclasses.replace(result, deduplicated=False) == dataclasses.replace(results[0], deduplicated=False)
               for result in results) and results[0].versions == {"w": 1}
    stats = server.stats()
    assert stats.variables["w"].applied_updates == 1
    assert stats.deduplicated_updates == NUM_THREADS - 1
    with VariableClient(server.address, options=options) as client:
        np.testing.assert_array_equal(_value(client), np.full((4, 3), -1.0))


@pytest.mark.parametrize("invalid", [
    [DenseGradient("w", np.ones((4, 4), "float32"))],  # refused with the header
    [RowGradient("w", np.array([9]), np.ones((1, 3), "float32"))],  # refused with the payload
])
def test_a_refused_push_does_not_use_up_its_update_id(client, invalid):
    _create(client)
    with pytest.raises(ParameterServerError) as caught:
        client.push(invalid, update_id="closure-2/0")
    assert caught.value.code_name == "INVALID_ARGUMENT"
    result = client.push(_ones(), update_id="closure-2/0")
    assert result.versions == {"w": 1}
    np.testing.assert_array_equal(_value(client), np.full((4, 3), -1.0))
    assert client.stats().deduplicated_updates == 0


def test_an_overlong_update_id_is_refused_and_changes_nothing(client, monkeypatch):
    _create(client)
    with pytest.raises(InvalidArgumentError, match="update_id"):
        client.push(_ones(), update_id="x" * 257)
    # The server checks too, for clients that do not.
    monkeypatch.setattr(client_module, "check_update_id", lambda update_id: None)
    with pytest.raises(ParameterServerError, match="update_id") as caught:
        client.push(_ones(), update_id="x" * 257)
    assert caught.value.code_name == "INVALID_ARGUMENT"
    [state] = client.pull(["w"])
    assert state.version == 0 and not state.value.any()
    assert client.push(_ones(), update_id="x" * 256).versions == {"w": 1}


def _store_push(store, update_id):
    plan = store.plan_update([GradientSpec("w", False, np.dtype("float32"), (3,))], [])
    return store.apply_update(plan, [np.ones(3, "float32")], update_id=update_id)


def _sgd_store(**kwargs):
    store = VariableStore(**kwargs)
    store.create([("w", np.zeros(3, "float32"), True)])
    store.configure_optimizer(sgd_config(1.0), ["w"])
    return store


def test_a_push_waits_while_another_holds_its_update_id():
    store = _sgd_store()
    assert store.update_ids.claim("x") == (False, None)  # as if a push were applying "x"
    results = []
    thread = threading.Thread(target=lambda: results.append(_store_push(store, "x")))
    thread.start()
    thread.join(timeout=0.2)
    assert thread.is_alive() and store.stats().variables["w"].version == 0
    store.update_ids.release("x")  # that push failed: this one applies
    thread.join(timeout=30)
    assert results == [({"w": 1}, (), {}, False, b"")]


def test_the_oldest_update_ids_are_forgotten_first():
    assert VariableStore().update_ids.capacity == MAX_REMEMBERED_UPDATES == 65_536
    store = _sgd_store(max_remembered_updates=3)
    for update_id in "abcd":  # "a" is forgotten
        _store_push(store, update_id)
    assert _store_push(store, "d")[0] == {"w": 4}  # remembered: not applied again
    assert _store_push(store, "a")[0] == {"w": 5}  # forgotten: applied again
    stats = store.stats()
    assert stats.variables["w"].applied_updates == 5 and stats.deduplicated_updates == 1
