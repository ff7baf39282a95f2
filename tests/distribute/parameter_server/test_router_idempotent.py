"""`RemoteVariables.idempotent_updates`: a re-run closure's pushes are applied once.

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
    """`(RemoteVariables, entries)`: two variables, one on each of two servers, under SGD(1.0)."""
    with _ps.in_process_servers(2) as cluster:
        strategy = kdist.ParameterServerStrategy(cluster.resolver())
        with strategy.scope():
            variables = [keras.Variable(np.zeros(3, "float32")) for _ in range(2)]
        remote_variables = strategy.extended.remote_variables
        entries = remote_variables.entries(variables)
        assert sorted(entry.placement.shards[0].ps_index for entry in entries) == [0, 1]
        remote_variables.configure_optimizer(
            keras.optimizers.serialize(keras.optimizers.SGD(1.0)), entries)
        yield remote_variables, entries


def _closure(remote_variables, entries, num_pushes):
    gradients = [(entry, np.ones(3, "float32")) for entry in entries]
    for _ in range(num_pushes):
        remote_variables.push(gradients)


def _applied(remote_variables):
    return [sum(item.applied_updates for item in stats.variables.values())
            for stats in remote_variables.stats()]


def test_a_rerun_block_applies_nothing_again(remote):
    remote_variables, entries = remote
    with remote_variables.idempotent_updates("closure-5"):
        _closure(remote_variables, entries, 3)
    assert _applied(remote_variables) == [3, 3]
    with remote_variables.idempotent_updates("closure-5"):  # the re-run on another worker
        _closure(remote_variables, entries, 3)
    assert _applied(remote_variables) == [3, 3]
    assert [stats.deduplicated_updates for stats in remote_variables.stats()] == [3, 3]
    for entry in entries:
        [value] = remote_variables.read_shards(entry, [0])
        np.testing.assert_array_equal(value, np.full(3, -3.0))  # SGD(1.0), three pushes of ones


def test_a_rerun_after_a_partial_first_run_applies_only_the_rest(remote):
    remote_variables, entries = remote
    with remote_variables.idempotent_updates("closure-6"):
        _closure(remote_variables, entries, 2)  # the first worker died here
    with remote_variables.idempotent_updates("closure-6"):
        _closure(remote_variables, entries, 3)
    assert _applied(remote_variables) == [3, 3]
    assert [stats.deduplicated_updates for stats in remote_variables.stats()] == [2, 2]


def test_pushes_outside_a_block_each_apply(remote):
    remote_variables, entries = remote
    _closure(remote_variables, entries, 2)
    _closure(remote_variables, entries, 2)
    assert _applied(remote_variables) == [4, 4]


def test_ids_per_block_nested_blocks_and_threads(remote, monkeypatch):
    remote_variables, entries = remote
    sent = []
    for client in remote_variables.clients:
        push = client.push

        def recording(gradients, assignments=(), update_id=None, push=push, address=client.address):
            sent.append((address, update_id))
            return push(gradients, assignments, update_id=update_id)

        monkeypatch.setattr(client, "push", recording)
    gradients = [(entry, np.ones(3, "float32")) for entry in entries]

    def sent_ids():
        # Every push goes to both servers with the same id.
        by_server = [[update_id for address, update_id in sent if address == client.address]
                     for client in remote_variables.clients]
        assert by_server[0] == by_server[1]
        sent.clear()
        return by_server[0]

    with remote_variables.idempotent_updates("outer"):
        remote_variables.push(gradients)
        with remote_variables.idempotent_updates("inner"):
            remote_variables.push(gradients)
            remote_variables.push(gradients, update_id="explicit")
            remote_variables.push(gradients)
        remote_variables.push(gradients)
        other_thread = threading.Thread(target=remote_variables.push, args=(gradients,))
        other_thread.start()
        other_thread.join(timeout=60)
    remote_variables.push(gradients)
    assert sent_ids() == ["outer/0", "inner/0", "explicit", "inner/1", "outer/1", None, None]


@pytest.mark.parametrize("prefix", ["", None, 7])
def test_a_block_needs_a_string_prefix(remote, prefix):
    remote_variables, _ = remote
    with pytest.raises(InvalidArgumentError, match="prefix"):
        with remote_variables.idempotent_updates(prefix):
            pass


def test_an_overlong_update_id_is_refused_before_anything_is_sent(remote):
    remote_variables, entries = remote
    with pytest.raises(InvalidArgumentError, match="update_id"):
        remote_variables.push([(entries[0], np.ones(3, "float32"))], update_id="x" * 257)
    assert _applied(remote_variables) == [0, 0]
