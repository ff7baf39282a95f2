"""`VariableRouter.idempotent_updates`: a re-run closure's pushes are applied once.

Real variable servers on loopback ports, in this process.
"""

import threading

import keras
import numpy as np
import pytest

import kdist
from kdist.errors import InvalidArgumentError
from tests.keras import _ps

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def remote():
    """`(VariableRouter, routes)`: two variables, one on each of two servers, under SGD(1.0)."""
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            variables = [keras.Variable(np.zeros(3, "float32")) for _ in range(2)]
        variable_router = strategy.extended.variable_router
        routes = variable_router.routes(variables)
        assert sorted(route.placement.shards[0].ps_index for route in routes) == [0, 1]
        variable_router.configure_optimizer(
            keras.optimizers.serialize(keras.optimizers.SGD(1.0)), routes)
        yield variable_router, routes


def _closure(variable_router, routes, num_pushes):
    gradients = [(route, np.ones(3, "float32")) for route in routes]
    for _ in range(num_pushes):
        variable_router.send_gradients(gradients)


def _applied(variable_router):
    return [sum(item.applied_updates for item in stats.variables.values())
            for stats in variable_router.stats()]


def test_a_rerun_block_applies_nothing_again(remote):
    variable_router, routes = remote
    with variable_router.idempotent_updates("closure-5"):
        _closure(variable_router, routes, 3)
    assert _applied(variable_router) == [3, 3]
    with variable_router.idempotent_updates("closure-5"):  # the re-run on another worker
        _closure(variable_router, routes, 3)
    assert _applied(variable_router) == [3, 3]
    assert [stats.deduplicated_updates for stats in variable_router.stats()] == [3, 3]
    for route in routes:
        [value] = variable_router.read_shards(route, [0])
        np.testing.assert_array_equal(value, np.full(3, -3.0))  # SGD(1.0), three pushes of ones


def test_a_rerun_after_a_partial_first_run_applies_only_the_rest(remote):
    variable_router, routes = remote
    with variable_router.idempotent_updates("closure-6"):
        _closure(variable_router, routes, 2)  # the first worker died here
    with variable_router.idempotent_updates("closure-6"):
        _closure(variable_router, routes, 3)
    assert _applied(variable_router) == [3, 3]
    assert [stats.deduplicated_updates for stats in variable_router.stats()] == [2, 2]


def test_pushes_outside_a_block_each_apply(remote):
    variable_router, routes = remote
    _closure(variable_router, routes, 2)
    _closure(variable_router, routes, 2)
    assert _applied(variable_router) == [4, 4]


def test_ids_per_block_nested_blocks_and_threads(remote, monkeypatch):
    variable_router, routes = remote
    sent = []
    for client in variable_router.clients:
        push = client.push

        def recording(gradients, assignments=(), update_id=None, push=push, address=client.address, **kwargs):
            sent.append((address, update_id))
            return push(gradients, assignments, update_id=update_id, **kwargs)

        monkeypatch.setattr(client, "push", recording)
    gradients = [(route, np.ones(3, "float32")) for route in routes]

    def sent_ids():
        # Every push goes to both servers with the same id.
        by_server = [[update_id for address, update_id in sent if address == client.address]
                     for client in variable_router.clients]
        assert by_server[0] == by_server[1]
        sent.clear()
        return by_server[0]

    with variable_router.idempotent_updates("outer"):
        variable_router.send_gradients(gradients)
        with variable_router.idempotent_updates("inner"):
            variable_router.send_gradients(gradients)
            variable_router.send_gradients(gradients, update_id="explicit")
            variable_router.send_gradients(gradients)
        variable_router.send_gradients(gradients)
        other_thread = threading.Thread(target=variable_router.send_gradients, args=(gradients,))
        other_thread.start()
        other_thread.join(timeout=60)
    variable_router.send_gradients(gradients)
    assert sent_ids() == ["outer/0", "inner/0", "explicit", "inner/1", "outer/1", None, None]


@pytest.mark.parametrize("prefix", ["", None, 7])
def test_a_block_needs_a_string_prefix(remote, prefix):
    variable_router, _ = remote
    with pytest.raises(InvalidArgumentError, match="prefix"):
        with variable_router.idempotent_updates(prefix):
            pass


def test_an_overlong_update_id_is_refused_before_anything_is_sent(remote):
    variable_router, routes = remote
    with pytest.raises(InvalidArgumentError, match="update_id"):
        variable_router.send_gradients([(routes[0], np.ones(3, "float32"))], update_id="x" * 257)
    assert _applied(variable_router) == [0, 0]
